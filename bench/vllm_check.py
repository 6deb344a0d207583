"""Proof that the benchmark's traffic is vLLM 0.33.0's wire format: every
payload decodes with vLLM's own `KVEventBatch` and re-encodes, with vLLM's own
msgspec encoder, to the very same bytes. Run by `bench.run` when vLLM is
installed; prints one JSON line."""

from __future__ import annotations

import json
import sys
from importlib.metadata import version
from pathlib import Path

import msgspec

from bench.traffic import load


def main() -> int:
    from vllm.distributed.kv_events import KVEventBatch

    pools = load(Path(sys.argv[1]))
    decode = msgspec.msgpack.Decoder(KVEventBatch).decode
    encode = msgspec.msgpack.Encoder().encode
    checked = same = 0
    kinds: set[str] = set()
    for pool in pools.values():
        for payload in pool.payloads:
            batch = decode(payload)
            checked += 1
            same += encode(batch) == payload
            kinds.update(getattr(e, "kv_cache_spec_kind", None) or "" for e in batch.events)
    print(json.dumps({"vllm": version("vllm"), "payloads": checked, "identical": same,
                      "kinds": sorted(k for k in kinds if k)}))
    return 0 if checked == same else 1


if __name__ == "__main__":
    raise SystemExit(main())
