"""Cluster fixtures: three nats-servers with routes and JetStream, and the
table of every CLUSTER line at the end of the run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.harness import NatsCluster
from tests.cluster.scenario import reported


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    nats = NatsCluster(tmp_path / "cluster").start()
    try:
        yield nats
    finally:
        nats.stop()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    figures = reported()
    if not figures:
        return
    tr = terminalreporter
    tr.section("cluster fault table")
    tr.write_line(f"{'fault':36} {'sent':>5} {'once':>5} {'copies':>6} {'late':>5} {'late!':>5} {'lost':>5} "
                  f"{'lost!':>5} gaps")
    for f in figures:
        gaps = ",".join(f"{k}:{v}" for k, v in sorted(f.gaps.items())) or "-"
        tr.write_line(f"{f.name:36} {f.sent:>5} {f.stored:>5} {f.copies:>6} {f.late:>5} {f.late_unannounced:>5} "
                      f"{f.lost:>5} {f.lost_unannounced:>5} {gaps}")
