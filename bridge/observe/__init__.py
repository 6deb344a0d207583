"""Logs, metrics, health."""
