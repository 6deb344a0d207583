"""NATS micro services that answer on inbox reply subjects only.

A responder answers on whatever reply subject the requester names, and a
user with `allow_responses` (the bridge's snapshot service) may publish
there past its permission lists: a request whose reply subject is a
stream's (`kv.b.0`) or a bucket key's would have the answer stored there.
Every client's inbox prefix starts with `_INBOX.`
(bridge.runtime.access), so the bridge's snapshot service and observe's
service answer requests and discovery (`$SRV.PING`, `INFO`, `STATS`) on
such reply subjects only.

This reads nats-py's internals, for the release `bridge.runtime.nats_py`
pins. `Request` keeps its message private (`_msg`): `reply_of` is the one
place that reads it; where it cannot, a request has no reply subject and gets
no answer. Discovery is answered by private handlers, which
`InboxOnlyService` overrides; it starts only where they are the ones nats-py
calls (`discovery_problem`), since on another release an override that is no
longer called would answer on any reply subject. Where they are not, its
`start` refuses (`UnguardedDiscovery`) and the bridge runs on without the
service, saying why.
"""

from __future__ import annotations

import inspect
from typing import Final

import nats.micro.service
from nats.aio.msg import Msg
from nats.micro.request import Request

from bridge.runtime.access import DEFAULT_INBOX_PREFIX
from bridge.runtime.nats_py import PINNED_NATS_PY, installed_nats_py

INBOX_ROOT: Final = DEFAULT_INBOX_PREFIX + "."
# nats-py's discovery handlers, as Service.start names them for $SRV.PING, INFO and STATS.
DISCOVERY_HANDLERS: Final = ("_handle_ping_request", "_handle_info_request", "_handle_stats_request")


class UnguardedDiscovery(RuntimeError):
    """This nats-py's service would answer discovery on any reply subject."""


def discovery_problem(installed: str | None = None,
                      service_type: type[nats.micro.service.Service] = nats.micro.service.Service) -> str | None:
    """Why `InboxOnlyService` cannot guard discovery on this nats-py (None: it can)."""
    version = installed_nats_py() if installed is None else installed
    if version != PINNED_NATS_PY:
        return f"nats-py {version} is installed; inbox-only discovery is written against {PINNED_NATS_PY} only"
    try:
        start = inspect.getsource(service_type.start)
    except (OSError, TypeError):
        return f"nats-py {version}: Service.start cannot be read"
    missing = [name for name in DISCOVERY_HANDLERS
               if not callable(getattr(service_type, name, None)) or f"self.{name}" not in start]
    if missing:
        return f"nats-py {version}: Service.start does not call {', '.join(missing)}"
    return None


def to_inbox(reply: str | None) -> bool:
    return bool(reply) and str(reply).startswith(INBOX_ROOT)


def reply_of(req: Request) -> str:
    """The reply subject of a service request ("" when it cannot be read)."""
    msg = getattr(req, "_msg", None)
    reply = getattr(msg, "reply", "")
    return reply if isinstance(reply, str) else ""


class InboxOnlyService(nats.micro.service.Service):
    """nats-py's service, whose discovery answers on inbox reply subjects only."""

    async def start(self) -> None:
        """Raises `UnguardedDiscovery` where the overrides below would not be called."""
        problem = discovery_problem()
        if problem is not None:
            raise UnguardedDiscovery(problem)
        await super().start()

    async def _handle_ping_request(self, msg: Msg) -> None:
        if to_inbox(msg.reply):
            await super()._handle_ping_request(msg)

    async def _handle_info_request(self, msg: Msg) -> None:
        if to_inbox(msg.reply):
            await super()._handle_info_request(msg)

    async def _handle_stats_request(self, msg: Msg) -> None:
        if to_inbox(msg.reply):
            await super()._handle_stats_request(msg)
