"""A consumer's guard on who a message speaks for (bridge.contract.identity):
refused messages, reply-subject copies included, are counted per reason and
logged once per source, never applied."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Final

from bridge.client.log import get_logger
from bridge.contract import GroupMessage
from bridge.contract.identity import Refusal, check, check_key, reply_copy, subject_origin

log = get_logger("bridge.client.identity")

# Sources remembered for "logged once": past this many, refusals are only counted.
MAX_LOGGED_SOURCES: Final = 1024


class IdentityGuard:
    """`refused`: refusals per reason, for metrics and tests."""

    __slots__ = ("_logged", "refused")

    def __init__(self) -> None:
        self.refused: Counter[Refusal] = Counter()
        self._logged: set[tuple[str, Refusal]] = set()

    def delivered(self, subject: str, headers: Mapping[str, str] | None) -> bool:
        """Whether a message a subscription or consumer delivered on `subject`
        (an event subject, a bucket key's) is what its publisher sent, not a
        server's answer stored there by someone's reply subject."""
        if not reply_copy(headers):
            return True
        assert headers is not None
        self.refuse(Refusal.REPLY_COPY, subject, None, None, copied_from=str(headers.get("Nats-Subject", ""))[:300])
        return False

    def message(self, subject: str, body: object) -> bool:
        """Whether a decoded contract message may be applied as coming from `subject`."""
        group = body.group if type(body) is GroupMessage else None
        why = check(subject_origin(subject), body.worker, body.dp_rank, group)  # type: ignore[attr-defined]
        if why is None:
            return True
        self.refuse(why, subject, body.worker, body.dp_rank)  # type: ignore[attr-defined]
        return False

    def keyed(self, key: str, worker: str, dp_rank: int, what: str) -> bool:
        """Whether an entry or snapshot stored under `key` may say it is of (`worker`, `dp_rank`)."""
        why = check_key(key, worker, dp_rank)
        if why is None:
            return True
        self.refuse(why, f"{what} {key}", worker, dp_rank)
        return False

    def refuse(self, why: Refusal, source: str, worker: str | None, dp_rank: int | None, **detail: object) -> None:
        """Counted every time, logged once per (source, reason); `worker` and
        `dp_rank`: what the payload says, None for a copy (never decoded)."""
        self.refused[why] += 1
        mark = (source, why)
        if mark in self._logged or len(self._logged) >= MAX_LOGGED_SOURCES:
            return
        self._logged.add(mark)
        if worker is not None:
            detail = {**detail, "says_worker": str(worker)[:200], "says_dp_rank": dp_rank}
        log.warning("message_refused", reason=why.value, source=source[:300],
                    note="identity comes from the subject or key; logged once per source", **detail)

    @property
    def total(self) -> int:
        return sum(self.refused.values())
