"""The embedded nats-server (bridge.runtime.nats_server): the port it listens
on is its own, whether it picked it or was given it."""

from __future__ import annotations

import socket

import pytest

from bridge.runtime.nats_server import NatsServerProcess


def _info(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
        return conn.recv(4096)


def test_a_server_without_a_port_listens_on_one_it_picked() -> None:
    with NatsServerProcess(jetstream=False) as a, NatsServerProcess(jetstream=False) as b:
        assert a.port and b.port and a.port != b.port
        assert a.url == f"nats://127.0.0.1:{a.port}"
        assert _info(a.port).startswith(b"INFO") and _info(b.port).startswith(b"INFO")


def test_a_taken_port_fails_the_start_instead_of_finding_the_other_server() -> None:
    with NatsServerProcess(jetstream=False) as first:
        second = NatsServerProcess(port=first.port, jetstream=False)
        with pytest.raises(RuntimeError, match="exited"):
            second.start(timeout=10)
        assert second.proc is not None and second.proc.poll() is not None


def test_a_restart_keeps_the_port() -> None:
    server = NatsServerProcess(jetstream=True).start()
    try:
        port = server.port
        server.kill()
        server.start()
        assert server.port == port and _info(port).startswith(b"INFO")
    finally:
        server.stop()
