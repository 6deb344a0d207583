"""Fault suite fixtures: a nats-server that can be killed and restarted with its
store kept, and the table of every FAULT line at the end of the run."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge.runtime.nats_server import NatsServerProcess
from tests.faults.harness import reported


@pytest.fixture
def restartable_nats(tmp_path: Path) -> Iterator[NatsServerProcess]:
    """JetStream on, store in the test's directory, so kill() + start() is a
    crash and a restart of the same server with the same data."""
    store = tmp_path / "nats-store"
    store.mkdir()
    server = NatsServerProcess(jetstream=True, store_dir=str(store)).start()
    try:
        yield server
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.proc.send_signal(signal.SIGCONT)  # a test that failed while it was frozen
        server.stop()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    figures = reported()
    if not figures:
        return
    tr = terminalreporter
    tr.section("fault table")
    head = f"{'fault':42} {'sent':>6} {'recv':>6} {'dup':>4} {'lost':>5} {'annc':>5} {'unannc':>6} {'gaps':>4} {'rst':>3}"
    tr.write_line(head)
    for f in figures:
        tr.write_line(f"{f.name:42} {f.sent:>6} {f.received:>6} {f.duplicated:>4} {f.lost:>5} {f.announced:>5} "
                      f"{f.unannounced:>6} {f.gap_records:>4} {f.restarts:>3}")
