"""The programs on top of the bus: `tail`, `watch`, the fleet service
(`fleet`, the `kv-bridge observe` command) and the demo with its vLLM
stand-ins (`demo`)."""
