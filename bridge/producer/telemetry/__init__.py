"""The bridge's own telemetry: its metrics, health and HTTP endpoint."""
