"""Who a message speaks for: the place it arrived at, never what it says.

A worker's credentials may publish only its own subjects and write only its
own keys (docs/security.md), so the subject token (a registry entry's or
bucket snapshot's key, a snapshot service's subject) is the one thing about a
message its sender cannot choose. Every consumer derives the worker and rank
from there and refuses a message whose payload names another (`Refusal`).

Tokens must be canonical: `kv.a~41.0` unescapes to worker "aA", whose own
subjects are `kv.aA.*`; a publisher allowed `kv.a~41.>` must not speak for it.

One write reaches a subject past every permission: JetStream answers a
request on whatever reply subject the requester names, as the server, and a
stream (or bucket) listening there stores the answer. A direct get's answer
is a stored message with the headers the server adds to every message it
returns (`STORED_HEADERS`), which no bridge sends, so a message delivered on
the contract's subjects or from a bucket that carries one is such a copy
(`reply_copy`), refused whatever it says. A direct get's own answer carries
them legitimately: the rule is for what a subscription or a consumer
delivers, never for the answer to one's own read.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final, NamedTuple

from bridge.contract.subjects import WORKER_TOKEN, parse_worker_token, worker_token


class Refusal(enum.Enum):
    """Why a message was refused (a counter label each)."""

    BAD_SUBJECT = "bad_subject"  # not `<prefix>.<canonical worker token>.<group | worker>`, or a key like it
    WORKER = "worker_mismatch"  # the payload names another worker
    RANK = "rank_mismatch"  # another data-parallel rank
    GROUP = "group_mismatch"  # another group than the subject's
    PLACE = "wrong_subject"  # a record on a group subject, or a group message on the record subject
    REPLY_COPY = "reply_copy"  # the server's answer to someone's read, stored where its reply subject named


# What nats-server puts on a stored message it hands back (direct gets,
# republish): a publisher never sets them.
STORED_HEADERS: Final = frozenset(
    {"Nats-Stream", "Nats-Subject", "Nats-Sequence", "Nats-Time-Stamp", "Nats-Last-Sequence"})


def reply_copy(headers: Mapping[str, str] | None) -> bool:
    """Whether a message delivered by a subscription or a consumer is a
    stored message the server handed back onto a reply subject (a copy, not
    what the publisher of that subject sent)."""
    return bool(headers) and not STORED_HEADERS.isdisjoint(headers)  # type: ignore[arg-type]


class Origin(NamedTuple):
    """What the place a message arrived at says: worker, rank, and the group
    (None: the worker's record subject)."""

    worker: str
    dp_rank: int
    group: int | None


def parse_token(token: str) -> tuple[str, int] | None:
    """(worker, rank) of a canonical worker token; None for anything else."""
    try:
        worker, rank = parse_worker_token(token)
    except (ValueError, IndexError):
        return None
    if not worker or worker_token(worker, rank) != token:
        return None
    return worker, rank


def subject_origin(subject: str) -> Origin | None:
    """`<prefix>.<worker token>.<group | worker>` read from the right (the
    prefix may span tokens); None when the subject is not of that form."""
    head, _, last = subject.rpartition(".")
    _, _, token = head.rpartition(".")
    if not token or not last:
        return None
    ident = parse_token(token)
    if ident is None:
        return None
    if last == WORKER_TOKEN:
        return Origin(ident[0], ident[1], None)
    if not (last.isascii() and last.isdigit()) or str(int(last)) != last:
        return None
    return Origin(ident[0], ident[1], int(last))


def key_origin(key: str) -> tuple[str, int] | None:
    """(worker, rank) of a registry entry's or snapshot head's key: the
    subject token with `~` written `=` (bridge.contract.registry)."""
    if "~" in key:
        return None
    return parse_token(key.replace("=", "~"))


def check(origin: Origin | None, worker: str, dp_rank: int, group: int | None) -> Refusal | None:
    """Whether a payload saying (`worker`, `dp_rank`, `group`; group None for
    a worker record) may be taken as coming from `origin`."""
    if origin is None:
        return Refusal.BAD_SUBJECT
    if (origin.group is None) != (group is None):
        return Refusal.PLACE
    if worker != origin.worker:
        return Refusal.WORKER
    if dp_rank != origin.dp_rank:
        return Refusal.RANK
    if group != origin.group:
        return Refusal.GROUP
    return None


def check_key(key: str, worker: str, dp_rank: int) -> Refusal | None:
    """Whether an entry or snapshot stored under `key` may say it is of (`worker`, `dp_rank`)."""
    ident = key_origin(key)
    if ident is None:
        return Refusal.BAD_SUBJECT
    if worker != ident[0]:
        return Refusal.WORKER
    if dp_rank != ident[1]:
        return Refusal.RANK
    return None
