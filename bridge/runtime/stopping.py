"""How a command ends on SIGINT (Ctrl-C) or SIGTERM: a consumer's work is
cancelled, which then closes its NATS connection, however far it got
(connecting, bootstrapping, watching); the bridge is told to stop, and drains."""

from __future__ import annotations

import signal
import threading
from collections.abc import Awaitable, Callable

import anyio
import structlog

log = structlog.get_logger("bridge.runtime.stopping")

# How long closing the NATS connection may take once asked to stop.
CLOSE_S = 3.0


async def until_signal(main: Callable[[], Awaitable[int]]) -> int:
    """Runs `main` until it returns (its exit code) or a signal comes (0).
    Off the main thread (a test driving the command) signals are not ours
    to take: `main` runs alone."""
    if threading.current_thread() is not threading.main_thread():
        return await main()
    rc = 0
    async with anyio.create_task_group() as tg:
        async def _signals() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    tg.cancel_scope.cancel()
                    return

        async def _run() -> None:
            nonlocal rc
            rc = await main()
            tg.cancel_scope.cancel()

        tg.start_soon(_signals)
        tg.start_soon(_run)
    return rc


async def stop_on_signal(stop: anyio.Event) -> None:
    """Sets `stop` at the first SIGTERM or SIGINT."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("signal", signal=signal.Signals(signum).name)
            stop.set()
            return


async def close_quietly(close: Callable[[], Awaitable[None]]) -> None:
    """Closes even when the caller is being cancelled, within CLOSE_S."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_S):
        await close()
