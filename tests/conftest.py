from __future__ import annotations

from collections.abc import Iterator

import pytest

from bridge.runtime.nats_server import NatsServerProcess


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def nats_server() -> Iterator[NatsServerProcess]:
    """A real nats-server with JetStream on a free loopback port."""
    with NatsServerProcess(jetstream=True) as server:
        yield server
