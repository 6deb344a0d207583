"""Which signals stop a command: its own module, free of the commands'
imports, because the CLI takes them before it loads anything else."""

from __future__ import annotations

import signal


def stop_signals() -> tuple[signal.Signals, ...]:
    """SIGTERM, SIGINT, and SIGHUP unless it is ignored now: a process
    started under `nohup` keeps ignoring it, as that asked."""
    if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
        return signal.SIGTERM, signal.SIGINT
    return signal.SIGTERM, signal.SIGINT, signal.SIGHUP
