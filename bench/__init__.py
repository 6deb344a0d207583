"""kv-bridge benchmark: `python -m bench.run` (see the README (Benchmark))."""
