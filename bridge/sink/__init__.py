"""NATS: subjects, encoding, publishing."""
