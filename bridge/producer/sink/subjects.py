"""The subjects of one (worker, rank), built once: the names and their escaping
are the contract's (bridge.contract.subjects)."""

from __future__ import annotations

from bridge.contract import MAX_GROUP_ID, WORKER_TOKEN, worker_token


class SubjectBook:
    """Subjects for one (worker, rank), built once: they are on the hot path.
    Only valid group ids (0..MAX_GROUP_ID) are kept, so the book stays bounded
    whatever ids reach it; others are built each time."""

    def __init__(self, prefix: str, worker_id: str, dp_rank: int) -> None:
        self.base = f"{prefix}.{worker_token(worker_id, dp_rank)}"
        self.worker = f"{self.base}.{WORKER_TOKEN}"
        self._groups: dict[int, str] = {}

    def group(self, group: int) -> str:
        subject = self._groups.get(group)
        if subject is None:
            subject = f"{self.base}.{group}"
            if 0 <= group <= MAX_GROUP_ID:
                self._groups[group] = subject
        return subject
