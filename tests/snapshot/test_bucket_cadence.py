"""When the bucket snapshot of a rank is written again between intervals:
once `--snapshot-events` events came since the last one, or as many events
as that one listed hashes, whichever is more. A snapshot costs its rank's
size to take and put: a large rank rewritten every few events would cost
far more per event than a small one, and a consumer starting from it
replays no more events than it listed hashes."""

from __future__ import annotations

import msgspec
import pytest

from bridge.contract.snapshot import TierState
from bridge.producer.snapshot.bucket import SnapshotWriter, listed
from bridge.producer.snapshot.keeper import ResidencyKeeper
from bridge.producer.telemetry.metrics import Metrics
from tests.client.builders import hi
from tests.snapshot.sim import MemoryBucket
from tests.snapshot.test_shed import WORKER, Bridge

pytestmark = pytest.mark.anyio

EVERY = 10


async def _written_after(stores: int, held: int, new_hashes: bool) -> list[int]:
    """A rank holding `held` hashes, then `stores` more stores of one hash
    each (a new one, or another copy of one it holds): the numbers of
    events after which the writer wrote again."""
    keeper = ResidencyKeeper(WORKER, max_log_bytes=1 << 30, ranks=(0,))
    bridge = Bridge(keeper)
    writer = SnapshotWriter(keeper, MemoryBucket().as_kv(), Metrics(), interval=3600.0, every_messages=EVERY,
                            max_payload=1 << 20, rewrite_after=1e9)
    for i in range(held):
        bridge.store(0, hi(i))
    assert await writer.write_due(everything=True) == 1
    after = []
    for n in range(1, stores + 1):
        bridge.store(0, hi(10_000 + n) if new_hashes else hi(n % held))
        if await writer.write_due():
            after.append(n)
    return after


async def test_a_small_rank_is_written_again_every_snapshot_events() -> None:
    assert await _written_after(35, held=4, new_hashes=False) == [10, 20, 30]


async def test_a_large_rank_is_written_again_after_as_many_events_as_it_listed_hashes() -> None:
    # 25 hashes listed: written after 25 events, then the next one lists 50
    assert await _written_after(120, held=25, new_hashes=True) == [25, 75]


async def test_listed_counts_every_layer_of_every_tier() -> None:
    keeper = ResidencyKeeper(WORKER, max_log_bytes=1 << 30, ranks=(0,))
    bridge = Bridge(keeper)
    bridge.store(0, hi(1))
    keeper.catch_up()
    snap = keeper.snapshot(0)
    assert snap is not None
    group = snap.groups[0]
    gpu = TierState("GPU", [hi(1), hi(2)], [], [hi(3)], [], [hi(4), hi(5), hi(6)], [])
    cpu = TierState("CPU", [hi(7)], [2], [], [], [], [])
    two = msgspec.structs.replace(snap, groups=[msgspec.structs.replace(group, tiers=[gpu, cpu]),
                                                msgspec.structs.replace(group, group=1, tiers=[gpu])])
    # copies do not count: hashes listed, 7 in the first group and 6 in the second
    assert listed(two) == 13
