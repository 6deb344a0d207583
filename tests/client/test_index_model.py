"""The residency index against a reference model, on random interleavings.

The model keeps each worker rank's event log since its last reset and
recomputes everything from it on every check: counts by replay, and the
prefix by trying every p against the rule's definition. It shares no code
with the index.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from bridge.client.subscribe import Interruption
from bridge.contract import BlockHash, GroupMessage
from bridge.residency.index import ResidencyIndex
from tests.client.builders import ATTN, STATE, WIN, hb, hi, msg, record, removed, stored
from tests.client.model import replay

POOL = 6  # hash ids 0..5; a request's chain is mostly 0, 1, 2, ... as real chains are
RANKS = (0, 1)
GROUPS = (ATTN, STATE, WIN)
MEDIA = ("GPU", "CPU")
WINDOW_NEED = 2  # window 33 tokens, blocks of 16: vLLM needs ceil(32/16) blocks


@dataclass
class RankModel:
    epoch: int = 1
    log: list[tuple] = field(default_factory=list)
    watching: bool = True
    pending_reset: bool = False  # the epoch moved on without a record
    sent: list[GroupMessage] = field(default_factory=list)  # since the view's last reset


def model_prefix(log: list[tuple], chain: list, media: tuple[str, ...] | None, with_suspect: bool) -> int:
    trusted, suspect, _, _, groups = replay(log)
    allowed = MEDIA if media is None else media

    def held(g: int, h: object) -> bool:
        return any(trusted.get((g, m, h), 0) > 0 or (with_suspect and suspect.get((g, m, h), 0) > 0)
                   for m in allowed)

    def valid(p: int) -> bool:
        for g in groups:
            if g == ATTN and not all(held(g, chain[i]) for i in range(p)):
                return False
            if g == STATE and p > 0 and not held(g, chain[p - 1]):
                return False
            if g == WIN and not all(held(g, chain[i]) for i in range(max(0, p - WINDOW_NEED), p)):
                return False
        return True

    if not groups:
        return 0
    return max(p for p in range(len(chain) + 1) if valid(p))


hash_ids = st.lists(st.integers(0, POOL - 1), min_size=1, max_size=4)
# Stores and removals of runs of the canonical chain reach deep prefixes often;
# arbitrary id lists reach odd cases (duplicates, holes).
runs = st.tuples(st.integers(0, POOL - 1), st.integers(1, POOL)).map(
    lambda t: list(range(t[0], min(POOL, t[0] + t[1])))
)
some_ids = st.one_of(runs, hash_ids)
chains = st.one_of(st.integers(0, POOL).map(lambda n: list(range(n))), st.lists(st.integers(0, POOL - 1), max_size=7))


class IndexVersusModel(RuleBasedStateMachine):
    @initialize(int_hashes=st.booleans())
    def setup(self, int_hashes: bool) -> None:
        self.form = hi if int_hashes else hb
        self.index = ResidencyIndex()
        self.ranks = {r: RankModel() for r in RANKS}
        self.seq = 0

    def _touch(self, rank: int) -> RankModel:
        model = self.ranks[rank]
        if model.pending_reset:
            model.log.clear()
            model.sent.clear()
            model.pending_reset = False
        return model

    def _send(self, rank: int, group: int, event: object) -> None:
        self.seq += 1
        message = msg([event], group=group, rank=rank, epoch=self.ranks[rank].epoch, seq=self.seq)  # type: ignore[list-item]
        self.ranks[rank].sent.append(message)
        self.index.apply(message)

    @rule(data=st.data())
    def a_message_published_again(self, data: st.DataObject) -> None:
        """JetStream mode on a core subscription: a publish whose ack was late
        goes again, after later ones. The stream keeps one copy; the index too."""
        current = [m for model in self.ranks.values() if not model.pending_reset for m in model.sent]
        if not current:
            return
        self.index.apply(data.draw(st.sampled_from(current)))

    @rule(rank=st.sampled_from(RANKS), group=st.sampled_from(GROUPS), medium=st.sampled_from(MEDIA), ids=some_ids)
    def store(self, rank: int, group: int, medium: str, ids: list[int]) -> None:
        hashes = [self.form(i) for i in ids]
        model = self._touch(rank)
        model.log.append(("store", group, medium, hashes, False))
        model.watching = True
        self._send(rank, group, stored(hashes, group=group, medium=medium))

    @rule(rank=st.sampled_from(RANKS), group=st.sampled_from((STATE, WIN)), medium=st.sampled_from(MEDIA))
    def a_groups_shape_store(self, rank: int, group: int, medium: str) -> None:
        """A group's first message when nothing in it named a position: a store
        with no hash (a window one with vLLM's placeholder block size 0)."""
        model = self._touch(rank)
        model.log.append(("store", group, medium, [], False))
        model.watching = True
        self._send(rank, group, stored([], group=group, medium=medium, block_size=0 if group == WIN else 16))

    @rule(rank=st.sampled_from(RANKS), medium=st.sampled_from(MEDIA), i=st.integers(0, POOL - 1))
    def store_window_placeholder(self, rank: int, medium: str, i: int) -> None:
        model = self._touch(rank)
        model.log.append(("store", WIN, medium, [self.form(i)], True))
        model.watching = True
        self._send(rank, WIN, stored([self.form(i)], group=WIN, medium=medium, block_size=0))

    @rule(rank=st.sampled_from(RANKS), group=st.sampled_from(GROUPS), medium=st.sampled_from(MEDIA), ids=some_ids)
    def remove(self, rank: int, group: int, medium: str, ids: list[int]) -> None:
        hashes = [self.form(i) for i in ids]
        model = self._touch(rank)
        model.log.append(("remove", group, medium, hashes))
        model.watching = True
        self._send(rank, group, removed(hashes, group=group, medium=medium))

    def _draw_held(self, data: st.DataObject) -> tuple[int, int, str, BlockHash] | None:
        held = sorted(
            {(r, k) for r in RANKS for layer in replay(self.ranks[r].log)[:3] for k, n in layer.items() if n > 0},
            key=repr,
        )
        if not held:
            return None
        rank, (group, medium, h) = data.draw(st.sampled_from(held))
        return rank, group, medium, h

    @rule(data=st.data())
    def remove_a_held_copy(self, data: st.DataObject) -> None:
        """Removals that hit something: the interesting ones (ref counts, layers)."""
        drawn = self._draw_held(data)
        if drawn is None:
            return
        rank, group, medium, h = drawn
        model = self._touch(rank)
        model.log.append(("remove", group, medium, [h]))
        model.watching = True
        self._send(rank, group, removed([h], group=group, medium=medium))

    @rule(data=st.data())
    def announce_a_held_hash_again(self, data: st.DataObject) -> None:
        """vLLM re-announces a hash a second block got (also across a gap)."""
        drawn = self._draw_held(data)
        if drawn is None:
            return
        rank, group, medium, h = drawn
        model = self._touch(rank)
        model.log.append(("store", group, medium, [h], False))
        model.watching = True
        self._send(rank, group, stored([h], group=group, medium=medium))

    @rule(rank=st.sampled_from(RANKS), interruption=st.booleans())
    def loss(self, rank: int, interruption: bool) -> None:
        """A gap record for one rank, or this consumer's own interruption (all ranks)."""
        if interruption:
            for r, model in self.ranks.items():
                if self.index.view("w", r) is not None:
                    model.log.append(("gap",))
            self.index.apply(Interruption("slow_consumer", 0.0))
        else:
            self._touch(rank).log.append(("gap",))
            self.index.apply(record("gap", rank=rank, epoch=self.ranks[rank].epoch, gap=(1, 2)))

    @rule(rank=st.sampled_from(RANKS),
          what=st.sampled_from(["cleared", "restart", "silent_epoch", "fresh_start", "resumed_start", "stop"]))
    def reset_or_lifecycle(self, rank: int, what: str) -> None:
        """Everything that resets or hides a view, as one rule so they stay rarer than traffic."""
        model = self.ranks[rank]
        if what == "cleared":
            self._touch(rank).log.append(("clear",))
            self.index.apply(record("cleared", rank=rank, epoch=model.epoch))
        elif what == "restart":
            model.epoch += 1
            model.log.clear()
            model.sent.clear()
            model.pending_reset = False
            model.watching = True
            self.index.apply(record("restart", rank=rank, epoch=model.epoch, seq=0))
        elif what == "silent_epoch":
            # a new process whose records this consumer never saw: the next message tells
            model.epoch += 1
            model.pending_reset = True
        elif what in ("fresh_start", "resumed_start"):
            if what == "fresh_start":
                model.log.clear()
                model.sent.clear()
            model.pending_reset = False
            model.watching = True
            self.index.apply(record("start", rank=rank, epoch=model.epoch,
                                    reason="resumed" if what == "resumed_start" else "fresh"))
        else:
            self._touch(rank).watching = False
            self.index.apply(record("stop", rank=rank, epoch=model.epoch))

    @rule(rank=st.sampled_from(RANKS), ids=hash_ids)
    def straggler_from_an_old_epoch(self, rank: int, ids: list[int]) -> None:
        model = self.ranks[rank]
        if model.epoch > 1 and not model.pending_reset:
            self.index.apply(msg([stored([self.form(i) for i in ids])], rank=rank, epoch=model.epoch - 1))

    @rule(ids=chains, media=st.sampled_from([None, ("GPU",), ("CPU",)]),
          with_suspect=st.booleans())
    def query_matches_the_model(self, ids: list[int], media: tuple[str, ...] | None, with_suspect: bool) -> None:
        chain = [self.form(i) for i in ids]
        got = {(m.worker, m.dp_rank): m.blocks
               for m in self.index.longest_prefix(chain, media=media, include_suspect=with_suspect)}
        want = {("w", r): model_prefix(self._log(r), chain, media, with_suspect)
                for r, m in self.ranks.items() if m.watching and self.index.view("w", r) is not None}
        assert got == want
        if self.form is hi:
            # the same request computed as bytes finds the int-published blocks
            as_bytes = self.index.longest_prefix([hb(i) for i in ids], media=media, include_suspect=with_suspect)
            assert {(m.worker, m.dp_rank): m.blocks for m in as_bytes} == want

    def _log(self, rank: int) -> list[tuple]:
        # While the epoch has moved unannounced, the index cannot know yet: it
        # still answers from the old log until the rank's next message.
        return self.ranks[rank].log

    @invariant()
    def counts_match_the_model(self) -> None:
        for rank in RANKS:
            view = self.index.view("w", rank)
            if view is None:
                continue
            trusted, suspect, holder, unknown, groups = replay(self._log(rank))
            assert set(view.groups) == groups
            for g, res in view.groups.items():
                assert res.unknown_removals == unknown[g]
                for m in MEDIA:
                    for layer, mine in ((trusted, res.trusted), (suspect, res.suspect), (holder, res.placeholders)):
                        want = {k[2]: n for k, n in layer.items() if k[0] == g and k[1] == m and n > 0}
                        assert mine.get(m, {}) == want
                        assert all(n > 0 for n in mine.get(m, {}).values())


IndexVersusModel.TestCase.settings = settings(
    max_examples=400, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow],
)
TestIndexVersusModel = IndexVersusModel.TestCase
