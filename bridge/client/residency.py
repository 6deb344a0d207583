"""Residency data of one worker and rank: per group, per medium, hash → copies.

The rules for feeding it (records, epochs) live in `bridge.client.index`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from bridge.contract.events import BlockHash

Table = dict[BlockHash, int]


class WorkerKey(NamedTuple):
    worker: str
    dp_rank: int


def _take(table: Table | None, key: BlockHash) -> bool:
    """One copy of `key` out of `table`; False when it holds none."""
    if not table:
        return False
    count = table.get(key, 0)
    if count <= 0:
        return False
    if count == 1:
        del table[key]
    else:
        table[key] = count - 1
    return True


class GroupResidency:
    """One kv_cache_group of one worker and rank."""

    __slots__ = ("group", "kind", "family", "block_size", "window", "trusted", "suspect", "placeholders",
                 "stored", "removed", "unknown_removals", "last_position")

    def __init__(self, group: int, kind: str, family: str) -> None:
        self.group = group
        self.kind = kind
        self.family = family
        self.block_size = 0  # tokens per block, learned from stores; 0 = unknown
        self.window: int | None = None  # sliding window in tokens, from kv_cache_spec_sliding_window
        self.trusted: dict[str, Table] = {}
        self.suspect: dict[str, Table] = {}
        # Window placeholders name no position; they are held apart so their
        # removals balance without ever counting as residency.
        self.placeholders: dict[str, Table] = {}
        self.stored = 0
        self.removed = 0
        self.unknown_removals = 0
        # (seq, part, chunk) of the last message applied: within one epoch a
        # group's messages come in that order, so one at or below it is a copy.
        self.last_position: tuple[int, int, int] | None = None

    def learn(self, kind: str, family: str) -> None:
        self.kind = kind
        self.family = family

    def store(self, medium: str, hashes: Iterable[BlockHash], placeholder: bool) -> None:
        table = (self.placeholders if placeholder else self.trusted).setdefault(medium, {})
        for h in hashes:
            table[h] = table.get(h, 0) + 1
            self.stored += 1

    def remove(self, medium: str, hashes: Iterable[BlockHash]) -> None:
        trusted = self.trusted.get(medium)
        suspect = self.suspect.get(medium)
        placeholders = self.placeholders.get(medium)
        for h in hashes:
            if _take(trusted, h) or _take(suspect, h) or _take(placeholders, h):
                self.removed += 1
            else:
                self.unknown_removals += 1

    def demote(self) -> None:
        """A gap: what is held may have been removed unseen."""
        for medium, table in self.trusted.items():
            suspect = self.suspect.setdefault(medium, {})
            for h, n in table.items():
                suspect[h] = suspect.get(h, 0) + n
        self.trusted = {}

    def clear(self) -> None:
        self.trusted = {}
        self.suspect = {}
        self.placeholders = {}

    def media(self) -> set[str]:
        return {m for layer in (self.trusted, self.suspect) for m, t in layer.items() if t}

    def resident(self, medium: str) -> int:
        """Distinct trusted hashes in `medium`."""
        return len(self.trusted.get(medium, ()))

    def suspect_count(self, medium: str | None = None) -> int:
        if medium is not None:
            return len(self.suspect.get(medium, ()))
        return sum(len(t) for t in self.suspect.values())

    def count(self, medium: str, h: BlockHash, *, suspect: bool = False) -> int:
        """Copies of `h` held (trusted layer, or the suspect layer)."""
        return (self.suspect if suspect else self.trusted).get(medium, {}).get(h, 0)

    def tables(self, media: Iterable[str] | None, include_suspect: bool) -> list[Table]:
        layers = (self.trusted, self.suspect) if include_suspect else (self.trusted,)
        out: list[Table] = []
        for layer in layers:
            for medium, table in layer.items():
                if table and (media is None or medium in media):
                    out.append(table)
        return out


class WorkerView:
    """Everything the index knows about one (worker, dp_rank)."""

    __slots__ = ("key", "epoch", "groups", "topic", "last_seq", "last_ts", "last_received", "lag", "watching",
                 "gaps", "restarts", "clears", "interruptions", "lost", "old_epoch_ignored", "messages",
                 "duplicates_ignored")

    def __init__(self, key: WorkerKey, epoch: int) -> None:
        self.key = key
        self.epoch = epoch  # 0: not known yet; the first one seen is adopted as is
        self.groups: dict[int, GroupResidency] = {}
        self.topic = ""
        self.last_seq: int | None = None
        self.last_ts = 0.0  # vLLM's ts of the last batch seen
        self.last_received = 0.0  # this process's clock at that moment
        self.lag: float | None = None  # received − vLLM ts, seconds
        self.watching = True
        self.gaps = 0
        self.restarts = 0
        self.clears = 0
        self.interruptions = 0
        self.lost: list[tuple[int, int]] = []
        self.old_epoch_ignored = 0
        self.duplicates_ignored = 0
        self.messages = 0

    @property
    def stale(self) -> bool:
        """Some entries are suspect: a gap or interruption since the last reset."""
        return any(g.suspect_count() for g in self.groups.values())

    def reset(self, epoch: int) -> None:
        self.epoch = epoch
        self.groups = {}
        self.last_seq = None

    def group(self, group: int, kind: str, family: str) -> GroupResidency:
        found = self.groups.get(group)
        if found is None:
            found = self.groups[group] = GroupResidency(group, kind, family)
        return found
