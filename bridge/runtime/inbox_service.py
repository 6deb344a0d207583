"""NATS micro services that answer on inbox reply subjects only.

A responder answers on whatever reply subject the requester names, and a
user with `allow_responses` (the bridge's snapshot service) may publish
there past its permission lists: a request whose reply subject is a
stream's (`kv.b.0`) or a bucket key's would have the answer stored there.
Every client's inbox prefix starts with `_INBOX.`
(bridge.runtime.access), so the bridge's snapshot service and observe's
service answer requests and discovery (`$SRV.PING`, `INFO`, `STATS`) on
such reply subjects only.

nats-py's `Request` keeps its message private (`_msg`): `reply_of` is the
one place that reads it (nats-py pinned in requirements/ci.txt); without it
a request has no reply subject and gets no answer.
"""

from __future__ import annotations

from typing import Final

import nats.micro.service
from nats.aio.msg import Msg
from nats.micro.request import Request

from bridge.runtime.access import DEFAULT_INBOX_PREFIX

INBOX_ROOT: Final = DEFAULT_INBOX_PREFIX + "."


def to_inbox(reply: str | None) -> bool:
    return bool(reply) and str(reply).startswith(INBOX_ROOT)


def reply_of(req: Request) -> str:
    """The reply subject of a service request ("" when it cannot be read)."""
    msg = getattr(req, "_msg", None)
    reply = getattr(msg, "reply", "")
    return reply if isinstance(reply, str) else ""


class InboxOnlyService(nats.micro.service.Service):
    """nats-py's service, whose discovery answers on inbox reply subjects only."""

    async def _handle_ping_request(self, msg: Msg) -> None:
        if to_inbox(msg.reply):
            await super()._handle_ping_request(msg)

    async def _handle_info_request(self, msg: Msg) -> None:
        if to_inbox(msg.reply):
            await super()._handle_info_request(msg)

    async def _handle_stats_request(self, msg: Msg) -> None:
        if to_inbox(msg.reply):
            await super()._handle_stats_request(msg)
