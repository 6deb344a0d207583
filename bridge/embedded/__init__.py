"""What a newcomer gets without infrastructure: a local nats-server, and `kv-bridge demo`
(its vLLM stand-ins are bridge.testing's)."""
