"""vLLM's ZMQ side: the PUB subscription, frame checks, seq tracking, replay."""
