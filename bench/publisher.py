"""The vLLM side of the benchmark, one process per measured consumer.

Speaks vLLM 0.33.0's PUB protocol (`[topic, seq 8-byte big-endian, payload]`,
seq from 0, +1 per batch) with pre-encoded payloads whose `ts` it stamps at
send time. It binds an XPUB rather than vLLM's PUB: the same wire for the
subscriber, but it can wait until the subscription has arrived (no slow-joiner
loss), and with XPUB_NODROP a burst waits at the high-water mark instead of
being dropped, so a throughput run measures the consumer, not ZMQ's drops.

Driven by JSON lines on stdin, answers on stdout:
  {"op": "wait_sub", "timeout": s}
  {"op": "blast", "size": B, "batches": N}            as fast as it can
  {"op": "paced", "size": B, "rate": events_per_s, "duration": s}
  {"op": "quit"}
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import zmq

from bench.traffic import load, stamp


class Feeder:
    def __init__(self, endpoint: str, traffic: Path, hwm: int) -> None:
        self.pools = load(traffic)
        self._bufs = {size: [bytearray(p) for p in pool.payloads] for size, pool in self.pools.items()}
        self._cursor = dict.fromkeys(self.pools, 0)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.setsockopt(zmq.XPUB_NODROP, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        # the endpoint bound (a `:0` or `:*` port is the kernel's choice)
        self.endpoint: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.seq = 0

    def wait_sub(self, timeout: float) -> dict[str, Any]:
        if self.sock.poll(int(timeout * 1000)):
            return {"subscribed": self.sock.recv()[:1] == b"\x01"}
        return {"subscribed": False}

    def _send(self, size: int, count: int, interval: float | None) -> dict[str, Any]:
        pool = self.pools[size]
        bufs = self._bufs[size]
        n_pool = len(bufs)
        cursor = self._cursor[size]
        send = self.sock.send_multipart
        clock = time.time
        events = deliverable = 0
        first_seq = self.seq
        late_max = 0.0
        t0 = clock()
        start = time.perf_counter()
        for i in range(count):
            if interval is not None:
                due = start + i * interval
                ahead = due - time.perf_counter()
                if ahead > 0:
                    time.sleep(ahead)
                else:
                    late_max = max(late_max, -ahead)
            k = (cursor + i) % n_pool
            buf = bufs[k]
            stamp(buf, clock())
            send((b"", self.seq.to_bytes(8, "big"), buf))
            self.seq += 1
            events += pool.events[k]
            deliverable += pool.deliverable[k]
        t1 = clock()
        self._cursor[size] = (cursor + count) % n_pool
        return {
            "t0": t0, "t1": t1, "batches": count, "events": events, "deliverable": deliverable,
            "first_seq": first_seq, "last_seq": self.seq - 1, "late_max_s": late_max,
        }

    def blast(self, size: int, batches: int) -> dict[str, Any]:
        return self._send(size, batches, None)

    def paced(self, size: int, rate: float, duration: float) -> dict[str, Any]:
        count = max(1, round(rate * duration / size))
        return self._send(size, count, size / rate)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--traffic", required=True, type=Path)
    ap.add_argument("--hwm", type=int, default=100_000)
    args = ap.parse_args()
    feeder = Feeder(args.endpoint, args.traffic, args.hwm)
    out = sys.stdout
    out.write(json.dumps({"ready": True, "endpoint": feeder.endpoint}) + "\n")
    out.flush()
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd.pop("op")
            if op == "quit":
                break
            reply = getattr(feeder, op)(**cmd)
            out.write(json.dumps(reply) + "\n")
            out.flush()
    finally:
        feeder.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
