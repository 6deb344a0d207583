"""Consumers' command-line tools; they read only the NATS contract."""
