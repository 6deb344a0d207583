"""A flush that returns once the server has read everything sent before it.

nats-py's `flush()` writes its PING straight onto the socket, ahead of the
commands still waiting in its pending buffer (a SUB just made, a publish):
its PONG can come back before the server has read them, so `subscribe()` then
`flush()` does not make the subscription live before, say, a publish from
another connection. A second PING is behind them: `flush()` wakes nats-py's
flusher (which hands the pending buffer to the socket) before it waits, and
asyncio runs woken tasks before it reads the socket again, so by the time the
first PONG is read the pending commands are on the socket, and the second
PONG answers a PING the server read after them.
"""

from __future__ import annotations

from nats.aio.client import Client

FLUSH_TIMEOUT_S = 10


async def flushed(nc: Client, timeout: int = FLUSH_TIMEOUT_S) -> None:
    """`nc.flush()`, except that it also covers what nats-py had not yet
    written when it was called (see the module's docstring)."""
    await nc.flush(timeout)
    await nc.flush(timeout)
