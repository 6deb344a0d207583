"""Issue 18, point 4: late joiners get the whole truth.

Random histories on a bus in memory (tests/snapshot/sim.py), in core NATS and
in JetStream mode: stores (copies, window placeholders, a state group),
removals, clears, gaps, vLLM restarts, bridge kills (graceful or not) and
restarts, a stream that rolls over past its limits, and in JetStream mode
PubAcks or publishes lost and sent again. The bridge is the product's code:
its framing makes the messages (ids, encoding), its keeper keeps the ranks'
residency from what it wrote (core) or what the stream acked (JetStream, fed
by its ack window), its snapshot service answers requests and its writer
fills the bucket; a restarted JetStream bridge finds its resume point and
rebuilds as `rebuild_rank` does.

Three views are kept side by side:

- the watcher: a `ResidencyIndex` that saw every message from the start,
  decoded as a consumer decodes them (core: as written; JetStream: the stream
  in stream order, as it was stored);
- the reference model: what the contract says the watcher holds, from the
  same messages, computed from scratch its own way (tests/client/model.py);
- the late joiner: a consumer that starts at a random moment and bootstraps
  with the product's functions (discover, fetch, splice_buffer or
  stream_opening, then the LiveGate), the steps of its bootstrap interleaved
  with the bus's traffic.

After every step: watcher == model, and late == watcher per rank
(`view_state`, the `partial`/`stale` flags included), except for a rank whose
history the late joiner could not have: the test knows when (no snapshot, a
snapshot that was itself incomplete, a stream rolled past what followed the
snapshot, a rank first met in the middle of its history) and until when (a
restart or a fresh start), and then asserts the view is marked partial and
stale. Along the way it checks the bridge's side against its own account:
every snapshot's `complete` flag, a rebuilt view's `partial` flag, and the
keeper's view against the watcher's.

Two late joiners at most per run, joining at different moments; in
JetStream mode with or without the bucket to fall back on. A bridge may run
without its snapshot service (it failed to register).

Run with `--hypothesis-show-statistics` to see how often each path is taken.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import hypothesis.strategies as st
import msgspec
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from bridge.client.bootstrap import (
    BootstrapOptions,
    Found,
    LiveGate,
    RankKey,
    discover,
    fetch,
    rank_of,
    splice_buffer,
    stream_opening,
)
from bridge.client.codec import BusCodec
from bridge.client.subscribe import BusMessage
from bridge.contract import SCHEMA_VERSION, BlockHash, BlockRemoved, BlockStored, GroupMessage, WorkerRecord
from bridge.contract.snapshot import RankSnapshot, SnapshotMissing, decode_head, read_bucket, snapshot_key
from bridge.producer.sink.encode import Outgoing
from bridge.producer.sink.jetstream import last_point
from bridge.producer.sink.queue import OutBatch
from bridge.producer.snapshot.rebuild import bucket_value, replayed, restore_rank
from bridge.residency import ResidencyIndex, WorkerView
from tests.client.builders import ATTN, STATE, WIN, hb, hi, msg, removed, stored
from tests.client.model import replay
from tests.snapshot.sim import (
    RANKS,
    STREAM,
    TOPIC,
    WORKER,
    MemoryBucket,
    ServiceBus,
    SimBridge,
    Stream,
    subject_base,
)
from tests.snapshot.views import view_state

T = TypeVar("T")
POOL = 16  # hash ids: few, so stores repeat (copies) and removals hit
GROUPS = (ATTN, STATE, WIN)
MEDIA = ("GPU", "CPU")

# One vLLM event as the test draws it: ("store", group, medium, ids, placeholder),
# ("remove", group, medium, ids) or ("clear",).
Op = tuple[Any, ...]


def resetting(body: object) -> bool:
    """A record after which a view holds nothing it could have missed, its
    groups included (the contract: restart, a start that is not `resumed`;
    not a clear, after which a group never heard of is still unknown)."""
    return type(body) is WorkerRecord and (
        body.type == "restart" or (body.type == "start" and body.reason != "resumed"))


def assert_same_view(mine: WorkerView, theirs: WorkerView, what: str, gaps: list[tuple[int, int]]) -> None:
    """Equal views (`view_state`), but for `lost`, the last gap ranges: that
    is history kept across resets, like the view's counters, and each
    consumer has the ranges it heard of (a late joiner those its snapshot's
    keepers did, and they may have started after a gap, or rebuilt from a
    stream that no longer held one). What any of them reports must have been
    on the bus, in that order, each once (`gaps`: every gap record of the
    rank on the bus)."""
    a, b = view_state(mine), view_state(theirs)
    lost = a.pop("lost")
    b.pop("lost")
    assert a == b, what
    rest = iter(gaps)
    assert all(any(r == g for g in rest) for r in lost), f"{what}: lost ranges {lost} not in {gaps}"


# -- the reference model -------------------------------------------------


@dataclass
class RankModel:
    epoch: int = 0
    log: list[Op] = field(default_factory=list)  # events since the view's last reset
    last: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # group → last position applied
    watching: bool = True

    def reset(self, epoch: int) -> None:
        self.epoch = epoch
        self.log = []
        self.last = {}


class Reference:
    """The contract's rules (docs/consumers.md), written out on their own:
    epochs, records, copies by position, and the residency by replaying each
    rank's log (`replay`). It reads the wire with msgspec alone."""

    def __init__(self) -> None:
        self.ranks: dict[int, RankModel] = {}

    def apply(self, out: Outgoing) -> None:
        fmt = out.headers.get("Kvb-Format", "msgpack")
        kind: type = WorkerRecord if out.subject.endswith(".worker") else GroupMessage
        body: GroupMessage | WorkerRecord = msgspec.json.decode(out.payload, type=kind) if fmt == "json" else \
            msgspec.msgpack.decode(out.payload, type=kind)
        rank = self.ranks.get(body.dp_rank)
        if rank is None:
            rank = self.ranks[body.dp_rank] = RankModel(body.epoch)
        if rank.epoch and body.epoch < rank.epoch:
            return  # an older vLLM process's
        if isinstance(body, WorkerRecord) and body.type in ("restart", "start"):
            if body.type == "start" and body.reason == "resumed":
                rank.epoch = body.epoch
            else:
                rank.reset(body.epoch)
            rank.watching = True
            return
        if body.epoch > rank.epoch:
            rank.reset(body.epoch)
        if isinstance(body, WorkerRecord):
            if body.type == "gap":
                rank.log.append(("gap",))
            elif body.type == "cleared":
                rank.log.append(("clear",))
            elif body.type == "stop":
                rank.watching = False
            return
        position = (body.seq, body.part, body.chunk)
        if body.group in rank.last and position <= rank.last[body.group]:
            return  # a copy
        rank.last[body.group] = position
        rank.watching = True
        for ev in body.events:
            medium = ev.medium or "GPU"
            if type(ev) is BlockStored:
                placeholder = body.group == WIN and (ev.placeholder or ev.block_size == 0)
                rank.log.append(("store", body.group, medium, list(ev.block_hashes), placeholder))
            else:
                rank.log.append(("remove", body.group, medium, list(ev.block_hashes)))

    def check(self, index: ResidencyIndex) -> None:
        """The index holds what the model says, rank by rank."""
        assert {v.key.dp_rank for v in index} == set(self.ranks)
        for r, model in self.ranks.items():
            view = index.view(WORKER, r)
            assert view is not None
            assert (view.epoch, view.watching) == (model.epoch, model.watching)
            trusted, suspect, holder, unknown, groups = replay(model.log)
            assert set(view.groups) == groups
            for g, res in view.groups.items():
                assert res.unknown_removals == unknown[g]
                for m in MEDIA:
                    for layer, mine in ((trusted, res.trusted), (suspect, res.suspect), (holder, res.placeholders)):
                        want = {k[2]: n for k, n in layer.items() if k[0] == g and k[1] == m and n > 0}
                        got = dict(mine[m].items()) if m in mine else {}
                        assert got == want, (r, g, m)


# -- the late joiner -------------------------------------------------------


class LateJoiner:
    """A consumer that starts late, as `BusSubscriber` bootstraps: in core
    mode it subscribes first and buffers while it fetches (up to two rounds:
    the ranks found, then those the buffer shows), then splices; in JetStream
    mode it fetches, then reads the stream from where the snapshots end. Each
    fetch is its own step, so traffic goes on between them.

    `expect_partial` is the test's own account of which ranks' views must be
    marked partial (True), must equal the watcher's (False), or are unknown
    to this consumer (absent)."""

    def __init__(self, jetstream: bool, bucket: bool) -> None:
        self.jetstream = jetstream
        self.bucket = bucket  # whether it may fall back on the snapshot bucket
        self.index = ResidencyIndex()
        self.live = False
        self.buffer: list[BusMessage] = []
        self.found: dict[RankKey, Found] = {}
        self.complete_at_source: dict[RankKey, bool] = {}
        self.wanted: list[RankKey] | None = None
        self.rounds = 0
        self.gate: LiveGate | None = None
        self.start_seq = 0
        self.expect_partial: dict[int, bool] = {}

    def take(self, item: BusMessage) -> None:
        """One message off the subscription (core) or the stream (JetStream, its stream_seq set)."""
        if not self.live:
            if not self.jetstream:
                self.buffer.append(item)
            return
        if item.stream_seq is not None and item.stream_seq < self.start_seq:
            return
        assert self.gate is not None
        missing, admitted = self.gate.admit(item.body, item.stream_seq)
        self._expect(item)
        if missing is not None:
            self.index.apply(missing)
        if admitted:
            self.index.apply(item)

    def _expect(self, item: BusMessage) -> None:
        """What the item does to the test's expectation, before the index applies it."""
        key = rank_of(item.body)
        assert key is not None
        rank = key[1]
        body = item.body
        if rank not in self.expect_partial:
            # First met after the bootstrap: its past is unknown unless this item resets it.
            self.expect_partial[rank] = not resetting(body)
            event(f"late joiner: a rank first met after its bootstrap, {'at a reset' if resetting(body) else 'mid-history'}")
        elif resetting(body):
            view = self.index.view(WORKER, rank)
            if view is None or body.epoch >= view.epoch:
                if self.expect_partial[rank]:
                    event("late joiner: a partial view made whole by a reset")
                self.expect_partial[rank] = False

    def splice(self, items: list[object], first_seq: int | None) -> None:
        """The bootstrap's items (snapshots, SnapshotMissings, the buffer), applied."""
        for key, found in self.found.items():
            if type(found) is SnapshotMissing:
                self.expect_partial[key[1]] = True
                event("late joiner: bootstrapped a rank with no snapshot")
            else:
                assert type(found) is RankSnapshot
                rolled = first_seq is not None and found.stream_seq + 1 < first_seq
                self.expect_partial[key[1]] = not self.complete_at_source[key] or rolled
                if rolled:
                    event("late joiner: the stream rolled past a snapshot")
                if not self.complete_at_source[key]:
                    event("late joiner: a snapshot not complete at its source")
        self.live = True
        for item in items:
            if type(item) is BusMessage:
                self._expect(item)
            self.index.apply(item)  # type: ignore[arg-type]


# -- the machine --------------------------------------------------------------

# Mostly runs of a chain (real stores are), some arbitrary lists (repeats, holes).
ids = st.one_of(
    st.tuples(st.integers(0, POOL - 1), st.integers(1, 10)).map(lambda t: list(range(t[0], min(POOL, t[0] + t[1])))),
    st.lists(st.integers(0, POOL - 1), min_size=1, max_size=4),
)
store_op = st.tuples(st.just("store"), st.sampled_from(GROUPS), st.sampled_from(MEDIA), ids, st.booleans())
remove_op = st.tuples(st.just("remove"), st.sampled_from(GROUPS), st.sampled_from(MEDIA), ids)
# A clear now and then (about one batch in seven): more often, nothing would build up.
_OPS = {"store": store_op, "remove": remove_op, "clear": st.just(("clear",))}
batches = st.lists(st.sampled_from(["store"] * 10 + ["remove"] * 7 + ["clear"]).flatmap(_OPS.__getitem__),
                   min_size=1, max_size=5)
faults = st.sampled_from([None] * 6 + ["ack_lost", "publish_lost"])


class LateJoinerVersusWatcher(RuleBasedStateMachine):
    """One bus, one worker with dp ranks 0 and 1, one bridge process at a time."""

    JETSTREAM = False

    @initialize(fmt=st.sampled_from(["msgpack", "json"]), ints=st.booleans(),
                 max_payload=st.sampled_from([1 << 20, 1 << 20, 1300]), stream_limit=st.sampled_from([12, 40, 1000]),
                 log_bytes=st.just(1 << 20))
    def setup(self, fmt: str, ints: bool, max_payload: int, stream_limit: int, log_bytes: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.jetstream = jetstream = self.JETSTREAM
        self.fmt = fmt
        self.form = hi if ints else hb
        self.max_payload = max_payload  # 1300: groups of several events go in chunks
        self.log_bytes = log_bytes  # never reached here: a shed is tests/snapshot/test_shed.py
        self.codec = BusCodec()
        self.stream = Stream(stream_limit)
        self.bucket = MemoryBucket() if jetstream else None
        self.nats = ServiceBus(lambda: self.bridge, self.bucket)
        self.opts = BootstrapOptions(prefix="kv", bucket="kv_snapshots" if jetstream else "", discover_s=0.01)
        self.watcher = ResidencyIndex()
        self.model = Reference()
        self.lates: list[LateJoiner] = []  # at most two, joining at different moments
        self.bridge: SimBridge | None = None
        self.epoch = 1000
        self.vllm_seq = dict.fromkeys(RANKS, 0)
        self.vllm_ts = 1.0
        self.now = 1.7e9
        # Whether the bridge's keeper knows each rank's whole history since
        # its last reset (what its snapshots must say in `complete`).
        self.knows_all: dict[int, bool] = {}
        # Per bucket snapshot, (rank, taken_at): what its writer knew.
        self.bucket_truth: dict[tuple[int, float], bool] = {}
        # Every gap record's range on the bus, per rank, in bus order.
        self.gaps: dict[int, list[tuple[int, int]]] = {r: [] for r in RANKS}
        self._start_bridge()

    def teardown(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.close()

    def drive(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def _tick(self) -> float:
        """The bridges' clock (record times, and so start and stop ids): a second a reading."""
        self.now += 1.0
        return self.now

    def _new_epoch(self) -> int:
        self.epoch += 1
        return self.epoch

    # -- the bus --------------------------------------------------------------

    def _deliver(self, out: Outgoing, stream_seq: int | None) -> None:
        """A message on the bus: every consumer gets it (in JetStream mode, as the stream stores it)."""
        item = self._item(out, stream_seq)
        body = item.body
        if type(body) is WorkerRecord and body.type == "gap" and body.gap_from is not None and body.gap_to is not None:
            self.gaps[body.dp_rank].append((body.gap_from, body.gap_to))
        self.watcher.apply(item)
        self.model.apply(out)
        for late in self.lates:
            late.take(item)

    def _item(self, out: Outgoing, stream_seq: int | None) -> BusMessage:
        """`out` as a subscription hands it over (BusSubscriber._decode)."""
        headers = dict(out.headers)
        return BusMessage(out.subject, headers, self.codec.decode(out.subject, headers, out.payload), 1.0, stream_seq)

    def _publish(self, batch: OutBatch, fault: str | None = None, at: int = 0) -> None:
        """The bridge's sink writes one batch: core NATS hands it to the keeper
        as written; JetStream sends it with reply subjects and feeds the keeper
        from the ack window as the acks come, sending again what got none."""
        bridge = self.bridge
        assert bridge is not None
        if batch.seq >= 0:
            bridge.last_emitted[batch.dp_rank] = batch.seq
        messages = batch.messages
        if bridge.window is None:
            bridge.keeper.published(messages)
            for out in messages:
                self._deliver(out, None)
            for out in messages:
                self._note_keeper(out)
            return
        window = bridge.window
        at = at % len(messages) if messages else 0
        replies = [window.reply_to(out, 0, 0.0, batch) for out in messages]
        for i, (out, reply) in enumerate(zip(messages, replies, strict=True)):
            if fault == "publish_lost" and i == at:
                continue  # never reached the stream
            seq, duplicate = self.stream.store(out)
            if not duplicate:
                self._deliver(out, seq)
            if fault == "ack_lost" and i == at:
                continue  # stored, but its ack never came
            window.on_ack(reply.encode(), Stream.ack(seq, duplicate), None)
            self._note_keeper(out)
        # The ack that overtook an older unacked message is trouble: the
        # publisher sends the oldest again before anything newer.
        unsettled = [token for token, _ in window.unsettled()]
        if unsettled:
            again, again_replies = window.resend(unsettled, 1, 0.0)
            for out, reply in zip(again, again_replies, strict=True):
                seq, duplicate = self.stream.store(out)
                if not duplicate:
                    self._deliver(out, seq)
                window.on_ack(reply.encode(), Stream.ack(seq, duplicate), None)
                self._note_keeper(out)
        for behind in window.take_reordered():  # a gap record names each (Bridge._reordered)
            self._publish(bridge.record(behind.dp_rank, "gap", gap=(behind.seq, behind.seq), reason="reordered",
                                        epoch=behind.epoch))

    def _note_keeper(self, out: Outgoing) -> None:
        """The keeper was handed `out`: a resetting record makes its view whole."""
        if out.subject.endswith(".worker"):
            body = self.codec.decode(out.subject, dict(out.headers), out.payload)
            if resetting(body):
                self.knows_all[body.dp_rank] = True

    # -- vLLM -----------------------------------------------------------------

    @precondition(lambda self: self.bridge is not None)
    @rule(rank=st.sampled_from(RANKS), ops=batches, fault=faults, at=st.integers(0, 7))
    def batch(self, rank: int, ops: list[Op], fault: str | None, at: int) -> None:
        """One vLLM batch: its events per group, split in parts at each clear
        (as the normalizer does), framed by the bridge."""
        assert self.bridge is not None
        seq = self.vllm_seq[rank]
        self.vllm_seq[rank] += 1
        self.vllm_ts += 1.0
        epoch = self.bridge.idents[rank].epoch
        items: list[GroupMessage | WorkerRecord] = []
        part = 0
        slices: dict[int, list[BlockStored | BlockRemoved]] = {}

        def flush() -> None:
            for group, events in slices.items():
                items.append(msgspec.structs.replace(
                    msg(events, group=group, worker=WORKER, rank=rank, epoch=epoch, seq=seq, ts=self.vllm_ts),
                    part=part, topic=TOPIC))
            slices.clear()

        for op in ops:
            if op[0] == "clear":
                flush()
                items.append(WorkerRecord(v=SCHEMA_VERSION, worker=WORKER, dp_rank=rank, epoch=epoch, type="cleared",
                                          ts=self.vllm_ts, seq=seq, topic=TOPIC))
                part += 1
                continue
            _, group, medium, hash_ids = op[:4]
            hashes: list[BlockHash] = [self.form(i) for i in hash_ids]
            if op[0] == "store":
                placeholder = group == WIN and op[4]
                change: BlockStored | BlockRemoved = stored(hashes[:1] if placeholder else hashes, group=group,
                                                            medium=medium, block_size=0 if placeholder else 16)
            else:
                change = removed(hashes, group=group, medium=medium)
            slices.setdefault(group, []).append(change)
        flush()
        out, unpublishable = self.bridge.framing[rank].batch(seq, self.vllm_ts, items)
        assert not unpublishable
        self._publish(out, fault if self.jetstream else None, at)

    @precondition(lambda self: self.bridge is not None)
    @rule(rank=st.sampled_from(RANKS), ops=batches, fault=faults, at=st.integers(0, 7))
    def another_batch(self, rank: int, ops: list[Op], fault: str | None, at: int) -> None:
        """The same as `batch`: traffic is most of what happens."""
        self.batch(rank, ops, fault, at)

    @precondition(lambda self: self.bridge is not None)
    @rule(rank=st.sampled_from(RANKS), restart=st.sampled_from([False, False, True]), lost=st.integers(1, 3))
    def vllm_mishap(self, rank: int, restart: bool, lost: int) -> None:
        """Batches lost on their way to the bridge (a gap), or a new vLLM process."""
        if restart:
            self._vllm_restarts(rank)
        else:
            self._gap(rank, lost)

    def _gap(self, rank: int, lost: int) -> None:
        assert self.bridge is not None
        first = self.vllm_seq[rank]
        self.vllm_seq[rank] += lost
        self.bridge.last_emitted[rank] = first + lost - 1
        self._publish(self.bridge.record(rank, "gap", gap=(first, first + lost - 1), reason="lost"))

    def _vllm_restarts(self, rank: int) -> None:
        """A new vLLM process: a new epoch, seqs from 0 (bridge.producer.pipeline._restart)."""
        assert self.bridge is not None
        self.bridge.idents[rank].epoch = self._new_epoch()
        self.bridge.framing[rank].restarted()
        self.vllm_seq[rank] = 0
        self.bridge.last_emitted[rank] = -1
        self._publish(self.bridge.record(rank, "restart", seq=0))

    # -- the bridge -----------------------------------------------------------

    @rule(graceful=st.booleans(), service=st.sampled_from([True, True, True, False]))
    def bridge_dies_or_starts(self, graceful: bool, service: bool) -> None:
        """A running bridge is killed, or stopped (stop records, then in
        JetStream mode the last snapshots into the bucket); a dead one starts,
        now and then without its snapshot service (it could not register:
        the bridge runs on, publishing, and nobody answers for it)."""
        if self.bridge is None:
            self._start_bridge(service)
            return
        if graceful:
            for rank in RANKS:
                self._publish(self.bridge.record(rank, "stop", seq=self.bridge.last_emitted[rank],
                                                 batch_ts=self.vllm_ts))
            self._write_bucket(everything=True)
        self.bridge = None

    def _start_bridge(self, service: bool = True) -> None:
        """Core NATS: a fresh start per rank, new epochs. JetStream: per rank
        the stream's resume point (bridge.producer.sink.jetstream.last_point); a rank
        the stream still holds resumes its epoch after a rebuild from the
        bucket and the stream, the others start fresh."""
        points = {r: self.drive(last_point(self.stream, STREAM, subject_base(r))) if self.jetstream else None  # type: ignore[arg-type]
                  for r in RANKS}
        epochs = {r: p.epoch if p is not None else self._new_epoch() for r, p in points.items()}
        bridge = self.bridge = SimBridge(jetstream=self.jetstream, fmt=self.fmt, max_payload=self.max_payload,
                                         log_bytes=self.log_bytes, epochs=epochs, bucket=self.bucket,
                                         clock=self._tick)
        bridge.service_up = service
        for rank, point in points.items():
            if point is None:
                self.knows_all[rank] = False  # until its start record
                continue
            self._rebuild(rank)
            bridge.last_emitted[rank] = point.done_through
            if point.partial_msg_id is not None:
                bridge.framing[rank].resume_inside(point.done_through + 1, point.partial_msg_id)
        for rank, point in points.items():
            if point is None:
                self._publish(bridge.record(rank, "start", reason="fresh"))
            else:
                self._publish(bridge.record(rank, "start", reason="resumed", seq=point.done_through))

    def _rebuild(self, rank: int) -> None:
        """`rebuild_rank` without NATS: its pure steps on the simulated bucket and stream."""
        assert self.bridge is not None and self.bucket is not None
        keeper = self.bridge.keeper
        values = self.bucket.stored()
        found = self.drive(read_bucket(lambda key: bucket_value(values, key), WORKER, rank))
        snap = found[1] if found is not None else None
        first = self.stream.first_seq
        start = restore_rank(keeper, rank, snap, first)
        # What the rebuilt view must say: whole when the snapshot was and the
        # stream holds everything after it, or once a resetting record replays.
        knows = snap is not None and self.bucket_truth[(rank, snap.taken_at)] and first <= snap.stream_seq + 1
        base = subject_base(rank) + "."
        for seq, out in self.stream.since(start):
            if out.subject.startswith(base):
                replayed(keeper, rank, dict(out.headers), out.payload, seq, out.subject)
                knows = knows or resetting(self.codec.decode(out.subject, dict(out.headers), out.payload))
        self.knows_all[rank] = knows
        if self.bridge.writer is not None:
            self.bridge.writer.resume_slot(rank, found[0] if found is not None else None)
        view = keeper.index.view(WORKER, rank)
        if view is not None:
            assert view.partial == (not knows), "the rebuilt view's partial flag"

    @precondition(lambda self: self.bridge is not None)
    @rule(slice_=st.sampled_from([1, 4, 0]))
    def bridge_idles(self, slice_: int) -> None:
        """The keeper applies some of its log (0: all of it), and then holds what the watcher holds."""
        assert self.bridge is not None
        keeper = self.bridge.keeper
        keeper.catch_up(slice_)
        if slice_ or keeper.pending:
            return
        for rank in RANKS:
            mine, theirs = keeper.index.view(WORKER, rank), self.watcher.view(WORKER, rank)
            if mine is None or not self.knows_all.get(rank):
                continue
            assert theirs is not None
            assert_same_view(mine, theirs, f"the bridge's own view of rank {rank}", self.gaps[rank])

    @precondition(lambda self: self.jetstream)
    @rule(what=st.sampled_from(["write", "write_all", "expire"]), n=st.integers(1, 10))
    def storage(self, what: str, n: int) -> None:
        """The bridge's bucket writer writes the ranks that changed (or all);
        or the stream's age limit drops its oldest `n` messages."""
        if what == "expire":
            self.stream.expire(n)
        else:
            self._write_bucket(everything=what == "write_all")

    def _write_bucket(self, everything: bool) -> None:
        bridge = self.bridge
        if bridge is None or bridge.writer is None or self.bucket is None:
            return
        self.drive(bridge.writer.write_due(force_changed=True, everything=everything))
        for rank in RANKS:
            raw = self.bucket.values.get(snapshot_key(WORKER, rank))
            if raw is not None:
                head = decode_head(raw)
                self.bucket_truth.setdefault((rank, head.taken_at), self.knows_all.get(rank, False))

    # -- the late joiner --------------------------------------------------------

    @precondition(lambda self: len(self.lates) < 2 or not self.lates[-1].live)
    @rule(join=st.integers(0, 2), steps=st.sampled_from([1, 1, 4]), bucket=st.sampled_from([True, True, False]))
    def late_joiner_steps(self, join: int, steps: int, bucket: bool) -> None:
        """A late joiner joins on one call in three, so at any moment of the
        history (a second one once the first is live), in JetStream mode
        mostly with the snapshot bucket to fall back on; then each call takes
        one step of its bootstrap (or a few at once)."""
        if not self.lates or self.lates[-1].live:
            if join == 0:
                self.lates.append(LateJoiner(self.jetstream, bucket and self.jetstream))
            return
        late = self.lates[-1]
        for _ in range(steps):
            if late.live:
                return
            self._late_step(late)

    def _late_step(self, late: LateJoiner) -> None:
        """Subscribe (core) and discover, fetch one rank's snapshot, or
        splice and go live."""
        kv = self.bucket.as_bucket() if self.bucket is not None and late.bucket else None
        if late.wanted:
            key = late.wanted.pop(0)
            complete = self.knows_all.get(key[1], False) if self.bridge is not None else None
            asked = self.nats.requests
            got, source = self.drive(fetch(self.nats.as_client(), self.opts, kv, *key))
            late.found[key] = got
            event(f"late joiner: a snapshot from {source.source}")
            if source.source == "service":
                event(f"late joiner: a snapshot in {min(self.nats.requests - asked, 3)}+ parts")
            if type(got) is RankSnapshot:
                truth = complete if source.source == "service" else self.bucket_truth[(key[1], got.taken_at)]
                assert truth is not None
                assert got.complete == truth, f"rank {key[1]}'s snapshot from the {source.source} says complete"
                late.complete_at_source[key] = truth
            return
        if self.jetstream:
            if late.wanted is None:
                late.wanted = sorted(self.drive(discover(self.nats.as_client(), self.opts, kv)))
                return
            # All fetched: the stream from where the snapshots end (BusSubscriber._stream_bootstrap).
            first = self.stream.first_seq
            plan = stream_opening(late.found, first)
            late.gate = LiveGate(late.found, plan.skip_seq)
            late.start_seq = plan.start_seq if plan.start_seq is not None else first
            late.splice(list(plan.items), first)
            for seq, out in self.stream.since(late.start_seq):
                late.take(self._item(out, seq))
            return
        # Core NATS (BusSubscriber._core_bootstrap): up to two rounds, then splice.
        buffered = {k for k in (rank_of(item.body) for item in late.buffer) if k is not None}
        if late.rounds < 2:
            wanted = set(late.wanted or ())
            if late.rounds == 0:
                wanted |= self.drive(discover(self.nats.as_client(), self.opts, None))
            wanted = (wanted | buffered) - set(late.found)
            late.rounds = 2 if not wanted else late.rounds + 1
            late.wanted = sorted(wanted)
            if wanted:
                return
        late.gate = LiveGate(late.found)
        late.splice(splice_buffer(late.buffer, late.found, gate=late.gate), None)
        late.buffer = []

    # -- checks -----------------------------------------------------------------

    @invariant()
    def watcher_holds_what_the_model_says(self) -> None:
        if hasattr(self, "model"):
            self.model.check(self.watcher)

    @invariant()
    def late_joiners_hold_what_the_watcher_holds(self) -> None:
        for late in getattr(self, "lates", []):
            if late.live:
                self._check_late(late)

    def _check_late(self, late: LateJoiner) -> None:
        for rank in RANKS:
            mine, theirs = late.index.view(WORKER, rank), self.watcher.view(WORKER, rank)
            expect = late.expect_partial.get(rank)
            event(f"late joiner live, rank view: {'unknown' if expect is None else 'partial' if expect else 'equal'}")
            if expect is False and theirs is not None and any(len(g.trusted) for g in theirs.groups.values()):
                event("late joiner live, rank equal and holding blocks")
            if expect is None:
                assert mine is None, f"rank {rank}: a view the late joiner never had the means to build"
            elif expect:
                assert mine is not None and mine.partial and mine.stale, f"rank {rank} must be marked partial"
            else:
                assert mine is not None and theirs is not None, f"rank {rank}"
                assert_same_view(mine, theirs, f"rank {rank}: late joiner versus watcher", self.gaps[rank])


class CoreNats(LateJoinerVersusWatcher):
    JETSTREAM = False


class JetStream(LateJoinerVersusWatcher):
    JETSTREAM = True


_SETTINGS = settings(max_examples=200, stateful_step_count=50, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
CoreNats.TestCase.settings = _SETTINGS
JetStream.TestCase.settings = _SETTINGS
TestCoreNats = CoreNats.TestCase
TestJetStream = JetStream.TestCase
