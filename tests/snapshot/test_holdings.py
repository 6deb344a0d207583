"""Completeness from what the stream holds (issue 26, point 2): a stream
loses messages from its middle too (a per-subject limit, a delete), while its
first sequence stays put; a late consumer and a restarted bridge judge from
the stream's deletions as well, and flag what they cannot have."""

from __future__ import annotations

from pathlib import Path

import anyio
import nats
import pytest

from bridge.client.bootstrap import BootstrapOptions, Found, LiveGate, RankKey, fetch, stream_opening
from bridge.client.subscribe import StartAt
from bridge.contract.holdings import StreamHoldings, holdings_from_state
from bridge.contract.snapshot import SNAPSHOT_VERSION, RankSnapshot, SnapshotMissing
from bridge.runtime.nats_server import NatsServerProcess
from bridge.runtime.stream_state import stream_holdings
from tests.client.builders import record
from tests.client.live import live_index, wait_until
from tests.snapshot.rig import Worker, late_index
from tests.snapshot.views import index_state

pytestmark = pytest.mark.anyio


def _snap(stream_seq: int) -> RankSnapshot:
    return RankSnapshot(v=SNAPSHOT_VERSION, worker="w", dp_rank=0, epoch=1, taken_at=1.0, through="x",
                        stream_seq=stream_seq)


def test_a_deletion_after_a_position_means_the_stream_no_longer_holds_all_after_it() -> None:
    held = StreamHoldings(first_seq=1, last_seq=100, deleted=(10, 11, 40))
    assert held.holds_after(40) and held.holds_after(100) and held.holds_after(500)
    assert not held.holds_after(39) and not held.holds_after(0)
    assert "1 message(s) after stream sequence 39" in held.missing_after(39)
    rolled = StreamHoldings(first_seq=50, last_seq=100)
    assert rolled.holds_after(49) and not rolled.holds_after(48)
    unknown = StreamHoldings(first_seq=1, last_seq=100, deletions_unknown=True)
    assert unknown.holds_after(100) and not unknown.holds_after(99)
    assert holdings_from_state({"first_seq": 1, "last_seq": 9, "num_deleted": 2, "deleted": [7, 3]}) == \
        StreamHoldings(1, 9, (3, 7))
    assert holdings_from_state({"first_seq": 1, "last_seq": 9, "num_deleted": 2}).deletions_unknown
    empty = holdings_from_state({"first_seq": 10, "last_seq": 9})
    assert empty.holds_after(9) and not empty.holds_after(8)


def test_the_opening_and_the_gate_flag_what_the_stream_deleted() -> None:
    held = StreamHoldings(first_seq=1, last_seq=100, deleted=(60,))
    found: dict[RankKey, Found] = {("w", 0): _snap(50), ("w", 1): _snap(70)}
    found[("w", 1)] = RankSnapshot(v=SNAPSHOT_VERSION, worker="w", dp_rank=1, epoch=1, taken_at=1.0, through="y",
                                   stream_seq=70)
    plan = stream_opening(found, held)
    assert [(type(i).__name__, i.dp_rank) for i in plan.items] == [
        ("RankSnapshot", 0), ("SnapshotMissing", 0), ("RankSnapshot", 1)]
    # A record that resets a view is a fresh start only if nothing after it is gone.
    gate = LiveGate(found, plan.skip_seq, held)
    restart = record("restart", worker="w", rank=0, epoch=2, seq=0)
    after = gate.after(restart, 55)
    assert type(after) is SnapshotMissing and after.dp_rank == 0
    assert gate.after(restart, 80) is None
    assert gate.after(record("gap", worker="w", gap=(1, 2)), 55) is None
    assert LiveGate(found).after(restart, 55) is None  # core NATS: no stream to judge


async def test_a_per_subject_limit_leaves_late_views_and_rebuilt_snapshots_flagged_partial(
    nats_server: NatsServerProcess, tmp_path: Path,
) -> None:
    """With `--stream-max-msgs-per-subject 30` the stream keeps the worker's
    `start` record (its first sequence stays 1) and drops most group messages
    after it. A consumer replaying it with no snapshot, and the bridge
    rebuilding from it after a crash, get a partial view and say so; a
    consumer whose snapshot is the bridge's latest has lost nothing."""
    worker = Worker(tmp_path, "pod-c", nats_server.url, jetstream=True,
                    extra=("--stream-max-msgs-per-subject", "30", "--snapshot-bucket", ""))
    try:
        async with live_index(nats_server.url) as watcher:
            await worker.start()
            worker.publish(80)
            await wait_until(lambda: worker.caught_up(watcher), 30)
            nc = await nats.connect(nats_server.url)
            try:
                held = await stream_holdings(nc.jetstream(), "KV_EVENTS")
            finally:
                await nc.close()
            assert held.first_seq == 1 and held.deleted, held
            # The bridge answers with its latest snapshot: the stream holds all after it.
            async with late_index(nats_server.url, since=StartAt("snapshot"),
                                  bootstrap=BootstrapOptions(bucket="", discover_s=0.3)) as (late, sub):
                await wait_until(lambda: bool(sub.sources) and late.view("pod-c", 0) is not None, 20)
                worker.publish(5)
                await wait_until(lambda: worker.caught_up(watcher), 30)
                await wait_until(lambda: index_state(late) == index_state(watcher), 20)
                assert [s.source for s in sub.sources] == ["service"]
                assert not late.view("pod-c", 0).partial  # type: ignore[union-attr]

            await anyio.to_thread.run_sync(worker.bridge.kill9)
            # No bridge, no bucket: the stream from its start, where the start record survived.
            async with late_index(nats_server.url, since=StartAt("snapshot"),
                                  bootstrap=BootstrapOptions(bucket="", discover_s=0.3)) as (late, sub):
                await wait_until(lambda: (v := late.view("pod-c", 0)) is not None and v.last_seq is not None
                                 and v.last_seq >= worker.last_seq() - 1, 20)
                view = late.view("pod-c", 0)
                assert view is not None and view.partial and view.stale, "a view short of deleted messages"

            # The bridge restarts and rebuilds from the same stream: partial, and its snapshots say so.
            await worker.start()
            rebuilt = await worker.wait_logged("snapshot_rebuilt")
            assert rebuilt["partial"] is True, rebuilt
            nc = await nats.connect(nats_server.url)
            try:
                got, source = await fetch(nc, BootstrapOptions(bucket="", timeout_s=5.0), None, "pod-c", 0)
            finally:
                await nc.close()
            assert source.source == "service" and type(got) is RankSnapshot and got.complete is False
    finally:
        worker.close()
