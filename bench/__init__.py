"""kv-bridge benchmark: `python -m bench.run` (see docs/benchmark.md)."""
