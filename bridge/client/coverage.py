"""Which worker ranks and groups a subscription's subject filter covers, so a
bootstrap fetches, keeps and answers for exactly those (docs/consumers.md,
"Following part of the fleet").

A rank is covered when the filter matches one of its subjects,
`<prefix>.<token>.worker` or `<prefix>.<token>.<group>` for some group; a
group when it matches that group's subject. Filters follow NATS: `*` is one
token, `>` the rest (one token or more).
"""

from __future__ import annotations

from typing import Final

import msgspec

from bridge.contract import WORKER_TOKEN, worker_token
from bridge.contract.snapshot import RankSnapshot

# Stands for "some group's token" in the last place of a rank's subjects.
_ANY_GROUP: Final = None


def _matches(pattern: list[str], subject: list[str | None]) -> bool:
    for i, want in enumerate(pattern):
        if want == ">":
            return len(subject) > i
        if i >= len(subject):
            return False
        token = subject[i]
        if token is _ANY_GROUP:
            if want != "*" and not (want.isascii() and want.isdigit() and str(int(want)) == want):
                return False
        elif want != "*" and want != token:
            return False
    return len(pattern) == len(subject)


class SubjectFilter:
    """`subject`: the subscription's filter; `prefix`: the bridges' subject prefix."""

    __slots__ = ("_pattern", "_prefix", "subject")

    def __init__(self, subject: str, prefix: str) -> None:
        self.subject = subject
        self._pattern = subject.split(".")
        self._prefix = prefix.split(".")

    def _base(self, worker: str, dp_rank: int) -> list[str | None]:
        return [*self._prefix, worker_token(worker, dp_rank)]

    def covers_records(self, worker: str, dp_rank: int) -> bool:
        return _matches(self._pattern, [*self._base(worker, dp_rank), WORKER_TOKEN])

    def covers_group(self, worker: str, dp_rank: int, group: int) -> bool:
        return _matches(self._pattern, [*self._base(worker, dp_rank), str(group)])

    def covers_rank(self, worker: str, dp_rank: int) -> bool:
        return self.covers_records(worker, dp_rank) or _matches(self._pattern, [*self._base(worker, dp_rank),
                                                                                _ANY_GROUP])

    def trim(self, snap: RankSnapshot) -> RankSnapshot:
        """The snapshot with only the groups the filter covers (the others'
        messages never arrive, so their state would only go stale)."""
        groups = [g for g in snap.groups if self.covers_group(snap.worker, snap.dp_rank, g.group)]
        return snap if len(groups) == len(snap.groups) else msgspec.structs.replace(snap, groups=groups)
