"""How a command ends on SIGINT (Ctrl-C), SIGTERM or SIGHUP: a consumer's
work is cancelled, which then closes its NATS connection, however far it got
(connecting, bootstrapping, watching); the bridge is told to stop, and drains.
SIGHUP (a closed terminal, a dropped ssh session, the kernel's hang-up of a
process group left without its parent) stops it as SIGTERM does, unless the
process started with SIGHUP ignored (`nohup`), which then stays so.

The signals stay caught until the command has ended: a SIGTERM that comes
again meanwhile changes nothing (`timeout`, and supervisors that signal a
process and then its group, send it twice), so the drain is never cut short
by the default action. Only a second SIGINT to the bridge, Ctrl-C twice at a
terminal, ends it at once."""

from __future__ import annotations

import signal
import threading
from collections.abc import Awaitable, Callable

import anyio
import structlog

from bridge.runtime.signals import stop_signals

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
    # Opened around the task group, so that signals stay caught while the
    # cancelled work closes its connection.
    with anyio.open_signal_receiver(*stop_signals()) as signals:
        async with anyio.create_task_group() as tg:
            async def _signals() -> None:
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
    """Sets `stop` at the first of `stop_signals`; runs until cancelled (the
    end of the bridge's run), holding the signals that come after: a SIGTERM
    or SIGHUP again is logged and ignored, a second SIGINT ends the process
    at once."""
    with anyio.open_signal_receiver(*stop_signals()) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            if not stop.is_set():
                log.info("signal", signal=name)
                stop.set()
            elif signum == signal.SIGINT:
                log.warning("signal_again", signal=name, note="ending now, without finishing the drain")
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                signal.raise_signal(signal.SIGINT)
            else:
                log.info("signal_ignored", signal=name, note="already stopping")


async def close_quietly(close: Callable[[], Awaitable[None]]) -> None:
    """Closes even when the caller is being cancelled, within CLOSE_S."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_S):
        await close()
