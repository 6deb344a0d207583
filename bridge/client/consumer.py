"""Reading a stream, in order, through a consumer of one's own name.

A reader may create consumers only under the names its permissions list,
`kvr-<user>-<n>` (`consumer_names`, docs/security.md): JetStream checks the
name in the API subject against the request's, so no reader can name, and
so change, a consumer of someone else's. nats-py's ordered consumer cannot
be named: it asks for an ephemeral one (the server names it), and its reset
re-creates the consumer under the same name with another start, which
JetStream refuses as an update. The order is kept here instead: a pull
consumer without acks, its delivery sequence checked message by message,
re-created after the last stream sequence seen when a message is missing or
the consumer is lost. Each is made with `action: create`, so a name in use
(another process of the same user) is skipped, never taken over.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Final

import anyio
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import api

from bridge.client.log import get_logger
from bridge.runtime.access import DEFAULT_INBOX_PREFIX

log = get_logger("bridge.client.consumer")

CONSUMER_PREFIX: Final = "kvr"
# Names a user may use on each stream: as many of its clients read one stream at once.
CONSUMERS_PER_USER: Final = 4
_NAME_IN_USE: Final = 10148  # JetStream: a create (action "create") of a name that exists
_BATCH: Final = 256
_POLL_S: Final = 2.0
_INACTIVE_S: Final = 30.0
_RETRY_S: Final = 1.0


class ConsumerNamesInUse(RuntimeError):
    """Every consumer name this client may use on the stream is taken."""


def consumer_user(inbox_prefix: str) -> str | None:
    """The user an inbox prefix names (`_INBOX.<user>`), None for the shared `_INBOX`."""
    root, _, rest = inbox_prefix.partition(".")
    if root != DEFAULT_INBOX_PREFIX or not rest:
        return None
    return rest.split(".")[0]


def consumer_name(user: str, n: int) -> str:
    return f"{CONSUMER_PREFIX}-{user}-{n}"


def _inbox_parts(nc: NatsClient) -> tuple[str, str]:
    """The client's inbox prefix and a token unique to this call, both read
    from a new inbox (`<prefix>.<nuid>`): nats-py's public API has no other
    way to either."""
    prefix, _, token = nc.new_inbox().rpartition(".")
    return prefix, token


def consumer_names(nc: NatsClient) -> list[str]:
    """The names a client may create consumers under: its user's pool when
    its inbox prefix names the user, else one of its own (a client without
    permissions)."""
    prefix, token = _inbox_parts(nc)
    user = consumer_user(prefix)
    if user is None:
        return [f"{CONSUMER_PREFIX}-{token}"]
    return [consumer_name(user, n) for n in range(CONSUMERS_PER_USER)]


class OwnConsumer:
    """The messages of `stream` that `config` selects (its filter subject and
    deliver policy), in stream order, each once, through a consumer of one of
    `consumer_names`."""

    def __init__(self, nc: NatsClient, stream: str, config: api.ConsumerConfig) -> None:
        self._nc = nc
        self.stream = stream
        self._config = config
        self.name: str | None = None
        self._psub: Any = None
        self._last_stream: int | None = None
        self._last_delivered = 0
        self.recreated = 0
        self._id = f"kv-bridge reader {_inbox_parts(nc)[1]}"

    async def start(self) -> None:
        """Raises ConsumerNamesInUse, or nats' errors when JetStream refuses."""
        await self._create(self._config)

    async def _create(self, config: api.ConsumerConfig) -> None:
        for name in consumer_names(self._nc):
            # The description is this client's own: JetStream takes a create
            # with a configuration equal to the existing one's as that one.
            cfg = config.evolve(name=name, durable_name=None, deliver_subject=None, ack_policy=api.AckPolicy.NONE,
                                inactive_threshold=_INACTIVE_S, mem_storage=True, num_replicas=1,
                                description=self._id)
            subject = f"$JS.API.CONSUMER.CREATE.{self.stream}.{name}"
            if cfg.filter_subject and cfg.filter_subject != ">":
                subject += f".{cfg.filter_subject}"
            body = {"stream_name": self.stream, "config": cfg.as_dict(), "action": "create"}
            answer = json.loads((await self._nc.request(subject, json.dumps(body).encode(), timeout=5.0)).data)
            error = answer.get("error")
            if error and error.get("err_code") == _NAME_IN_USE:
                continue
            if error:
                nats.js.errors.APIError.from_error(error)
            self.name = name
            self._psub = await self._nc.jetstream().pull_subscribe_bind(consumer=name, stream=self.stream)
            self._last_delivered = 0
            return
        raise ConsumerNamesInUse(f"every consumer name of this user on {self.stream} is in use "
                                 f"({CONSUMERS_PER_USER} per user and stream): stop a client or give it a user")

    async def _recreate(self) -> None:
        """After a lost message or consumer: a new one from the next stream sequence."""
        await self._drop()
        self.recreated += 1
        config = self._config
        if self._last_stream is not None:
            config = config.evolve(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
                                   opt_start_seq=self._last_stream + 1, opt_start_time=None)
        while True:
            try:
                await self._create(config)
                return
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError, ConsumerNamesInUse) as exc:
                log.warning("consumer_recreate_failed", stream=self.stream, error=type(exc).__name__,
                            detail=str(exc)[:200])
                await anyio.sleep(_RETRY_S)

    async def messages(self) -> AsyncIterator[Msg]:
        while True:
            try:
                msgs = await self._psub.fetch(_BATCH, timeout=_POLL_S)
            except TimeoutError:  # nothing new (nats-py also waits out a 409 this way)
                continue
            except (nats.errors.Error, nats.js.errors.Error) as exc:
                log.info("consumer_lost", stream=self.stream, consumer=self.name, error=type(exc).__name__)
                await anyio.sleep(_RETRY_S if self._nc.is_reconnecting else 0)
                await self._recreate()
                continue
            for msg in msgs:
                seqs = msg.metadata.sequence
                if seqs.consumer != self._last_delivered + 1:
                    await self._recreate()
                    break
                self._last_delivered = seqs.consumer
                self._last_stream = seqs.stream
                yield msg

    async def _drop(self) -> None:
        psub, name, self._psub = self._psub, self.name, None
        try:
            if psub is not None:
                await psub.unsubscribe()
            if name is not None:
                await self._nc.jetstream().delete_consumer(self.stream, name)
        except Exception as exc:  # it goes by itself after its inactive threshold
            log.debug("consumer_delete_failed", stream=self.stream, consumer=name, error=type(exc).__name__)

    async def stop(self) -> None:
        await self._drop()
