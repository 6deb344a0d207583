"""Issue 26, point 6 (consumers' part): every view a late consumer serves is
right or flagged.

A fleet of three worker ranks (`pa` ranks 0 and 1, `pb` rank 0) writes into
a JetStream stream kept in memory, with limits drawn per run: age, bytes,
messages, messages per subject, and operators' deletions in the middle. Each
worker's bridge keeps its ranks' residency as the product does
(`ResidencyKeeper`, fed in stream order with the stream's acks) and answers
snapshot requests while its service is up. Consumers with random subject
filters join at random moments and bootstrap with the product's functions
(`SubjectFilter`, `stream_opening` on the stream's holdings, `LiveGate`),
reading the stream from where the snapshots end, then live.

After every step:

- the always-on consumer (a `ResidencyIndex` that read every message as the
  stream stored it) equals the reference model (tests/reference_index.py);
- each late consumer holds views of exactly the ranks its filter covers; a
  view it does not flag partial equals the always-on one (`view_state`), and
  it flags partial exactly the ranks whose history the stream no longer held
  whole when it joined (the test's own account, from what it deleted), until a
  record that resets the view and after which nothing is missing.

Filters that leave out the records' subject (`kv.*.0`) are not drawn: no
`restart` or `gap` reaches them, which docs/consumers.md states as the cost of
such a filter; tests/snapshot/test_filtered.py covers their bootstrap.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from bridge.client.bootstrap import Found, LiveGate, RankKey, resets, stream_opening
from bridge.client.codec import BusCodec
from bridge.client.coverage import SubjectFilter
from bridge.client.subscribe import BusMessage
from bridge.contract import WorkerRecord
from bridge.contract.holdings import StreamHoldings
from bridge.contract.snapshot import RankSnapshot, SnapshotMissing
from bridge.producer.sink.encode import MessageEncoder, Outgoing
from bridge.producer.sink.subjects import SubjectBook
from bridge.producer.snapshot.keeper import ResidencyKeeper
from bridge.residency import ResidencyIndex
from tests.client.builders import ATTN, STATE, hb, msg, record, removed, stored
from tests.client.test_index_fleet import assert_same_state
from tests.reference_index import ReferenceIndex
from tests.snapshot.sim import Stream
from tests.snapshot.views import view_state

RANKS: tuple[RankKey, ...] = (("pa", 0), ("pa", 1), ("pb", 0))
FILTERS = ("kv.>", "kv.*.*", "kv.*.>", "kv.pa.*", "kv.pa.>", "kv.pa-dp1.>", "kv.pb.*")
POOL = 8
ENCODER = MessageEncoder("msgpack")
CODEC = BusCodec()


class LimitedStream:
    """A stream with every limit the bridge may meet: `max_msgs`,
    `max_bytes` (oldest first), `max_per_subject` (each subject's oldest),
    `max_age` (in the test's ticks), and deletions anywhere."""

    def __init__(self, max_msgs: int, max_bytes: int, max_per_subject: int, max_age: int) -> None:
        self.limits = (max_msgs, max_bytes, max_per_subject, max_age)
        self.held: OrderedDict[int, tuple[Outgoing, int]] = OrderedDict()  # seq → (message, stored at tick)
        self.last_seq = 0
        self.now = 0

    @property
    def first_seq(self) -> int:
        return next(iter(self.held)) if self.held else self.last_seq + 1

    def store(self, out: Outgoing) -> int:
        self.last_seq += 1
        self.held[self.last_seq] = (out, self.now)
        max_msgs, max_bytes, per_subject, _ = self.limits
        if per_subject:
            same = [s for s, (m, _) in self.held.items() if m.subject == out.subject]
            for seq in same[:max(0, len(same) - per_subject)]:
                del self.held[seq]
        while max_msgs and len(self.held) > max_msgs:
            self.held.popitem(last=False)
        while max_bytes and sum(len(m.payload) for m, _ in self.held.values()) > max_bytes:
            self.held.popitem(last=False)
        return self.last_seq

    def tick(self, n: int) -> None:
        self.now += n
        max_age = self.limits[3]
        while max_age and self.held and self.now - next(iter(self.held.values()))[1] > max_age:
            self.held.popitem(last=False)

    def delete(self, pick: int) -> None:
        """An operator deletes one message from the middle."""
        inner = list(self.held)[1:-1]
        if inner:
            del self.held[inner[pick % len(inner)]]

    def holdings(self) -> StreamHoldings:
        """What STREAM.INFO with deleted_details says."""
        first = self.first_seq
        deleted = tuple(s for s in range(first, self.last_seq + 1) if s not in self.held)
        return StreamHoldings(first, self.last_seq, deleted)

    def lost_after(self, seq: int) -> bool:
        """The test's own account: whether any message stored after `seq` is gone."""
        return any(s not in self.held for s in range(seq + 1, self.last_seq + 1))


class Late:
    """A consumer that joined with `covered`, and which of its ranks the test expects flagged partial."""

    def __init__(self, subject: str) -> None:
        self.subject = subject
        self.covered = SubjectFilter(subject, "kv")
        self.index = ResidencyIndex()
        self.gate: LiveGate | None = None
        self.expect_partial: dict[RankKey, bool] = {}

    def matches(self, subject: str) -> bool:
        _, token_and_last = subject.split(".", 1)
        token, last = token_and_last.split(".")
        for worker, rank in RANKS:
            if SubjectBook("kv", worker, rank).base == f"kv.{token}":
                return self.covered.covers_records(worker, rank) if last == "worker" else \
                    self.covered.covers_group(worker, rank, int(last))
        return False

    def take(self, item: BusMessage, held: LimitedStream | None) -> None:
        """One stream message, in order (`held`: the stream at join time, during the replay)."""
        assert self.gate is not None
        body = item.body
        key = (body.worker, body.dp_rank)
        missing, admitted = self.gate.admit(body, item.stream_seq)
        if missing is not None:
            self.index.apply(missing)
        if not admitted:
            return
        if resets(body):
            lost = held is not None and held.lost_after(item.stream_seq or 0)
            self.expect_partial[key] = lost
            event(f"late: a reset {'with messages lost after it' if lost else 'with all after it held'}")
        self.index.apply(item)
        after = self.gate.after(body, item.stream_seq)
        if after is not None:
            self.index.apply(after)


class FleetLimits(RuleBasedStateMachine):

    @initialize(max_msgs=st.sampled_from([0, 0, 30, 60]), max_bytes=st.sampled_from([0, 0, 4000]),
                per_subject=st.sampled_from([0, 0, 3, 8]), max_age=st.sampled_from([0, 0, 6, 15]))
    def setup(self, max_msgs: int, max_bytes: int, per_subject: int, max_age: int) -> None:
        self.stream = LimitedStream(max_msgs, max_bytes, per_subject, max_age)
        event(f"limits: msgs={max_msgs} bytes={max_bytes} per_subject={per_subject} age={max_age}")
        self.keepers = {w: ResidencyKeeper(w, ranks=tuple(r for ww, r in RANKS if ww == w)) for w in ("pa", "pb")}
        self.service_up = {"pa": True, "pb": True}
        self.watcher = ResidencyIndex()
        self.reference = ReferenceIndex()
        self.lates: list[Late] = []
        self.epoch = {key: 1 for key in RANKS}
        self.seq = {key: 0 for key in RANKS}
        self.ids = 0
        for key in RANKS:
            self._record(key, record("start", worker=key[0], rank=key[1], epoch=1, reason="fresh"))

    # -- the bus ---------------------------------------------------------------

    def _store(self, out: Outgoing, worker: str) -> None:
        seq = self.stream.store(out)
        self.keepers[worker].stored(out, Stream.ack(seq, False))
        headers = dict(out.headers)
        item = BusMessage(out.subject, headers, CODEC.decode(out.subject, headers, out.payload), 1.0, seq)
        self.watcher.apply(item)
        self.reference.apply(item)
        for late in self.lates:
            if late.matches(out.subject):
                late.take(item, None)

    def _record(self, key: RankKey, rec: WorkerRecord) -> None:
        self.ids += 1
        self._store(ENCODER.record(rec, SubjectBook("kv", *key), f"r{self.ids}"), key[0])

    # -- the workers -------------------------------------------------------------

    @rule(key=st.sampled_from(RANKS), ops=st.lists(st.tuples(
        st.sampled_from(["store", "store", "remove"]), st.sampled_from([ATTN, STATE]),
        st.lists(st.integers(0, POOL - 1), min_size=1, max_size=4)), min_size=1, max_size=3))
    def batch(self, key: RankKey, ops: list[tuple[str, int, list[int]]]) -> None:
        worker, rank = key
        seq = self.seq[key]
        self.seq[key] += 1
        groups: dict[int, list[Any]] = {}
        for what, group, ids in ops:
            hashes = [hb(i) for i in (ids[-1:] if group == STATE else ids)]  # a state store: one checkpoint
            groups.setdefault(group, []).append(stored(hashes, group=group) if what == "store" else
                                                removed(hashes, group=group))
        for group, events in sorted(groups.items()):
            body = msg(events, group=group, worker=worker, rank=rank, epoch=self.epoch[key], seq=seq)
            self.ids += 1
            self._store(ENCODER.group(body, SubjectBook("kv", worker, rank), f"g{self.ids}"), worker)

    @rule(key=st.sampled_from(RANKS), what=st.sampled_from(["restart", "gap", "cleared"]))
    def worker_record(self, key: RankKey, what: str) -> None:
        worker, rank = key
        if what == "restart":
            self.epoch[key] += 1
            self.seq[key] = 0
            rec = record("restart", worker=worker, rank=rank, epoch=self.epoch[key], seq=0)
        elif what == "gap":
            first = self.seq[key]
            self.seq[key] += 2
            rec = record("gap", worker=worker, rank=rank, epoch=self.epoch[key], gap=(first, first + 1))
        else:
            rec = record("cleared", worker=worker, rank=rank, epoch=self.epoch[key], seq=self.seq[key])
            self.seq[key] += 1
        self._record(key, rec)

    @rule(worker=st.sampled_from(["pa", "pb"]))
    def service_toggles(self, worker: str) -> None:
        """A bridge's snapshot service stops answering, or answers again."""
        self.service_up[worker] = not self.service_up[worker]

    # -- the stream's limits -------------------------------------------------------

    @rule(n=st.integers(1, 5))
    def time_passes(self, n: int) -> None:
        self.stream.tick(n)

    @rule(pick=st.integers(0, 1000))
    def operator_deletes_one(self, pick: int) -> None:
        self.stream.delete(pick)

    # -- the late consumers ----------------------------------------------------------

    @precondition(lambda self: len(self.lates) < 3)
    @rule(subject=st.sampled_from(FILTERS))
    def a_consumer_joins(self, subject: str) -> None:
        """BusSubscriber._stream_bootstrap, at this moment: the covered ranks'
        snapshots (from the bridges that answer), the plan from the stream's
        holdings, the replay from where the snapshots end, then live."""
        late = Late(subject)
        found: dict[RankKey, Found] = {}
        for key in RANKS:
            if not late.covered.covers_rank(*key):
                continue
            worker, rank = key
            if self.service_up[worker]:
                keeper = self.keepers[worker]
                keeper.catch_up()
                snap = keeper.snapshot(rank)
                assert snap is not None and snap.complete
                found[key] = late.covered.trim(snap)
            else:
                found[key] = SnapshotMissing(worker, rank, "no bridge answers")
        held = self.stream.holdings()
        plan = stream_opening(found, held)
        late.gate = LiveGate(found, plan.skip_seq, held)
        item: Found | BusMessage
        for key, got in found.items():
            lost = type(got) is not RankSnapshot or self.stream.lost_after(got.stream_seq)
            late.expect_partial[key] = lost
            how = "with no snapshot" if type(got) is not RankSnapshot else \
                "whose stream lost messages after its snapshot" if lost else "whole"
            event(f"late: joined a rank {how}")
        for item in plan.items:
            late.index.apply(item)
        start = plan.start_seq if plan.start_seq is not None else self.stream.first_seq
        for seq, (out, _) in list(self.stream.held.items()):
            if seq >= start and late.matches(out.subject):
                headers = dict(out.headers)
                item = BusMessage(out.subject, headers, CODEC.decode(out.subject, headers, out.payload), 1.0, seq)
                late.take(item, self.stream)
        self.lates.append(late)

    # -- checks -------------------------------------------------------------------------

    @invariant()
    def always_on_equals_the_reference(self) -> None:
        if hasattr(self, "watcher"):
            assert_same_state(self.watcher, self.reference)

    @invariant()
    def late_views_are_right_or_flagged(self) -> None:
        for late in getattr(self, "lates", []):
            held = {(v.key.worker, v.key.dp_rank) for v in late.index}
            assert held == {k for k in RANKS if late.covered.covers_rank(*k)}, late.subject
            for key in held:
                mine, theirs = late.index.view(*key), self.watcher.view(*key)
                assert mine is not None and theirs is not None
                expect = late.expect_partial[key]
                assert mine.partial == expect, (late.subject, key, "flagged partial" if mine.partial else "whole")
                if not mine.partial:
                    a, b = view_state(mine), view_state(theirs)
                    # `lost`, the last gap ranges, is history kept across resets: a consumer
                    # that started at a reset never heard of the gaps before it.
                    lost, all_lost = a.pop("lost"), b.pop("lost")
                    assert a == b, (late.subject, key)
                    assert set(lost) <= set(all_lost), (late.subject, key)
                    event("late: a whole view equal to the always-on one")
                else:
                    assert mine.stale, (late.subject, key)
                    event("late: a view flagged partial")


FleetLimits.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
TestFleetLimits = FleetLimits.TestCase
