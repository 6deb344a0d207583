"""The bridge's residency snapshots: its own residency (keeper), the NATS
service that answers snapshot requests, the JetStream bucket of latest
snapshots, and the rebuild after a restart."""
