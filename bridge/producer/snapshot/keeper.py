"""The residency of the ranks this bridge publishes, as consumers will hold it.

The bridge runs the contract's own residency rules (`bridge.residency`)
over its own messages, in the order a consumer meets them: in core mode as they
are written to NATS (the sink hands each written batch over), in JetStream mode
as the stream stores them (each message with its ack, in stream order: the ack
window holds back acks that overtook a lost one until its copy is stored), so
the snapshot names the stream sequence a reader goes on from. A message's
effect lands on an index only when a snapshot needs it, or while the bridge
has nothing else to do: until then the keeper only keeps a reference to the
message, and the work of applying it stays off the path from vLLM to NATS.
While the relay keeps up (no batch waits in ZMQ, few for NATS) and the log is
short, the reference is to the struct the sink encoded (`Outgoing.body`),
applied as it is; otherwise (a burst) to the payload, decoded again when
applied, since holding the objects of a burst costs the relay more than that
decode. The log is bounded by bytes: when the
bridge is so busy that it grows past the bound, the live stream keeps
priority and the log is let go, its ranks' views turned stale and partial
(`ResidencyIndex.lose`), which is what their snapshots then say.
"""

from __future__ import annotations

import os
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from typing import Any, TypeVar

import anyio
import msgspec
import structlog

from bridge.contract import DEFAULT_FORMAT, FORMATS, HDR_FORMAT, HDR_MSG_ID, HDR_RECORD, GroupMessage, WorkerRecord
from bridge.contract import decoder_for as _decoder_for
from bridge.contract.identity import Origin, Refusal, check
from bridge.contract.snapshot import RankSnapshot, encode_snapshot_steps
from bridge.producer.decode.wire import RelayBlockStored
from bridge.producer.sink.acks import ack_seq
from bridge.producer.sink.encode import Outgoing
from bridge.residency import ResidencyIndex
from bridge.residency.cells import Cell, CellLike
from bridge.residency.lean import residency_decoder
from bridge.residency.rank_tables import RankTables
from bridge.runtime.memory import MemoryReturn

log = structlog.get_logger("bridge.producer.snapshot")
_T = TypeVar("_T")

# Applied in slices of this long while the bridge is idle, so a batch
# arriving meanwhile waits no longer than that.
IDLE_SLICE_S = 0.0005
# Within a slice, the keeper asks whether the relay has work at most this
# often: asking is a poll(2) of the relay's sockets, and at 8-event batches
# a message takes a few microseconds to apply, so asking after each one cost
# about 5% of its work, for a batch seen at most this much sooner.
BUSY_LOOK_S = 0.00005
# While work waits and the relay is busy, the keeper looks again when the
# sink hands over its next write (the moment the relay may have gone idle),
# or after this long: a batch waiting in ZMQ is not a write yet.
BUSY_WAIT_S = 0.001
# Work a snapshot waits for (a catch-up, an export) yields to a busy relay for
# at most this long at a time, then takes a slice anyway: under a load that
# never lets up it still ends (or the log is let go, and it ends then).
YIELD_AT_MOST_S = 0.05
# After each slice the thread's CPU is offered to the threads woken meanwhile:
# ZMQ's I/O thread above all, which turns the bytes vLLM sent into the message
# the subscriber's FD signals (and `relay_busy` sees). Linux's scheduler may
# let a running thread finish its time slice before a woken one on the same
# CPU: back-to-back slices kept a batch unseen for milliseconds. It returns
# at once when no thread waits.
_GIVE_CPU: Callable[[], None] = getattr(os, "sched_yield", lambda: None)
# A log that held this much, once applied or let go, leaves free memory the C
# allocator keeps unless asked to give it back (bridge.runtime.memory).
GIVE_BACK_AFTER = 8 * 1024 * 1024
# Events applied between looks at the clock: a message of hundreds of events
# is applied in pieces, so that an idle slice overruns by at most this many.
# Each piece costs about the same whatever its length (a slice of the list,
# two calls, the look at the clock). The native loop applies an event in a
# few µs at the load, so its pieces are longer: at 512-event batches and
# 50,000 events/s, pieces of 32 events took about 0.8 µs of CPU an event less
# than pieces of 8, and no more p99.
STEP_EVENTS = 8
NATIVE_STEP_EVENTS = 32
# Messages of a let-go log dropped per hand-over, besides two per message
# handed over: freed faster than the next log fills, so it only shrinks.
GARBAGE_STEP = 64
# What a logged message holds besides its payload's bytes, counted against
# --snapshot-log-bytes so that the bound is the memory the log takes: the
# entry's tuple, its place in the deque, the object headers of its payload
# and message id, and the id's text (tracemalloc over the bench's 8- and
# 64-event traffic: 221 and 238 bytes). The message's header map and wire
# headers are not kept: the sink lets them go once written.
ENTRY_BYTES = 224
# A struct held instead of its payload is counted as this many times the
# payload's bytes: its events, hashes and lists took 1.51 to 1.54 times
# (tracemalloc over the bench's 8-, 64- and 512-event traffic, the relay's
# own structs); the rest is room for messages with more hashes per event.
BODY_BYTES_PER_PAYLOAD_BYTE = 2
# The keeper takes structs (`takes_bodies`) while its log holds less than this.
BODIES_WHILE_LOG_UNDER = 4 * 1024 * 1024

# A logged message: its payload (or the struct it encodes), Nats-Msg-Id, the
# decoder its headers call for (None: a format the keeper does not read;
# _BODY: a struct, applied as it is), JetStream ack, and what it counts
# against the log's bound.
_Entry = tuple[Any, str, Any, "bytes | None", int]
_BODY = object()


class _Through:
    """The last message applied for one rank: its Nats-Msg-Id and, in
    JetStream mode, the stream sequence a reader goes on from."""

    __slots__ = ("msg_id", "seq")

    def __init__(self, msg_id: str, seq: int = 0) -> None:
        self.msg_id = msg_id
        self.seq = seq


def _never_busy() -> bool:
    return False


class ResidencyKeeper:
    """`max_log_bytes`: encoded bytes held before they are let go; `ranks`:
    the bridge's dp ranks (what a shed log may have held); `relay_busy`: whether
    the relay has work waiting (a batch in ZMQ, or queued for NATS), which
    goes before all the keeper's own; `yield_at_most`: how long a catch-up or
    export waits for the relay at a time before it takes a slice anyway;
    `give_cpu`: called after each slice, to let the threads woken meanwhile run
    (default: `os.sched_yield`); `busy_wait`: how long work waiting for a busy
    relay sleeps when no write of the sink wakes it first; `cell`: the tables'
    cell (the native one when it was built)."""

    def __init__(self, worker: str, max_log_bytes: int = 32 * 1024 * 1024, ranks: Sequence[int] = (0,), *,
                 relay_busy: Callable[[], bool] = _never_busy, yield_at_most: float = YIELD_AT_MOST_S,
                 give_cpu: Callable[[], None] = _GIVE_CPU, busy_wait: float = BUSY_WAIT_S,
                 cell: type[CellLike] = Cell) -> None:
        self.worker = worker
        self._ranks = tuple(ranks)
        self.relay_busy = relay_busy
        self.give_cpu = give_cpu
        self._yield_at_most = yield_at_most
        self._busy_wait = busy_wait
        # One worker's few ranks: per-rank tables, not the fleet structure
        # (a store is a dict update per hash, not interning and holder sets).
        # The relay's stores are read by the native loop as the contract's are.
        tables = RankTables(cell=cell, stores=(RelayBlockStored,))
        self._index = ResidencyIndex(store=tables)
        self.step_events = NATIVE_STEP_EVENTS if tables.native_runs else STEP_EVENTS
        # A message applied in part by an idle slice: finished before anything
        # else reads or changes the index (`settle`).
        self._partial: Generator[None, None, Refusal | None] | None = None
        self._max_log_bytes = max_log_bytes
        self._log: deque[_Entry] = deque()
        # A let-go log, freed a little at a time: dropped at once, a full one
        # would hold the loop for tens of milliseconds.
        self._garbage: deque[_Entry] = deque()
        self.log_bytes = 0
        self.log_peak = 0  # the most log_bytes held since free memory was last given back
        self._through: dict[int, _Through] = {}
        # Group payloads in msgpack decode with their token ids left encoded:
        # the residency rules only count them (bridge.residency.lean).
        self._decoders: dict[tuple[str, bool], Any] = {
            (fmt, record): _decoder_for(fmt, WorkerRecord if record else GroupMessage)
            for fmt in FORMATS for record in (False, True)
        }
        self._decoders[("msgpack", False)] = residency_decoder()
        # Events (and records) applied per rank: the bucket writer compares
        # them with what it last wrote.
        self.applied: dict[int, int] = {}
        self.undecodable = 0
        # Messages a rebuild read whose payload speaks for another worker,
        # rank or group than their subject: refused, per reason.
        self.refused: Counter[Refusal] = Counter()
        # Times the log was let go, and the messages it held.
        self.sheds = 0
        self.shed_messages = 0
        self._lost = False  # shed while an export ran: the ranks are told at the next catch-up
        # Exports in progress (reading the index between the loop's turns): nothing is applied meanwhile.
        self._exporting = 0
        # Set, and dropped, when the sink hands over a write: what waits for
        # the relay wakes then instead of sleeping through its idle moment.
        self._wrote: anyio.Event | None = None

    def levels(self) -> tuple[int, int, int, int]:
        """(entries held, log bytes not yet applied, messages let go, messages
        it could not read): what /metrics shows of the keeper."""
        return self.index.store.entries, self.log_bytes, self.shed_messages, self.undecodable

    def refusals(self) -> Mapping[Refusal, int]:
        """Messages a rebuild read back and refused, per reason: what /metrics shows."""
        return self.refused

    @property
    def index(self) -> ResidencyIndex:
        """The ranks' residency, with any message applied in part finished."""
        self.settle()
        return self._index

    def settle(self) -> None:
        """Finishes the message an idle slice left applied in part."""
        partial = self._partial
        if partial is not None:
            self._partial = None
            _finish(partial)

    # -- what the sink hands over -----------------------------------------

    def published(self, messages: list[Outgoing], write_batches: int = 0) -> None:
        """Messages written to NATS (core mode), in order; `write_batches`:
        how many vLLM batches the write held (0: not known). A write of one
        batch to a keeper with nothing waiting, while the relay has nothing
        else in hand, is applied now, in one idle slice at most (none while
        a snapshot is exported): the relay is idle until its next batch,
        which `catch_up` looks for, and the batch's objects are applied
        while they are in the CPU's caches. A write of several batches
        means the relay fell behind: that one is left to `keep_up`, which
        applies only in the relay's idle moments, and lets the log go when
        it cannot keep up."""
        idle_before = self._idle()
        append, entry = self._log.append, self._entry
        added = 0
        for msg in messages:
            logged = entry(msg, None)
            append(logged)
            added += logged[4]
        self.log_bytes += added
        self._logged(len(messages))
        if write_batches == 1 and idle_before:
            self._apply_unless_busy()
        self._relay_wrote()

    def stored(self, msg: Outgoing, ack: bytes) -> None:
        """A message the stream stored (JetStream mode), with its ack, in
        stream order (bridge.producer.sink.acks.AckWindow hands them over so).
        Applied now, as `published` applies a write of one batch, when the
        keeper has nothing waiting and the relay nothing in hand: acks come
        back while the relay waits for its next batch."""
        idle_before = self._idle()
        logged = self._entry(msg, ack)
        self._log.append(logged)
        self.log_bytes += logged[4]
        self._logged(1)
        if idle_before:
            self._apply_unless_busy()
        self._relay_wrote()

    def _idle(self) -> bool:
        """Nothing waits to be applied: no log, no message applied in part."""
        return not self._log and self._partial is None

    def _apply_unless_busy(self) -> None:
        """What was just handed over to an idle keeper, applied now in one
        idle slice at most, unless the relay has work in hand."""
        if not self.relay_busy():
            self.catch_up(seconds=IDLE_SLICE_S, busy=self.relay_busy)

    def _relay_wrote(self) -> None:
        wrote = self._wrote
        if wrote is not None:
            self._wrote = None
            wrote.set()

    async def relay_wrote(self) -> None:
        """Returns once the sink hands over its next write, or after `busy_wait`."""
        wrote = self._wrote
        if wrote is None:
            wrote = self._wrote = anyio.Event()
        with anyio.move_on_after(self._busy_wait):
            await wrote.wait()

    def takes_bodies(self) -> bool:
        """Whether messages handed over now may carry the structs they encode
        (`Outgoing.body`): while the log is short, so that it holds bytes
        through a burst."""
        return self.log_bytes < BODIES_WHILE_LOG_UNDER

    def _entry(self, msg: Outgoing, ack: bytes | None) -> _Entry:
        headers = msg.headers
        payload = msg.payload
        msg_id = headers.get(HDR_MSG_ID, "")
        if msg.body is not None:
            return msg.body, msg_id, _BODY, ack, BODY_BYTES_PER_PAYLOAD_BYTE * len(payload) + ENTRY_BYTES
        return payload, msg_id, self._decoder_of(headers), ack, len(payload) + ENTRY_BYTES

    def _body(self, item: Any, decoder: Any) -> Any:
        """A logged message's body (`_read`'s None when its payload cannot be read)."""
        return item if decoder is _BODY else self._read(decoder, item, None)

    def _decoder_of(self, headers: dict[str, str]) -> Any:
        """The decoder a message's headers call for; None for a format the keeper does not read."""
        return self._decoders.get((headers.get(HDR_FORMAT, DEFAULT_FORMAT), HDR_RECORD in headers))

    def _logged(self, n: int) -> None:
        """After `n` messages joined the log: bound it, and free some of a let-go one."""
        if self.log_bytes > self.log_peak:
            self.log_peak = self.log_bytes
        if self.log_bytes > self._max_log_bytes:
            self.shed()
        if self._garbage:
            self.free(GARBAGE_STEP + 2 * n)

    def shed(self) -> None:
        """Lets the log go: applying it now would hold up the live stream,
        which already runs behind it. Every rank loses what it lacks (once no
        export reads the index: the next catch-up says so first)."""
        self._lost = True
        if not self._exporting:
            self._mark_lost()
        log.warning("snapshot_log_shed", messages=len(self._log), bytes=self.log_bytes, ranks=list(self._ranks))
        self.sheds += 1
        self.shed_messages += len(self._log)
        if self._garbage:
            self._garbage.extend(self._log)
            self._log.clear()
        else:
            self._log, self._garbage = self._garbage, self._log
        self.log_bytes = 0

    def _mark_lost(self) -> None:
        index = self.index
        for rank in self._ranks:
            index.lose(self.worker, rank)
        self._lost = False

    def free(self, n: int) -> None:
        """Drops up to `n` messages of a let-go log."""
        garbage = self._garbage
        for _ in range(min(n, len(garbage))):
            garbage.popleft()

    # -- applying ---------------------------------------------------------

    @property
    def pending(self) -> int:
        """Messages not applied yet, one applied in part included."""
        return len(self._log) + (self._partial is not None)

    @property
    def exporting(self) -> bool:
        """A snapshot is being read or encoded: nothing is applied meanwhile."""
        return self._exporting > 0

    @property
    def garbage(self) -> int:
        return len(self._garbage)

    def catch_up(self, limit: int = 0, seconds: float = 0.0, busy: Callable[[], bool] | None = None) -> int:
        """Applies up to `limit` logged messages (0: all), for at most about
        `seconds` (0: no bound), `step_events` events at a time: a message
        the time runs out in stays applied in part (`pending` counts it) and
        is finished first next time. With `busy`, it also stops at a pause
        where that says the relay has work (asked at most every
        `BUSY_LOOK_S`). Returns how many messages it finished (none while a
        snapshot is being exported: the log holds them)."""
        if self._exporting:
            return 0
        if self._lost:
            self._mark_lost()
        n = 0
        log_ = self._log
        clock = time.perf_counter
        end = clock() + seconds if seconds else 0.0
        every = self.step_events if seconds else 0

        look_at = 0.0

        def spent() -> bool:
            nonlocal look_at
            if not end:
                return False
            now = clock()
            if now >= end:
                return True
            if busy is not None and now >= look_at:
                look_at = now + BUSY_LOOK_S
                return busy()
            return False

        steps, self._partial = self._partial, None
        while True:
            if steps is None:
                if not log_ or (limit and n >= limit):
                    break
                item, msg_id, decoder, ack, size = log_.popleft()
                self.log_bytes -= size
                body = self._body(item, decoder)
                if body is not None:
                    if every and type(body) is not WorkerRecord and len(body.events) > every:
                        steps = self._apply_steps(body, msg_id, ack, every)
                    else:
                        self._apply_body(body, msg_id, ack)
            if steps is not None:
                for _ in steps:
                    if spent():
                        self._partial = steps
                        return n
                steps = None
            n += 1
            if spent():
                break
        return n

    async def catch_up_all(self) -> None:
        """Applies what is logged now, a slice at a time, in the relay's idle
        moments (a bucket write in JetStream mode may find the whole
        --snapshot-log-bytes waiting; taken at once, every batch meanwhile
        would wait behind it); waits out an export in progress. A relay that
        stays busy gets `yield_at_most` at a time, then a slice is taken all
        the same."""
        target = self.pending
        wait = self._relay_wait()
        while target > 0 and self.pending:
            if self._exporting:
                await anyio.sleep(0.005)
                continue
            if await wait.for_relay():
                target -= self.catch_up(target, seconds=IDLE_SLICE_S, busy=self.relay_busy)
            else:
                target -= self.catch_up(target, seconds=IDLE_SLICE_S)
            await self.after_slice()

    def _relay_wait(self) -> _Yield:
        """What a catch-up, an export or a bucket write waits on before each slice."""
        return _Yield(self.relay_busy, self._yield_at_most, self.relay_wrote)

    async def after_relay(self) -> None:
        """Returns once the relay is idle, or after `yield_at_most` of it busy."""
        await self._relay_wait().for_relay()

    async def after_slice(self) -> None:
        """Between two slices of the keeper's work: the CPU to the threads
        woken meanwhile (`give_cpu`), then the loop's turn to the relay."""
        self.give_cpu()
        await anyio.sleep(0)

    def apply(self, msg: Outgoing, ack: bytes | None = None) -> None:
        """One of the bridge's own messages, applied now (not logged)."""
        item, msg_id, decoder, ack, _ = self._entry(msg, ack)
        self.settle()
        body = self._body(item, decoder)
        if body is not None:
            self._apply_body(body, msg_id, ack)

    def apply_payload(self, headers: dict[str, str], payload: bytes, ack: bytes | None = None, *,
                      origin: Origin | None = None) -> Refusal | None:
        """One message of the bus, as a consumer reads it. `origin`: where a
        message read back from the stream arrived (a rebuild); one whose
        payload names another worker, rank or group is refused and counted,
        never applied. The bridge's own messages, handed over by its sink,
        need no such check."""
        return self._apply(self._decoder_of(headers), payload, headers.get(HDR_MSG_ID, ""), ack, origin)

    def _apply(self, decoder: Any, payload: bytes, msg_id: str, ack: bytes | None,
               origin: Origin | None) -> Refusal | None:
        self.settle()
        body = self._read(decoder, payload, origin)
        if isinstance(body, Refusal):
            return body
        if body is not None:
            self._apply_body(body, msg_id, ack)
        return None

    def _read(self, decoder: Any, payload: bytes, origin: Origin | None) -> Any:
        """The message's body; None when it cannot be read (counted and
        flagged), its `Refusal` when it speaks for another worker, rank or
        group than `origin`, where it arrived (counted, never applied)."""
        try:
            body = decoder.decode(payload)
        except (AttributeError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._undecodable(origin, exc)
            return None
        if origin is not None:
            record = type(body) is WorkerRecord
            why = check(origin, body.worker, body.dp_rank, None if record else body.group)
            if why is None and body.worker != self.worker:
                why = Refusal.WORKER
            if why is not None:
                self.refused[why] += 1
                return why
        return body

    def _apply_body(self, body: Any, msg_id: str, ack: bytes | None) -> None:
        """A message read (`_read`), applied at once."""
        if type(body) is WorkerRecord:
            self._index.apply_record(body)
            self._applied(body.dp_rank, 1, msg_id, ack)
        else:
            self._index.apply_group(body)
            self._applied(body.dp_rank, len(body.events), msg_id, ack)

    def _apply_steps(self, body: Any, msg_id: str, ack: bytes | None, every: int) -> Generator[None, None, None]:
        """A group message read (`_read`), applied with a pause after every `every` events."""
        yield from self._index.apply_group_steps(body, every=every)
        self._applied(body.dp_rank, len(body.events), msg_id, ack)

    def _applied(self, rank: int, events: int, msg_id: str, ack: bytes | None) -> None:
        """Notes the message last applied for `rank`, and its events."""
        # A duplicate's ack names the stored copy's (earlier) sequence: the
        # position a reader goes on from only moves forward.
        seq = max(0, ack_seq(ack)) if ack is not None else 0
        last = self._through.get(rank)
        if last is None:
            self._through[rank] = _Through(msg_id, seq)
        else:
            last.msg_id = msg_id
            if seq > last.seq:
                last.seq = seq
        self.applied[rank] = self.applied.get(rank, 0) + events

    def _undecodable(self, origin: Origin | None, exc: Exception) -> None:
        """A message the keeper cannot read: whatever it stored or removed is
        missing from its rank's view (read back from the stream, the rank its
        subject names; else every rank), which is partial from now on."""
        self.undecodable += 1
        ranks = self._ranks if origin is None else (origin.dp_rank,)
        if self.undecodable == 1:
            log.warning("residency_message_undecodable", error=type(exc).__name__, detail=str(exc)[:200],
                        ranks=list(ranks), note="logged once; its ranks' snapshots say partial")
        for rank in ranks:
            self._index.lose(self.worker, rank)

    # -- snapshots ----------------------------------------------------------

    def ranks(self) -> list[int]:
        return sorted(view.key.dp_rank for view in self.index if view.key.worker == self.worker)

    def snapshot(self, dp_rank: int) -> RankSnapshot | None:
        """The rank's residency after the last message applied; apply the log
        first (`catch_up`) for the latest. None: nothing known of the rank."""
        self.settle()
        through = self._through.get(dp_rank)
        return self.index.snapshot(
            self.worker, dp_rank, through=through.msg_id if through else "",
            stream_seq=through.seq if through else 0, now=time.time(),
        )

    async def export(self, dp_rank: int) -> tuple[RankSnapshot, bytes] | None:
        """The rank's snapshot and its encoding, both made on the loop in
        slices of about `IDLE_SLICE_S` (a large rank takes far longer than a
        batch may wait), so that the loop reads ZMQ and publishes between
        them. Not in a worker thread: that one holds the GIL but for the
        loop's turns, each of which first waits out the interpreter's 5 ms
        switch interval, so a batch meanwhile waits several of them. Like
        `catch_up_all`, it runs while the relay is idle. The index is left
        alone meanwhile: what comes waits in the log. Apply the log first
        (`catch_up_all`) for the latest."""
        if self._lost and not self._exporting:
            self._mark_lost()
        self._exporting += 1
        try:
            self.settle()
            through = self._through.get(dp_rank)
            steps = self.index.snapshot_steps(
                self.worker, dp_rank, through=through.msg_id if through else "",
                stream_seq=through.seq if through else 0, now=time.time(),
            )
            wait = self._relay_wait()
            snap: RankSnapshot | None = await _in_slices(steps, wait, self.after_slice)
            if snap is None:
                return None
            data: bytes = await _in_slices(encode_snapshot_steps(snap), wait, self.after_slice)
            return snap, data
        finally:
            self._exporting -= 1

    def forget(self, dp_rank: int) -> None:
        """The rank's view is gone (a rebuild starts it again)."""
        view = self.index.view(self.worker, dp_rank)
        if view is not None:
            self.index.views.pop(view.key).release()
        self._through.pop(dp_rank, None)

    def mark_applied(self, dp_rank: int, msg_id: str, stream_seq: int) -> None:
        """A rebuild read the rank's history through this stream message."""
        self._through[dp_rank] = _Through(msg_id, seq=stream_seq)


def _finish(steps: Generator[None, None, _T]) -> _T:
    """Runs `steps` to its end; returns what it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


class _Yield:
    """Waits for the relay to be idle before a slice of the keeper's work,
    for at most `at_most` seconds at a time, looking again each time
    `wrote` returns (the relay's next write, or a short while)."""

    def __init__(self, busy: Callable[[], bool], at_most: float, wrote: Callable[[], Awaitable[None]]) -> None:
        self.busy = busy
        self._at_most = at_most
        self._wrote = wrote

    async def for_relay(self) -> bool:
        """True once the relay is idle; False when it stayed busy for
        `at_most` (the slice then goes ahead regardless)."""
        busy = self.busy
        if not busy():
            return True
        end = time.monotonic() + self._at_most
        while busy():
            if time.monotonic() >= end:
                return False
            await self._wrote()
        return True


async def _in_slices(steps: Generator[None, None, Any], wait: _Yield,
                     after_slice: Callable[[], Awaitable[None]]) -> Any:
    """Runs `steps` to its end in slices of about `IDLE_SLICE_S`, each in an
    idle moment of the relay (`wait`) and ended early when it gets busy,
    `after_slice` between them; returns what it returns."""
    clock = time.perf_counter
    while True:
        idle = await wait.for_relay()
        busy = wait.busy
        end = clock() + IDLE_SLICE_S
        try:
            next(steps)
            while clock() < end and not (idle and busy()):
                next(steps)
        except StopIteration as done:
            return done.value
        await after_slice()


async def keep_up(keeper: ResidencyKeeper, memory: MemoryReturn | None = None,
                  give_back_after: int = GIVE_BACK_AFTER) -> None:
    """Applies the log while the relay is idle (`keeper.relay_busy`), a slice
    at a time, until cancelled. With `memory`: once a log that held
    `give_back_after` bytes or more is applied or let go, the free memory
    goes back to the system (in a worker thread: the loop goes on)."""
    busy = keeper.relay_busy
    while True:
        await anyio.sleep(0.02)
        if memory is not None and keeper.log_peak >= give_back_after and not keeper.pending \
                and not keeper.garbage and not busy():
            peak, keeper.log_peak = keeper.log_peak, 0
            await anyio.to_thread.run_sync(memory.give_back)
            log.debug("memory_given_back", log_peak=peak)
        # While work waits, the keeper looks again as soon as the relay's
        # write is out: at a steady load the relay is busy often but briefly,
        # and a fixed back-off slept through the idle moments between batches
        # (its log outgrew its bound).
        while (keeper.pending and not keeper.exporting) or keeper.garbage:
            if busy():
                await keeper.relay_wrote()
            elif keeper.pending and not keeper.exporting:
                keeper.catch_up(seconds=IDLE_SLICE_S, busy=busy)
                await keeper.after_slice()
            else:
                keeper.free(GARBAGE_STEP * 16)
                await anyio.sleep(0)
