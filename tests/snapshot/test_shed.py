"""The bridge's residency under load: read lean, and let go when too busy.

The keeper reads group payloads with their token ids left encoded, and a log
that grows past `--snapshot-log-bytes` (the bridge publishing faster than it
can also apply) is let go: the live stream keeps priority, and the ranks the
log held say so in their snapshots, stale and partial, until a record
empties their views."""

from __future__ import annotations

import anyio
import msgspec
import pytest
from prometheus_client import generate_latest

from bridge.contract import HDR_FORMAT, AllBlocksCleared, BlockStored
from bridge.contract.identity import Origin
from bridge.contract.msgid import stream_base
from bridge.producer.sink.encode import MessageEncoder
from bridge.producer.sink.subjects import SubjectBook
from bridge.producer.snapshot.keeper import GARBAGE_STEP, ResidencyKeeper, keep_up
from bridge.producer.telemetry.metrics import Metrics
from bridge.residency.lean import LeanStored, token_count
from bridge.runtime.memory import MemoryReturn
from tests.client.builders import ATTN, hi, msg, record, stored

WORKER = "pod-s"
EPOCH = 7


class Bridge:
    """Encodes contract messages as the bridge does and hands them to its keeper."""

    def __init__(self, keeper: ResidencyKeeper) -> None:
        self.keeper = keeper
        self.encoder = MessageEncoder("msgpack")
        self.seq = {0: 0, 1: 0}

    def store(self, rank: int, *hashes: int) -> None:
        self.seq[rank] += 1
        group = msg([stored(list(hashes))], worker=WORKER, rank=rank, epoch=EPOCH, seq=self.seq[rank])
        out = self.encoder.group(group, SubjectBook("kv", WORKER, rank), stream_base(WORKER, rank, EPOCH))
        self.keeper.published([out])

    def fresh_start(self, rank: int, epoch: int) -> None:
        rec = record("start", worker=WORKER, rank=rank, epoch=epoch, reason="fresh")
        base = stream_base(WORKER, rank, epoch)
        self.keeper.published([self.encoder.record(rec, SubjectBook("kv", WORKER, rank), f"{base}:t1:worker:start")])


def test_a_log_past_its_bound_is_let_go_and_its_ranks_say_so() -> None:
    keeper = ResidencyKeeper(WORKER, max_log_bytes=96 * 1024, ranks=(0, 1))
    bridge = Bridge(keeper)
    for i in range(5):
        bridge.store(0, hi(i))
    keeper.catch_up()
    view = keeper.index.view(WORKER, 0)
    assert view is not None and not view.partial and not view.stale

    # A burst: rank 0 goes on, rank 1 is new; nothing is applied meanwhile.
    i = 100
    while not keeper.sheds:
        bridge.store(i % 2, hi(i))
        i += 1
    assert keeper.pending == 0 and keeper.log_bytes == 0 and keeper.shed_messages > 0
    # Freed a little with each message logged afterwards, not all at once.
    step = GARBAGE_STEP + 2  # per message handed over, one at a time here
    assert keeper.shed_messages > 2 * step
    assert keeper.garbage == keeper.shed_messages - step
    bridge.store(0, hi(i))
    assert keeper.garbage == keeper.shed_messages - 2 * step
    keeper.free(keeper.garbage)
    for rank in (0, 1):
        view = keeper.index.view(WORKER, rank)
        assert view is not None and view.partial and view.stale, rank
        snap = keeper.snapshot(rank)
        assert snap is not None and not snap.complete, rank
    # What the view held before the burst may be gone: answered, flagged stale.
    answer = keeper.index.match(WORKER, 0, [hi(0)])
    assert answer is not None and answer.blocks == 1 and answer.stale

    # What comes after the shed is applied as before.
    bridge.store(0, hi(10_000))
    keeper.catch_up()
    assert keeper.index.match(WORKER, 0, [hi(10_000)]).blocks == 1  # type: ignore[union-attr]
    assert keeper.snapshot(0).through == f"{stream_base(WORKER, 0, EPOCH)}:{bridge.seq[0]}:0"  # type: ignore[union-attr]

    # A fresh start empties the view: it is whole again.
    bridge.fresh_start(0, EPOCH + 1)
    keeper.catch_up()
    view = keeper.index.view(WORKER, 0)
    assert view is not None and not view.partial and not view.stale
    assert keeper.snapshot(0).complete  # type: ignore[union-attr]
    assert keeper.index.view(WORKER, 1).partial  # type: ignore[union-attr]


def test_idle_catch_up_stops_after_its_time_slice() -> None:
    keeper = ResidencyKeeper(WORKER)
    bridge = Bridge(keeper)
    for i in range(2000):
        bridge.store(0, hi(i))
    # A slice this short ends after the first message; no bound: all of them.
    assert keeper.catch_up(seconds=1e-9) == 1
    assert keeper.catch_up() == 1999 and keeper.pending == 0


@pytest.mark.parametrize("tokens", [0, 1, 15, 16, 65_535, 65_536])
def test_token_count_reads_the_encoded_array(tokens: int) -> None:
    full = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=list(range(tokens)), block_size=16,
                       lora_id=None, medium="GPU", lora_name=None)
    lean = msgspec.msgpack.decode(msgspec.msgpack.encode(full), type=LeanStored)
    assert token_count(lean) == token_count(full) == tokens
    assert token_count(LeanStored(block_hashes=[1])) == 0  # not sent at all


def _with_a_clear(rank: int, seq: int, h: int) -> bytes:
    """A group payload with a clear among its events, which the contract's group events never hold."""
    bad = msgspec.to_builtins(msg([stored([h])], worker=WORKER, rank=rank, epoch=EPOCH, seq=seq))
    bad["events"].append(msgspec.to_builtins(AllBlocksCleared()))
    return msgspec.msgpack.encode(bad)


def test_a_payload_the_keeper_cannot_read_leaves_its_ranks_flagged_not_raised() -> None:
    """A group payload that is not the contract's is counted as undecodable,
    as the full decoder would count it; what it said is missing from the
    view, which turns partial, and the messages around it still apply."""
    keeper = ResidencyKeeper(WORKER, ranks=(0, 1))
    bridge = Bridge(keeper)
    bridge.store(0, hi(1))
    bridge.store(1, hi(1))
    keeper.catch_up()
    assert keeper.apply_payload({HDR_FORMAT: "msgpack"}, _with_a_clear(0, 2, hi(2))) is None
    assert keeper.undecodable == 1
    bridge.seq[0] = 2
    bridge.store(0, hi(3))
    keeper.catch_up()
    view = keeper.index.view(WORKER, 0)
    assert view is not None and view.partial
    held = view.groups[ATTN].held
    assert held("GPU", hi(1)) == held("GPU", hi(3)) == 1
    assert held("GPU", hi(2)) == 0
    # The bridge's own message names no rank it can read: every rank says so.
    assert keeper.index.view(WORKER, 1).partial  # type: ignore[union-attr]
    # and /metrics counts it
    metrics = Metrics()
    metrics.watch_residency(keeper.levels)
    assert "kvbridge_residency_undecodable_messages_total 1.0" in generate_latest(metrics.registry).decode()


def test_a_payload_read_back_undecodable_flags_the_rank_its_subject_names() -> None:
    keeper = ResidencyKeeper(WORKER, ranks=(0, 1))
    bridge = Bridge(keeper)
    bridge.store(0, hi(1))
    bridge.store(1, hi(1))
    keeper.catch_up()
    payload = _with_a_clear(1, 2, hi(2))
    assert keeper.apply_payload({HDR_FORMAT: "msgpack"}, payload, origin=Origin(WORKER, 1, ATTN)) is None
    assert keeper.index.view(WORKER, 1).partial  # type: ignore[union-attr]
    assert not keeper.index.view(WORKER, 0).partial  # type: ignore[union-attr]


@pytest.mark.anyio
async def test_a_shed_during_an_export_reaches_the_ranks_after_it() -> None:
    """An export reads the index between the loop's turns: the shed leaves it alone
    meanwhile, and the ranks learn of it before anything else is applied."""
    keeper = ResidencyKeeper(WORKER, max_log_bytes=16 * 1024, ranks=(0,))
    bridge = Bridge(keeper)
    bridge.store(0, hi(1))
    keeper.catch_up()
    keeper._exporting += 1  # as export() holds it between its slices
    i = 2
    while not keeper.sheds:
        bridge.store(0, hi(i))
        i += 1
    assert not keeper.index.view(WORKER, 0).partial  # type: ignore[union-attr]
    assert keeper.catch_up() == 0  # nothing applied while the export runs
    keeper._exporting -= 1
    bridge.store(0, hi(i))
    keeper.catch_up()
    assert keeper.index.view(WORKER, 0).partial  # type: ignore[union-attr]
    taken = await keeper.export(0)
    assert taken is not None and not taken[0].complete


@pytest.mark.anyio
async def test_an_export_gives_the_loop_its_turns_and_takes_what_snapshot_takes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A large view is exported a piece at a time on the loop (other tasks
    run between the pieces, and nothing is applied meanwhile), and the
    pieces make exactly the snapshot the keeper takes at once."""
    import anyio

    from bridge.contract.snapshot import encode_snapshot
    from bridge.producer.snapshot import keeper as keeper_module

    # One step per slice: how long a slice lasts is the bridge's tuning, not this test's.
    monkeypatch.setattr(keeper_module, "IDLE_SLICE_S", 0.0)
    keeper = ResidencyKeeper(WORKER, max_log_bytes=1 << 30, ranks=(0,))
    bridge = Bridge(keeper)
    for i in range(0, 60000, 3):
        bridge.store(0, hi(i), hi(i + 1), hi(i + 2))
    keeper.catch_up()
    turns = 0
    done = False

    async def other() -> None:
        nonlocal turns
        while not done:
            turns += 1
            await anyio.sleep(0)

    steps = keeper.index.snapshot_steps(WORKER, 0, now=1.0)
    pieces = 0
    whole = None
    while whole is None:
        try:
            next(steps)
            pieces += 1
        except StopIteration as finished:
            whole = finished.value
    assert pieces > 5
    assert encode_snapshot(whole) == encode_snapshot(keeper.index.snapshot(WORKER, 0, now=1.0))  # type: ignore[arg-type]

    async with anyio.create_task_group() as tg:
        tg.start_soon(other)
        await anyio.sleep(0)
        bridge.store(0, hi(9999))
        taken = await keeper.export(0)
        done = True
    assert taken is not None
    assert keeper.pending == 1  # the store that came during the export waits in the log
    snap = keeper.snapshot(0)
    assert snap is not None and encode_snapshot(taken[0]) == encode_snapshot(
        msgspec.structs.replace(snap, taken_at=taken[0].taken_at))
    assert turns > 1



@pytest.mark.anyio
async def test_a_big_log_gives_its_memory_back_once_applied() -> None:
    """The free memory a burst leaves stays in the process unless given
    back: once the idle keeper has applied a big log, it is, once."""
    given: list[int] = []

    def trim(pad: int) -> int:
        given.append(pad)
        return 1

    memory = MemoryReturn(trim)
    busy = True
    keeper = ResidencyKeeper(WORKER, ranks=(0,), relay_busy=lambda: busy)
    bridge = Bridge(keeper)
    async with anyio.create_task_group() as tg:
        tg.start_soon(keep_up, keeper, memory, 64 * 1024)
        i = 0
        while keeper.log_bytes < 64 * 1024:
            bridge.store(0, hi(i))
            i += 1
        await anyio.sleep(0.1)
        assert given == [] and keeper.pending  # busy: nothing applied, nothing given back
        busy = False
        with anyio.fail_after(10):
            while not given:
                await anyio.sleep(0.01)
        assert keeper.pending == 0 and keeper.log_peak == 0
        bridge.store(0, hi(i))  # a small log after it
        await anyio.sleep(0.2)
        assert keeper.pending == 0 and given == [0]
        tg.cancel_scope.cancel()
