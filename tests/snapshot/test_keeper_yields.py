"""What a snapshot waits for (applying the log, reading and encoding the
residency) goes after the relay: a batch waiting in ZMQ or queued for NATS
is sent first. In JetStream mode a bucket write every --snapshot-events
events finds seconds of log to apply; taken at once, every batch meanwhile
waited behind it. A relay that never lets up cannot hold a snapshot back
for ever: after `yield_at_most` the keeper takes a slice all the same. While
the relay is busy, the keeper waits for the sink's next write, not a fixed
while. After each slice the keeper offers the CPU to other threads (ZMQ's
I/O thread makes a batch visible to the subscriber)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import anyio
import msgspec
import pytest

from bridge.contract.snapshot import encode_snapshot
from bridge.producer.snapshot import keeper as keeper_module
from bridge.producer.snapshot.keeper import ResidencyKeeper, keep_up
from tests.client.builders import hi
from tests.snapshot.test_shed import WORKER, Bridge

_T = TypeVar("_T")


class Relay:
    """Whether work waits for the relay, and how often the keeper asked."""

    def __init__(self, busy: bool) -> None:
        self.busy = busy
        self.asked = 0

    def __call__(self) -> bool:
        self.asked += 1
        return self.busy


_K = TypeVar("_K", bound=ResidencyKeeper)


def _filled(keeper: _K, messages: int) -> _K:
    """`keeper` with `messages` stores of three hashes each logged for rank 0."""
    bridge = Bridge(keeper)
    for i in range(0, 3 * messages, 3):
        bridge.store(0, hi(i), hi(i + 1), hi(i + 2))
    return keeper


def _logged(relay: Relay, messages: int, yield_at_most: float) -> ResidencyKeeper:
    return _filled(ResidencyKeeper(WORKER, max_log_bytes=1 << 30, ranks=(0,), relay_busy=relay,
                                   yield_at_most=yield_at_most), messages)


async def _held_back(relay: Relay, work: Callable[[], Awaitable[_T]], nothing_yet: Callable[[], bool]) -> _T:
    """Runs `work` with the relay busy: a while later nothing of it is done
    (`nothing_yet`); once the relay is idle, it ends."""
    relay.busy = True
    done: list[_T] = []

    async def run() -> None:
        done.append(await work())

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await anyio.sleep(0.1)
        assert not done and nothing_yet() and relay.asked > 1  # it looked, and left the relay its turn
        relay.busy = False
        with anyio.fail_after(30):
            while not done:
                await anyio.sleep(0.01)
    return done[0]


@pytest.mark.anyio
async def test_a_catch_up_for_a_snapshot_waits_while_the_relay_has_work() -> None:
    relay = Relay(busy=False)
    keeper = _logged(relay, 2000, yield_at_most=60.0)
    await _held_back(relay, keeper.catch_up_all, lambda: keeper.pending == 2000)
    assert keeper.pending == 0 and keeper.applied == {0: 2000}


@pytest.mark.anyio
async def test_a_relay_that_stays_busy_slows_a_catch_up_but_does_not_stop_it() -> None:
    relay = Relay(busy=True)
    keeper = _logged(relay, 300, yield_at_most=0.0)
    with anyio.fail_after(30):
        await keeper.catch_up_all()
    assert keeper.pending == 0 and keeper.applied == {0: 300}


@pytest.mark.anyio
async def test_an_export_waits_while_the_relay_has_work_and_gives_the_same_snapshot() -> None:
    relay = Relay(busy=False)
    keeper = _logged(relay, 2000, yield_at_most=60.0)
    keeper.catch_up()
    exported = await _held_back(relay, lambda: keeper.export(0), lambda: keeper.exporting)
    assert exported is not None
    snap, data = exported
    direct = keeper.snapshot(0)
    assert direct is not None and data == encode_snapshot(snap)
    assert len(snap.groups[0].tiers[0].trusted) == 6000
    assert data == encode_snapshot(msgspec.structs.replace(direct, taken_at=snap.taken_at))


@pytest.mark.anyio
async def test_an_export_under_a_relay_that_stays_busy_ends() -> None:
    relay = Relay(busy=False)
    keeper = _logged(relay, 2000, yield_at_most=0.0)
    keeper.catch_up()
    relay.busy = True
    with anyio.fail_after(30):
        taken = await keeper.export(0)
    assert taken is not None and len(taken[0].groups[0].tiers[0].trusted) == 6000


async def _woken_by_a_write(relay: Relay, keeper: ResidencyKeeper,
                            work: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Runs `work` with the relay busy and the keeper's own back-off longer
    than the test: once the relay is idle, only the sink's next write can
    wake it in time to apply what waited."""
    relay.busy = True
    waiting = keeper.pending
    async with anyio.create_task_group() as tg:
        tg.start_soon(work)
        await anyio.sleep(0.1)
        assert keeper.pending == waiting and relay.asked > 0
        relay.busy = False
        Bridge(keeper).store(1, hi(10**6))  # the sink hands over a write
        with anyio.fail_after(20):
            while keeper.applied.get(0, 0) < waiting:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert keeper.applied[0] == waiting


def _waiting_for_writes(relay: Relay, messages: int) -> ResidencyKeeper:
    return _filled(ResidencyKeeper(WORKER, max_log_bytes=1 << 30, ranks=(0, 1), relay_busy=relay,
                                   yield_at_most=600.0, busy_wait=600.0), messages)


@pytest.mark.anyio
async def test_the_idle_keeper_applies_once_the_relay_has_written_not_after_a_fixed_back_off() -> None:
    """At a steady load the relay is busy for a moment per batch; a keeper
    that slept a fixed while after each busy look slept through the idle
    time between batches, and its log outgrew its bound."""
    relay = Relay(busy=False)
    keeper = _waiting_for_writes(relay, 500)
    await _woken_by_a_write(relay, keeper, lambda: keep_up(keeper))


@pytest.mark.anyio
async def test_a_catch_up_for_a_snapshot_goes_on_once_the_relay_has_written() -> None:
    relay = Relay(busy=False)
    keeper = _waiting_for_writes(relay, 500)
    await _woken_by_a_write(relay, keeper, keeper.catch_up_all)


class Turns(ResidencyKeeper):
    """A keeper that notes its slices ("slice") and the CPU it offers to other
    threads after them ("cpu"), in order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.turns: list[str] = []
        super().__init__(*args, give_cpu=lambda: self.turns.append("cpu"), **kwargs)

    def catch_up(self, limit: int = 0, seconds: float = 0.0, busy: Callable[[], bool] | None = None) -> int:
        self.turns.append("slice")
        return super().catch_up(limit, seconds, busy)


def _turns(messages: int) -> Turns:
    return _filled(Turns(WORKER, max_log_bytes=1 << 30, ranks=(0,), relay_busy=Relay(busy=False)), messages)


def _offered_between_slices(turns: list[str]) -> bool:
    """Two slices never follow each other without the CPU offered between them."""
    return turns.count("slice") > 1 and all(turns[i + 1] == "cpu" for i, t in enumerate(turns) if t == "slice")


@pytest.mark.anyio
async def test_the_idle_keeper_offers_the_cpu_to_other_threads_after_each_slice() -> None:
    """Back to back, its slices kept ZMQ's I/O thread (the one that makes a
    batch from vLLM visible to the subscriber) waiting for the CPU."""
    keeper = _turns(3000)
    async with anyio.create_task_group() as tg:
        tg.start_soon(keep_up, keeper)
        with anyio.fail_after(30):
            while keeper.pending:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert keeper.applied == {0: 3000}
    assert _offered_between_slices(keeper.turns)


@pytest.mark.anyio
async def test_a_catch_up_for_a_snapshot_offers_the_cpu_after_each_slice() -> None:
    keeper = _turns(3000)
    with anyio.fail_after(30):
        await keeper.catch_up_all()
    assert keeper.applied == {0: 3000}
    assert _offered_between_slices(keeper.turns)


@pytest.mark.anyio
async def test_an_export_offers_the_cpu_between_its_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    # Slices of one step each: 9000 hashes are read faster than one slice of
    # the bridge's length, and the test is about what happens between slices.
    monkeypatch.setattr(keeper_module, "IDLE_SLICE_S", 0.0)
    keeper = _turns(3000)
    keeper.catch_up()
    keeper.turns.clear()
    loop_turns = 0

    async def other() -> None:
        nonlocal loop_turns
        while True:
            loop_turns += 1
            await anyio.sleep(0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(other)
        with anyio.fail_after(30):
            taken = await keeper.export(0)
        tg.cancel_scope.cancel()
    assert taken is not None and len(taken[0].groups[0].tiers[0].trusted) == 9000
    # the export took the loop's turns between its slices, and offered the CPU before each
    assert loop_turns > 1 and keeper.turns.count("cpu") >= loop_turns - 1
