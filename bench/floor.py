"""The floor: ZMQ receive plus msgspec decode into the bridge's own wire
structs, nothing else (no normalization, no NATS). What any bridge written in
Python on this stack must spend at least.

Driven by JSON lines on stdin: {"op": "expect", "events": N, "latency": bool}
receives until N vLLM events are decoded and answers on stdout with the time of
the last one and, if asked, publish-to-decode latencies.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import msgspec
import zmq

from bench.stats import LatencyLog
from bridge.contract import KVEventBatch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--rcvhwm", type=int, default=100_000)
    args = ap.parse_args()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, args.rcvhwm)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(args.endpoint)
    decode = msgspec.msgpack.Decoder(KVEventBatch).decode
    recv = sock.recv_multipart
    clock = time.time
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        want = cmd["events"]
        lat = LatencyLog() if cmd.get("latency") else None
        got = batches = 0
        last_seq = -1
        t_last = 0.0
        while got < want:
            # Drain without blocking, then block in poll: the cheapest receive loop pyzmq offers.
            try:
                while True:
                    _topic, seq, payload = recv(zmq.NOBLOCK)
                    batch = decode(payload)
                    last_seq = int.from_bytes(seq, "big")
                    n = len(batch.events)
                    got += n
                    batches += 1
                    if lat is not None:
                        lat.add(clock() - batch.ts, n)
            except zmq.Again:
                t_last = clock()
                if got < want:
                    sock.poll()
        out.write(json.dumps({
            "events": got, "batches": batches, "t_last": t_last, "last_seq": last_seq,
            "latency": lat.summary() if lat is not None else None,
        }) + "\n")
        out.flush()
    sock.close(linger=0)
    ctx.term()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
