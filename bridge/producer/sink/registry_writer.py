"""The bridge's side of the worker registry: it writes its worker's entry
(bridge.contract.registry) into the JetStream key-value bucket and keeps it
fresh with heartbeats.

The bucket is created on first use with `history=1` and a `ttl`, so entries
nobody refreshes vanish after it, and without rollups or message deletes
(bridge.producer.sink.kv_bucket).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import msgspec
import nats.js
import structlog
from nats.js.kv import KeyValue

from bridge.contract import WorkerEntry, encode_entry, registry_key
from bridge.producer.sink.kv_bucket import open_bucket

log = structlog.get_logger("bridge.registry")


def ttl_for(heartbeat_interval: float) -> float:
    """A bucket TTL for an interval: long enough that `watch` shows a dead worker
    as dead for a while before its entry vanishes."""
    return max(60.0, 12 * heartbeat_interval)


class WorkerRegistry:
    """The bridge's writer. Opening the bucket is lazy, so it can be built before
    NATS answers; every failure is logged and retried at the next beat."""

    def __init__(self, js: nats.js.JetStreamContext, bucket: str, ttl: float) -> None:
        self._js = js
        self.bucket = bucket
        self.ttl = ttl
        self._kv: KeyValue | None = None
        # Serialises puts, so a beat in flight cannot land after `stopped`.
        self._lock = anyio.Lock()
        self._stopped = False

    def rebind(self, js: nats.js.JetStreamContext) -> None:
        """JetStream on a new NATS connection (the old one was closed): the next beat opens the bucket there."""
        self._js = js
        self._kv = None

    async def open(self) -> KeyValue:
        if self._kv is None:
            self._kv = await open_bucket(self._js, self.bucket, history=1, ttl=self.ttl, replicas=1,
                                         description="kv-bridge worker registry")
        return self._kv

    async def put(self, entry: WorkerEntry) -> int:
        """Writes the entry with `heartbeat_ts` set to now; returns the revision."""
        kv = await self.open()
        fresh = msgspec.structs.replace(entry, heartbeat_ts=time.time())
        return await kv.put(registry_key(entry.worker), encode_entry(fresh))

    async def heartbeat(self, snapshot: Callable[[], WorkerEntry], interval: float) -> None:
        """Puts `snapshot()` every `interval` seconds until cancelled or `stopped`."""
        while True:
            async with self._lock:
                if self._stopped:
                    return
                try:
                    await self.put(snapshot())
                except Exception as exc:  # NATS away or JetStream busy: the next beat tries again
                    log.warning("registry_put_failed", bucket=self.bucket, error=type(exc).__name__,
                                detail=str(exc)[:200])
                    self._kv = None
            await anyio.sleep(interval)

    async def stopped(self, entry: WorkerEntry) -> None:
        """The last word on exit: readers show `stopped`, not `dead`. Ends the heartbeat."""
        async with self._lock:
            self._stopped = True
            await self.put(msgspec.structs.replace(entry, state="stopped"))
