"""Reading the worker registry: who is out there, and who is still alive.

Follows the bridge-written JetStream KV bucket (entries: `bridge.contract.registry`) with a
watch of its own (a consumer of the reader's own name, bridge.client.consumer:
last value per key, then every update), so a new heartbeat shows up at once. A bucket that does not exist yet (no bridge
with JetStream started so far) is looked for again every few seconds.

A key's value is taken only from its worker: what the server stores on a key
because someone named it as a request's reply subject is refused. A copy of a
stored message carries the server's headers (`reply_copy`) and is refused
whatever it says, a delete marker included; an API answer carries none and
does not decode as an entry. Either way the key keeps its last good entry
(counted in `bad_entries` or `identity.refused`, logged once per key).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js import api
from nats.js.kv import KeyValue

from bridge.client.consumer import ConsumerNamesInUse, OwnConsumer
from bridge.client.identity import IdentityGuard
from bridge.client.log import get_logger
from bridge.contract import DEFAULT_BUCKET, DEFAULT_DEAD_AFTER, Liveness, WorkerEntry, decode_entry, liveness
from bridge.contract.registry import KV_GONE, KV_OPERATION
from bridge.residency.index import ResidencyIndex

log = get_logger("bridge.client.registry")

_RETRY_SECONDS = 2.0
# nats-server's own markers (max age, TTL) name their reason instead.
_MARKER_REASON = "Nats-Marker-Reason"
_MARKER_DELETES = ("MaxAge", "Purge", "Remove")


def declare_entry(index: ResidencyIndex, entry: WorkerEntry) -> None:
    """Tell the index every group of every rank the registry knows of."""
    for rank in entry.ranks:
        for g in entry.groups:
            index.declare(entry.worker, rank.dp_rank, g.group, g.kind, g.block_size, g.sliding_window)


class RegistryFollower:
    """Entries by worker id, kept current from the bucket."""

    def __init__(self, nc: NatsClient, bucket: str = DEFAULT_BUCKET, dead_after: float = DEFAULT_DEAD_AFTER,
                 on_entry: Callable[[WorkerEntry], None] | None = None) -> None:
        self._nc = nc
        self.bucket = bucket
        self.dead_after = dead_after
        self._on_entry = on_entry
        self.entries: dict[str, WorkerEntry] = {}
        self._by_key: dict[str, str] = {}
        self.available = False
        self.bad_entries = 0
        self._bad_logged: set[str] = set()
        # Entries whose `worker` is not the one their key names: refused
        # (a worker may write only its own key), counted per reason.
        self.identity = IdentityGuard()
        # Set once the bucket's current contents have been read.
        self.loaded = anyio.Event()

    def status(self, worker: str, now: float | None = None) -> Liveness | None:
        """alive / dead / stopped, or None when the registry has no entry."""
        entry = self.entries.get(worker)
        return None if entry is None else liveness(entry, now, self.dead_after)

    def dead(self, now: float | None = None) -> set[str]:
        """Workers to leave out of routing: dead or stopped."""
        now = time.time() if now is None else now
        return {w for w, e in self.entries.items() if liveness(e, now, self.dead_after) != "alive"}

    async def run(self) -> None:
        """Follows the bucket until cancelled."""
        while True:
            kv = await self._bucket()
            if kv is None:
                await anyio.sleep(_RETRY_SECONDS)
                continue
            try:
                await self._follow(kv)
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError, ConsumerNamesInUse):
                # The watch broke (server restart, bucket deleted): start over.
                self.available = False
                await anyio.sleep(_RETRY_SECONDS)

    async def _bucket(self) -> KeyValue | None:
        try:
            kv = await self._nc.jetstream().key_value(self.bucket)
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.ServiceUnavailableError,
                nats.errors.NoRespondersError, nats.errors.TimeoutError, nats.js.errors.APIError):
            # No bucket yet, or no JetStream on this server: liveness stays unknown.
            self.loaded.set()
            return None
        self.available = True
        return kv

    async def _follow(self, kv: KeyValue) -> None:
        """nats-py's `KeyValue.watch` hands out no headers, which is what
        tells a reply-subject copy, and its consumer cannot be named: the
        same watch, through a consumer of this reader's own name."""
        prefix = f"$KV.{self.bucket}."
        # The bucket's size, not the consumer's info: a reader may not ask
        # for a consumer's info (docs/security.md).
        empty = (await kv.status()).values == 0
        consumer = OwnConsumer(self._nc, f"KV_{self.bucket}", api.ConsumerConfig(
            filter_subject=f"{prefix}>", deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT))
        await consumer.start()
        try:
            if empty:
                self.loaded.set()
            async for msg in consumer.messages():
                headers = msg.headers or {}
                key = msg.subject[len(prefix):]
                if self.identity.delivered(msg.subject, headers):
                    op = headers.get(KV_OPERATION)
                    if op is None and headers.get(_MARKER_REASON) in _MARKER_DELETES:
                        op = "DEL"
                    self._apply(key, msg.data, op)
                if msg.metadata.num_pending == 0:
                    self.loaded.set()
        finally:
            await consumer.stop()

    def _apply(self, key: str, value: bytes | None, operation: str | None) -> None:
        if operation in KV_GONE:
            worker = self._by_key.pop(key, None)
            if worker is not None:
                self.entries.pop(worker, None)
            return
        try:
            entry = decode_entry(value or b"")
        except (msgspec.DecodeError, msgspec.ValidationError):
            # Not an entry (a JetStream API answer stored on the key by a
            # request that named it as its reply subject): the key keeps its
            # last good entry until its worker's next heartbeat replaces it.
            self.bad_entries += 1
            if key not in self._bad_logged and len(self._bad_logged) < 1024:
                self._bad_logged.add(key)
                log.warning("registry_entry_unreadable", key=key[:300], kept=key in self._by_key,
                            note="the key keeps its last good entry; logged once per key")
            return
        if not self.identity.keyed(key, entry.worker, 0, "registry entry"):
            return
        self._by_key[key] = entry.worker
        self.entries[entry.worker] = entry
        if self._on_entry is not None:
            self._on_entry(entry)
