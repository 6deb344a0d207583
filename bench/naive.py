"""The naive bridge: what a first attempt looks like.

One await per ZMQ message, decode, then for every event one JSON NATS message,
each publish awaited: `await nc.publish(...)` followed by `await nc.flush()`,
which sends PING and waits for the server's PONG, i.e. one round trip to
nats-server per event, the delivery check a careful first version reaches for
(the same round trip a per-event `await js.publish()` costs). JSON comes from
msgspec, which is kinder to the naive bridge than the standard library.
"""

from __future__ import annotations

import argparse
import asyncio

import msgspec
import nats
import zmq
import zmq.asyncio

from bridge.contract import KVEventBatch


async def bridge(endpoint: str, nats_url: str, worker: str, rcvhwm: int) -> None:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    nc = await nats.connect(nats_url)
    decode = msgspec.msgpack.Decoder(KVEventBatch).decode
    print('{"ready": true}', flush=True)
    while True:
        _topic, seq_bytes, payload = await sock.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big")
        batch = decode(payload)
        for event in batch.events:
            group = getattr(event, "group_idx", None) or 0
            body = msgspec.json.encode({"ts": batch.ts, "worker": worker, "seq": seq, "event": event})
            await nc.publish(f"naive.{worker}.{group}", body)
            await nc.flush()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--nats-url", required=True)
    ap.add_argument("--worker", default="bench-naive")
    ap.add_argument("--rcvhwm", type=int, default=100_000)
    args = ap.parse_args()
    try:
        asyncio.run(bridge(args.endpoint, args.nats_url, args.worker, args.rcvhwm))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
