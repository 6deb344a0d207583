"""The fleet structure against today's implementation (`ReferenceIndex`): the
same streams of messages and records into both, every answer equal.

The hypothesis machine covers the semantics on small pools (records, epochs,
layers, copies, both hash forms, media, kinds learned late, declared groups,
forgotten workers); the seeded fleets cover what small pools do not reach:
long chains, shared prefixes, many workers, wide windows.
"""

from __future__ import annotations

import random
from collections import Counter
from itertools import compress
from operator import ne
from typing import Any

import hypothesis.strategies as st
import msgspec
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from bridge.client.subscribe import Interruption
from bridge.contract import BlockHash, BlockRemoved, BlockStored, GroupMessage, KindSource, WorkerRecord
from bridge.contract.kinds import family_of
from bridge.residency.cells import PyCell
from bridge.residency.index import ResidencyIndex
from bridge.residency.lean import ResidencyMessage, residency_decoder
from bridge.residency.prefix import match_view
from bridge.residency.rank_tables import RankTables
from tests.client.builders import hb, hi, msg, record
from tests.reference_index import ReferenceIndex

WORKERS = ("a", "b", "c")
RANKS = (0, 1)
GROUPS = (0, 1, 2, 3)
MEDIA = ("GPU", "CPU", "STORAGE")
KINDS = ("full_attention", "sliding_window", "mamba", "cross_attention", "mla_attention",
         "chunked_local_attention", "encoder_only_attention")
# (window tokens, block size): vLLM's k = ceil((window - 1) / block) is 0, 1, 2, 3, 4 or unknown
SHAPES = ((33, 16), (17, 16), (1, 16), (48, 16), (64, 16), (0, 16), (33, 0))
# both forms, and ints outside 0..2^64-1 (a bytes chain never finds those)
POOL = [hb(i) for i in range(6)] + [hi(i) for i in range(6)] + [-(1 + i) for i in range(2)] + [2**64 + 5]
UNKNOWN = hb(999)
QUERY_MEDIA = (None, ("GPU",), ("CPU",), ("GPU", "CPU"), ("STORAGE",), ("GPU", "CPU", "STORAGE"), ())


def _layers(g: Any) -> dict[str, Any]:
    return {layer: {m: dict(t.items()) for m, t in getattr(g, layer).items() if len(t)}
            for layer in ("trusted", "suspect", "placeholders")}


def assert_same_state(new: ResidencyIndex, ref: ReferenceIndex) -> None:
    assert list(new.views) == list(ref.views)
    assert new.interruptions == ref.interruptions
    assert new.reannounced_ignored == ref.reannounced_ignored
    for key, v in new.views.items():
        r = ref.views[key]
        for attr in ("epoch", "watching", "stale", "gaps", "restarts", "clears", "interruptions", "lost",
                     "old_epoch_ignored", "duplicates_ignored", "messages", "last_seq", "topic", "last_ts"):
            assert getattr(v, attr) == getattr(r, attr), (key, attr)
        assert list(v.groups) == list(r.groups), key
        for group, g in v.groups.items():
            rg = r.groups[group]
            for attr in ("kind", "family", "block_size", "window", "stored", "removed", "unknown_removals",
                         "last_position"):
                assert getattr(g, attr) == getattr(rg, attr), (key, group, attr)
            assert _layers(g) == _layers(rg), (key, group)
            assert g.media() == rg.media()
            for m in MEDIA:
                assert g.resident(m) == rg.resident(m)
                assert g.suspect_count(m) == rg.suspect_count(m)
            assert g.suspect_count() == rg.suspect_count()


def assert_same_answers(new: ResidencyIndex, ref: ReferenceIndex, chain: list, *,
                        fleet: bool = True, **kw: Any) -> None:
    """`fleet`: `new` keeps the fleet structure, whose `prefix_hits` is checked too."""
    got = new.longest_prefix(chain, **kw)
    want = ref.longest_prefix(chain, **kw)
    assert got == want, (chain, kw)
    media, suspect = kw.get("media"), kw.get("include_suspect", False)
    for key, view in new.views.items():
        one = new.match(key.worker, key.dp_rank, chain, media=media, include_suspect=suspect)
        assert one == ref.match(key.worker, key.dp_rank, chain, media=media, include_suspect=suspect)
        # the per-worker faces still answer prefix.match_view as before
        assert match_view(view, chain, media, suspect) == one
    if not fleet:
        return
    hits = new.fleet.prefix_hits(chain, media=media, include_suspect=suspect,
                                 include_unwatched=kw.get("include_unwatched", False),
                                 skip_workers=kw.get("skip_workers", ()))
    assert sorted((k.worker, k.dp_rank, p) for k, p in hits) == sorted(
        (m.worker, m.dp_rank, m.blocks) for m in want if m.blocks > 0)


def audit(fleet: Any) -> None:
    """The fleet structure's bookkeeping, recounted from its columns: set
    references, counters, unions, aliases, names. Wrong bookkeeping can leave
    answers right and leak (or reuse a set still named).

    Columns are as long as the id capacity (1,024 at the least) and mostly 0
    (nobody), where every check below holds by itself: the per-entry checks
    visit the non-zero entries only, found at C speed (`compress`), as this
    runs after every step of the state machine."""
    sets, columns, ids = fleet._sets, fleet._columns, fleet._ids
    S, refs = sets.S, Counter()  # type: ignore[var-annotated]
    cap = columns.cap
    assert S[0] == 0  # sid 0 is nobody: what makes the skipped entries hold

    def members(sid: int) -> int:
        return S[sid]

    for grp in columns.groups.values():
        cols = [(t, t.held, t.trusted) for t in grp.tiers.values()]
        if grp.u_held is not None:
            cols.append((grp, grp.u_held, grp.u_trusted))
            every = [c for _, h, t in cols for c in (h, t)]
            assert all(len(c) >= cap for c in every)
            # an entry where every column says 0 is empty in the union and its tiers alike
            for i in sorted({i for c in every for i in compress(range(cap), c)}):
                want_h = want_t = 0
                for t in grp.tiers.values():
                    want_h |= members(t.held[i])
                    want_t |= members(t.trusted[i])
                assert members(grp.u_held[i]) == want_h and members(grp.u_trusted[i]) == want_t, i
            assert (grp.u_trusted is grp.u_held) == all(t.trusted is t.held for t in grp.tiers.values())
        for owner, held, trusted in cols:
            refs.update(held)
            if trusted is not held:
                refs.update(compress(trusted, map(ne, trusted, held)))
            assert owner.distinct == len(held) - held.count(0)
            assert owner.shared == sum(1 for x in filter(None, held) if not x & 1)
            # trusted within held (a 0 in trusted is within anything)
            assert all(members(trusted[i]) & ~members(held[i]) == 0
                       for i in compress(range(min(len(trusted), len(held))), trusted))
        for t in grp.tiers.values():
            assert t.entries == sum(members(x).bit_count() for x in filter(None, t.held))
            assert (t.trusted is t.held) == (t.suspect_entries == 0), (t.group, t.medium)
            assert t.entries == sum(c.held for c in t.cells.values())
            assert t.suspect_entries == sum(c.suspect for c in t.cells.values())
    for sid in range(2, len(S), 2):
        assert sets.sref[sid] == refs[sid], sid
        if refs[sid]:
            assert sets.sid[S[sid]] == sid
    assert len(sets.sid) == sum(1 for sid in range(2, len(S), 2) if refs[sid])
    assert ids.cap == columns.cap and all(len(c) == ids.cap for t in columns.tier_list for c in (t.held, t.trusted))
    for h, i in ids.by_hash.items():
        assert ids.hash_at(i) == h and any(t.held[i] for t in columns.tier_list)
    for slot in fleet._keys:
        # a partial view counts one more (fleet.set_partial)
        assert fleet._suspect[slot] == sum(t.cells[slot].suspect for t in columns.tier_list if slot in t.cells) + \
            (slot in fleet._partial)


hash_lists = st.lists(st.sampled_from(POOL), min_size=1, max_size=5)
runs = st.tuples(st.integers(0, 5), st.integers(1, 6), st.booleans()).map(
    lambda t: [(hb if t[2] else hi)(i) for i in range(t[0], min(6, t[0] + t[1]))])
some_hashes = st.one_of(runs, hash_lists)
chains = st.one_of(
    st.tuples(st.integers(0, 7), st.booleans()).map(lambda t: [(hb if t[1] else hi)(i) for i in range(t[0])]),
    st.lists(st.sampled_from([*POOL, UNKNOWN]), max_size=9),
)
LEAN = residency_decoder()
workers = st.sampled_from(WORKERS)
ranks = st.sampled_from(RANKS)
groups = st.sampled_from(GROUPS)
media = st.sampled_from((*MEDIA, None))


class FleetVersusReference(RuleBasedStateMachine):
    # The store under test: the fleet structure here, per-rank tables in
    # RankTablesVersusReference below (the same machine).
    fleet = True

    @staticmethod
    def make_index() -> ResidencyIndex:
        return ResidencyIndex()

    @initialize(layout=st.lists(st.sampled_from(KINDS), min_size=4, max_size=4),
                other=st.lists(st.sampled_from(KINDS), min_size=4, max_size=4),
                shape=st.sampled_from(SHAPES))
    def setup(self, layout: list[str], other: list[str], shape: tuple[int, int]) -> None:
        # "a" and "c" share a layout, "b" has another: groups of one index differ in kind across the fleet
        self.kinds = {"a": layout, "b": other, "c": layout}
        self.shape = shape
        self.new = self.make_index()
        self.ref = ReferenceIndex()
        # The same messages read as the bridge's keeper reads them: token ids
        # left encoded (bridge.residency.lean).
        self.lean = self.make_index()
        self.epoch = {(w, r): 1 for w in WORKERS for r in RANKS}
        self.seq = 0
        self.sent: list[GroupMessage] = []

    def _both(self, item: GroupMessage | WorkerRecord | Interruption) -> None:
        self.new.apply(item)
        self.ref.apply(item)
        lean: GroupMessage | WorkerRecord | Interruption | ResidencyMessage
        try:
            lean = LEAN.decode(msgspec.msgpack.encode(item)) if type(item) is GroupMessage else item
        except OverflowError:  # a hash past 64 bits: only Python objects carry it
            lean = item
        if lean is item:
            self.lean.apply(item)
        else:
            assert isinstance(lean, ResidencyMessage)
            self.lean.apply_group(lean)

    def _send(self, worker: str, rank: int, group: int, events: list[Any], kind: str | None = None,
              epoch: int | None = None) -> None:
        self.seq += 1
        source: KindSource = "unknown" if kind == "unknown" else "event"
        m = msg(events, group=group, worker=worker, rank=rank, seq=self.seq, kind=kind or self.kinds[worker][group],
                source=source, epoch=self.epoch[(worker, rank)] if epoch is None else epoch, ts=float(self.seq))
        self.sent.append(m)
        self._both(m)

    @rule(worker=workers, rank=ranks, group=groups, medium=media, hashes=some_hashes,
          placeholder=st.sampled_from([False, False, False, True]), shaped=st.booleans(), unknown_kind=st.booleans())
    def store(self, worker: str, rank: int, group: int, medium: str | None, hashes: list, placeholder: bool,
              shaped: bool, unknown_kind: bool) -> None:
        window, block = self.shape if shaped else (0, 16)
        event = BlockStored(
            block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=0 if placeholder else block,
            lora_id=None, medium=medium, lora_name=None, group_idx=group, kv_cache_spec_kind=self.kinds[worker][group],
            kv_cache_spec_sliding_window=window, placeholder=placeholder,
        )
        self._send(worker, rank, group, [event], kind="unknown" if unknown_kind else None)

    @rule(worker=workers, rank=ranks, n=st.integers(1, 5), as_bytes=st.booleans(), state_first=st.booleans(),
          shaped=st.booleans())
    def report_mode_full(self, worker: str, rank: int, n: int, as_bytes: bool, state_first: bool, shaped: bool) -> None:
        """vLLM with kv_cache_report_mode=full: one batch position, every group
        a parent-less GPU store of the chain's first n hashes, tokens in all but
        the state groups (the bridge strips those). A re-announced hit adds
        nothing; a first request stores for real."""
        chain = [(hb if as_bytes else hi)(i) for i in range(n)]
        window, block = self.shape if shaped else (0, 16)
        self.seq += 1
        order = sorted(GROUPS, key=lambda g: (family_of(self.kinds[worker][g]) != "state") == state_first)
        for group in order:
            kind = self.kinds[worker][group]
            tokens = [] if family_of(kind) == "state" else [7] * (n * max(block, 1))
            event = BlockStored(block_hashes=list(chain), parent_block_hash=None, token_ids=tokens, block_size=block,
                                lora_id=None, medium="GPU", lora_name=None, group_idx=group, kv_cache_spec_kind=kind,
                                kv_cache_spec_sliding_window=window)
            m = msg([event], group=group, worker=worker, rank=rank, seq=self.seq, kind=kind,
                    epoch=self.epoch[(worker, rank)], ts=float(self.seq))
            self.sent.append(m)
            self._both(m)

    @rule(worker=workers, rank=ranks, group=groups, medium=media, hashes=some_hashes)
    def remove(self, worker: str, rank: int, group: int, medium: str | None, hashes: list) -> None:
        self._send(worker, rank, group, [BlockRemoved(block_hashes=list(hashes), medium=medium, group_idx=group)])

    @rule(data=st.data())
    def remove_or_repeat_a_held_copy(self, data: st.DataObject) -> None:
        held = sorted({(k.worker, k.dp_rank, group, medium, h)
                       for k, v in self.ref.views.items() for group, g in v.groups.items()
                       for layer in (g.trusted, g.suspect, g.placeholders) for medium, t in layer.items() for h in t},
                      key=repr)
        if not held:
            return
        worker, rank, group, medium, h = data.draw(st.sampled_from(held))
        if data.draw(st.booleans()):
            self._send(worker, rank, group, [BlockRemoved(block_hashes=[h], medium=medium, group_idx=group)])
        else:
            self.store(worker, rank, group, medium, [h], False, True, False)

    @rule(worker=workers, rank=ranks, what=st.sampled_from(
        ["gap", "interruption", "cleared", "restart", "silent_epoch", "fresh_start", "resumed_start", "stop",
         "old_straggler", "old_record", "declare", "forget"]),
        group=groups, kind=st.sampled_from(KINDS))
    def records(self, worker: str, rank: int, what: str, group: int, kind: str) -> None:
        epoch = self.epoch[(worker, rank)]
        if what == "gap":
            self._both(record("gap", worker=worker, rank=rank, epoch=epoch, gap=(1, 2)))
        elif what == "interruption":
            self._both(Interruption("slow_consumer", 0.0))
        elif what in ("cleared", "stop"):
            self._both(record(what, worker=worker, rank=rank, epoch=epoch))  # type: ignore[arg-type]
        elif what == "restart":
            self.epoch[(worker, rank)] += 1
            self._both(record("restart", worker=worker, rank=rank, epoch=epoch + 1, seq=0))
        elif what == "silent_epoch":
            self.epoch[(worker, rank)] += 1
        elif what in ("fresh_start", "resumed_start"):
            self._both(record("start", worker=worker, rank=rank, epoch=epoch,
                              reason="resumed" if what == "resumed_start" else "fresh"))
        elif what == "old_straggler" and epoch > 1:
            self._send(worker, rank, 0, [BlockStored(
                block_hashes=[POOL[0]], parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                medium="GPU", lora_name=None)], epoch=epoch - 1)
        elif what == "old_record" and epoch > 1:
            self._both(record("cleared", worker=worker, rank=rank, epoch=epoch - 1))
        elif what == "declare":
            for index in (self.new, self.ref, self.lean):
                index.declare(worker, rank, group, kind, 16, 33 if kind == "sliding_window" else None)
        elif what == "forget":
            self.new.forget(worker)
            self.ref.forget(worker)
            self.lean.forget(worker)

    @rule(data=st.data())
    def a_message_published_again(self, data: st.DataObject) -> None:
        if self.sent:
            self._both(data.draw(st.sampled_from(self.sent)))

    @rule(chain=chains, media=st.sampled_from(QUERY_MEDIA), suspect=st.booleans(), unwatched=st.booleans(),
          skip=st.sampled_from([(), ("a",), ("b", "zz")]))
    def query(self, chain: list, media: Any, suspect: bool, unwatched: bool, skip: tuple[str, ...]) -> None:
        assert_same_answers(self.new, self.ref, chain, fleet=self.fleet, media=media, include_suspect=suspect,
                            include_unwatched=unwatched, skip_workers=skip)

    @invariant()
    def same_state(self) -> None:
        if hasattr(self, "new"):
            assert_same_state(self.new, self.ref)
            assert_same_answers(self.new, self.ref, [hb(i) for i in range(6)], fleet=self.fleet)
            assert_same_state(self.lean, self.ref)
            assert self.lean.reannounced_ignored == self.new.reannounced_ignored
            # nothing held, nothing interned: ids are freed with the last copy
            held = {h for v in self.ref.views.values() for g in v.groups.values()
                    for layer in (g.trusted, g.suspect) for t in layer.values() for h in t}
            assert self.new.store.hashes == len(held)
            if self.fleet:
                audit(self.new.fleet)
            else:
                entries = sum(len(set(g.trusted.get(m, ())) | set(g.suspect.get(m, ())))
                              for v in self.ref.views.values() for g in v.groups.values()
                              for m in set(g.trusted) | set(g.suspect))
                assert self.new.store.entries == entries


FleetVersusReference.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow],
)
TestFleetVersusReference = FleetVersusReference.TestCase


class RankTablesVersusReference(FleetVersusReference):
    """The same machine over per-rank tables (`RankTables`, the bridge's keeper's store)."""

    fleet = False

    @staticmethod
    def make_index() -> ResidencyIndex:
        return ResidencyIndex(store=RankTables())


# Fewer examples than the fleet's machine: the rules it runs are the same
# (checked there), only the store under them differs.
RankTablesVersusReference.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow],
)
TestRankTablesVersusReference = RankTablesVersusReference.TestCase


class PyCellTablesVersusReference(RankTablesVersusReference):
    """The per-rank tables over their Python tiers (`cells.PyCell`, what an
    install without the native module runs)."""

    @staticmethod
    def make_index() -> ResidencyIndex:
        return ResidencyIndex(store=RankTables(PyCell))


PyCellTablesVersusReference.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow],
)
TestPyCellTablesVersusReference = PyCellTablesVersusReference.TestCase


# -- seeded fleets: long chains, shared prefixes, wide windows ---------------------------------------------------

def fleet_traffic(seed: int, workers: int, *, window: int, block: int, int_form: bool) -> tuple[list[Any], list[list[int]]]:
    rnd = random.Random(seed)
    form = hi if int_form else hb
    prompts = [[10_000 * p + j for j in range(rnd.randint(5, 60))] for p in range(4)]
    items: list[Any] = []
    chains: list[list[int]] = []  # hash numbers: form(i) is the hash
    seq = 0
    for w in range(workers):
        name = f"w{w}"
        layout = rnd.choice([("full_attention", "sliding_window", "mamba"), ("full_attention", "mamba"),
                             ("sliding_window", "mamba", "full_attention"), ("full_attention",)])
        for c in range(rnd.randint(1, 3)):
            numbers = rnd.choice(prompts) + [1_000_000 * (w + 1) + 1000 * c + j for j in range(rnd.randint(0, 120))]
            chains.append(numbers)
            chain = [form(i) for i in numbers]
            for group, kind in enumerate(layout):
                if kind == "mamba":
                    hashes = [h for j, h in enumerate(chain) if j % rnd.choice((1, 3, 4)) == 0 or rnd.random() < 0.1]
                elif kind == "sliding_window":
                    cut = rnd.randint(0, len(chain))
                    hashes = chain[cut:] if rnd.random() < 0.7 else [h for h in chain if rnd.random() < 0.6]
                else:
                    hashes = chain[:rnd.randint(0, len(chain))] if rnd.random() < 0.3 else chain
                medium = rnd.choice(("GPU", "GPU", "CPU"))
                for a in range(0, len(hashes), 32):
                    seq += 1
                    ev = BlockStored(block_hashes=hashes[a:a + 32], parent_block_hash=None, token_ids=[],
                                     block_size=block, lora_id=None, medium=medium, lora_name=None, group_idx=group,
                                     kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window)
                    items.append(msg([ev], group=group, worker=name, seq=seq, kind=kind))
                if rnd.random() < 0.3 and hashes:
                    seq += 1
                    gone = rnd.sample(hashes, k=min(len(hashes), rnd.randint(1, 10)))
                    items.append(msg([BlockRemoved(block_hashes=gone, medium=medium, group_idx=group)], group=group,
                                     worker=name, seq=seq, kind=kind))
        if rnd.random() < 0.1:
            items.append(record("gap", worker=name, gap=(1, 2)))
    return items, chains


@pytest.mark.parametrize(("seed", "window", "block", "int_form"), [
    (1, 33, 16, True), (2, 1024, 16, False), (3, 65, 1, True), (4, 17, 16, False), (5, 4096, 1, True),
])
def test_seeded_fleets_answer_as_the_reference(seed: int, window: int, block: int, int_form: bool) -> None:
    items, chains = fleet_traffic(seed, 30, window=window, block=block, int_form=int_form)
    new, ref = ResidencyIndex(), ReferenceIndex()
    for item in items:
        new.apply(item)
        ref.apply(item)
    rnd = random.Random(seed)
    form = hi if int_form else hb
    for _ in range(40):
        chain = [form(i) for i in rnd.choice(chains)]
        if rnd.random() < 0.3:
            chain += [form(7_000_000 + j) for j in range(rnd.randint(1, 50))]
        if rnd.random() < 0.2:
            chain = chain[:rnd.randint(0, len(chain))]
        if int_form and rnd.random() < 0.3:
            chain = [hb(0), *chain]  # a bytes block in an int chain
        kw: dict[str, Any] = rnd.choice([{}, {"media": ("GPU",)}, {"include_suspect": True},
                                         {"media": ("CPU",), "include_suspect": True}])
        assert new.longest_prefix(chain, **kw) == ref.longest_prefix(chain, **kw)
    assert_same_state(new, ref)
    audit(new.fleet)
    new.apply(Interruption("disconnect", 0.0))
    ref.apply(Interruption("disconnect", 0.0))
    chain = [form(i) for i in chains[0]]
    assert new.longest_prefix(chain, include_suspect=True) == ref.longest_prefix(chain, include_suspect=True)
    assert new.longest_prefix(chain) == ref.longest_prefix(chain)
    for item in items[: len(items) // 2]:  # replay half as removals: sets shrink and are freed
        if isinstance(item, GroupMessage) and type(item.events[0]) is BlockStored:
            ev = item.events[0]
            m = msg([BlockRemoved(block_hashes=ev.block_hashes, medium=ev.medium, group_idx=ev.group_idx)],
                    group=item.group, worker=item.worker, kind=item.kind)
            new.apply(m)
            ref.apply(m)
    assert_same_state(new, ref)
    audit(new.fleet)
    assert new.longest_prefix(chain, include_suspect=True) == ref.longest_prefix(chain, include_suspect=True)


def test_bytes_requests_find_int_published_blocks_in_a_big_fleet() -> None:
    items, chains = fleet_traffic(7, 20, window=33, block=16, int_form=True)
    new, ref = ResidencyIndex(), ReferenceIndex()
    for item in items:
        new.apply(item)
        ref.apply(item)
    hits = 0
    for numbers in chains[:10]:
        as_bytes = [hb(i) for i in numbers]  # the request computed as bytes; the fleet published ints
        got = new.longest_prefix(as_bytes)
        assert got == ref.longest_prefix(as_bytes)
        hits += got[0].blocks
        mixed = as_bytes[:5] + [hi(i) for i in numbers[5:]]
        assert new.longest_prefix(mixed) == ref.longest_prefix(mixed)
    assert hits > 0


def test_report_mode_full_announcements_add_nothing_in_both() -> None:
    chain: list[BlockHash] = [hb(i) for i in range(4)]
    kinds = {0: "full_attention", 1: "sliding_window", 2: "mamba"}

    def batch(seq: int, n: int, state_first: bool) -> list[GroupMessage]:
        out = []
        for group in sorted(kinds, key=lambda g: (g != 2) == state_first):
            tokens = [] if group == 2 else [7] * (16 * n)
            ev = BlockStored(block_hashes=chain[:n], parent_block_hash=None, token_ids=tokens, block_size=16,
                             lora_id=None, medium="GPU", lora_name=None, group_idx=group, kv_cache_spec_kind=kinds[group],
                             kv_cache_spec_sliding_window=33 if group == 1 else None)
            out.append(msg([ev], group=group, seq=seq, kind=kinds[group]))
        return out

    new, ref = ResidencyIndex(), ReferenceIndex()
    for seq, n, state_first in ((1, 4, False), (2, 4, False), (3, 3, True), (4, 2, False)):
        for m in batch(seq, n, state_first):
            new.apply(m)
            ref.apply(m)
        assert_same_state(new, ref)
        assert_same_answers(new, ref, chain)
    assert new.reannounced_ignored == ref.reannounced_ignored > 0
    assert new.match("w", 0, chain).blocks == 4  # type: ignore[union-attr]
    assert new.view("w", 0).groups[0].count("GPU", chain[0]) == 1  # type: ignore[union-attr]


@pytest.mark.parametrize("store", ["fleet", "rank_tables"])
def test_a_parentless_store_of_a_chain_held_in_part_is_stored(store: str) -> None:
    """Report mode "full" is told by the worker resuming from the whole
    chain: holding its last blocks but not its first, a parent-less store
    is the worker storing them, and adds a copy of each."""
    chain: list[BlockHash] = [hb(i) for i in range(4)]

    def stored_at(seq: int, hashes: list[BlockHash], parent: BlockHash | None) -> GroupMessage:
        ev = BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=[7] * (16 * len(hashes)),
                         block_size=16, lora_id=None, medium="GPU", lora_name=None, group_idx=0,
                         kv_cache_spec_kind="full_attention", kv_cache_spec_sliding_window=None)
        return msg([ev], group=0, seq=seq, kind="full_attention")

    new = ResidencyIndex(store=RankTables()) if store == "rank_tables" else ResidencyIndex()
    ref = ReferenceIndex()
    for m in (stored_at(1, chain[1:], chain[0]), stored_at(2, chain, None)):
        new.apply(m)
        ref.apply(m)
    assert_same_state(new, ref)
    assert new.reannounced_ignored == ref.reannounced_ignored == 0
    g = new.view("w", 0).groups[0]  # type: ignore[union-attr]
    assert (g.count("GPU", chain[0]), g.count("GPU", chain[-1])) == (1, 2)
