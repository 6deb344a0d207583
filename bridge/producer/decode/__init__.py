"""vLLM's msgpack wire format, decoded tolerantly."""
