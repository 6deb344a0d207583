"""The snapshot service: a NATS `micro` service (`kv-bridge-snapshot`, found
with `$SRV.PING`) with one endpoint per rank, at `snapshot_subject(prefix,
worker, rank)`, answering `SnapshotRequest`s with `SnapshotPart`s
(bridge.contract.snapshot). Part 0 applies everything logged first, so the
snapshot is as of the last message the bus has; later parts come from the
encoded snapshot kept for a while by its id."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import msgspec
import nats.micro
import nats.micro.service
import structlog
from nats.aio.client import Client as NatsClient
from nats.micro.request import Request
from nats.micro.service import ServiceConfig

from bridge import __version__
from bridge.contract.snapshot import (
    PART_OVERHEAD,
    SNAPSHOT_SERVICE,
    SnapshotPart,
    decode_request,
    encode_part,
    snapshot_subject,
    split,
)
from bridge.producer.snapshot.keeper import ResidencyKeeper
from bridge.producer.telemetry.metrics import Metrics
from bridge.runtime.inbox_service import InboxOnlyService, reply_of, to_inbox

log = structlog.get_logger("bridge.producer.snapshot")

# Encoded snapshots kept for their later parts: how many, and for how long.
_KEPT = 4
_KEEP_S = 60.0
# A request is `{"id": "<epoch>-<ms>-<n>", "part": n}`: far below this.
MAX_REQUEST_BYTES = 512
# Error descriptions travel in a header: at most this long, printable ASCII.
_MAX_DESCRIPTION = 200


def _printable(text: str) -> str:
    return "".join(c if " " <= c <= "~" else "?" for c in text[:_MAX_DESCRIPTION])


class SnapshotService:
    def __init__(self, keeper: ResidencyKeeper, prefix: str, ranks: list[int], metrics: Metrics,
                 max_payload: Callable[[], int]) -> None:
        self._keeper = keeper
        self._prefix = prefix
        self._ranks = ranks
        self._metrics = metrics
        self._max_payload = max_payload
        self._kept: OrderedDict[str, tuple[float, list[SnapshotPart]]] = OrderedDict()
        self._next_id = 0
        # rank → (what was applied when it was taken, snapshot id): the last one taken.
        self._last: dict[int, tuple[tuple[int, int], str]] = {}
        self.service: nats.micro.service.Service | None = None

    async def start(self, nc: NatsClient) -> None:
        worker = self._keeper.worker
        version = __version__ if __version__[0].isdigit() and "+" not in __version__ else "0.0.0"
        self.service = InboxOnlyService(nc, ServiceConfig(
            name=SNAPSHOT_SERVICE, version=version,
            description="kv-bridge: one worker's residency snapshots, per data-parallel rank",
            metadata={"worker": worker, "prefix": self._prefix, "ranks": ",".join(map(str, self._ranks))},
        ))
        await self.service.start()
        for rank in self._ranks:
            await self.service.add_endpoint(
                name=f"rank{rank}", subject=snapshot_subject(self._prefix, worker, rank),
                handler=self._handler(rank), metadata={"worker": worker, "dp_rank": str(rank)},
            )
        log.info("snapshot_service_started", subjects=[snapshot_subject(self._prefix, worker, r) for r in self._ranks])

    async def stop(self) -> None:
        if self.service is not None:
            service, self.service = self.service, None
            try:
                await service.stop()
            except Exception as exc:  # the connection may be gone already; nothing to undo
                log.debug("snapshot_service_stop_failed", error=type(exc).__name__)

    def _handler(self, rank: int) -> Callable[[Request], Awaitable[None]]:
        async def handle(req: Request) -> None:
            await self.answer(rank, req)
        return handle

    async def answer(self, rank: int, req: Request) -> None:
        """One request, answered once: a part, or an error whose text is the
        service's own (nothing of the request is echoed but a checked id),
        and never more than the server's max_payload. A reply subject that
        is no inbox gets nothing: with `allow_responses` the answer could
        otherwise be written anywhere, a stream's subjects included."""
        if not to_inbox(reply_of(req)):
            self._metrics.snapshot_requests.labels("bad_request").inc()
            return
        if len(req.data) > MAX_REQUEST_BYTES:
            self._metrics.snapshot_requests.labels("bad_request").inc()
            await self._error(req, "400", f"snapshot request over {MAX_REQUEST_BYTES} bytes")
            return
        try:
            ask = decode_request(req.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._metrics.snapshot_requests.labels("bad_request").inc()
            await self._error(req, "400", f"bad snapshot request: {_printable(str(exc))}")
            return
        if ask.id:
            kept = self._kept.get(ask.id)
            if kept is None or not 0 <= ask.part < len(kept[1]) or kept[1][0].dp_rank != rank:
                self._metrics.snapshot_requests.labels("expired").inc()
                await self._error(req, "404", f"snapshot {ask.id} part {ask.part} is not kept: ask for a new one")
                return
            self._metrics.snapshot_requests.labels("part").inc()
            await self._respond(req, encode_part(kept[1][ask.part]))
            return
        parts = await self.take(rank)
        if parts is None:
            self._metrics.snapshot_requests.labels("unknown_rank").inc()
            await self._error(req, "404", f"no residency known for rank {rank} yet")
            return
        self._metrics.snapshot_requests.labels("taken").inc()
        await self._respond(req, encode_part(parts[0]))

    async def _respond(self, req: Request, data: bytes) -> None:
        if len(data) + PART_OVERHEAD // 2 > self._max_payload():
            # Cannot happen for parts split to max_payload; a server whose
            # max_payload shrank since would close the connection for it.
            self._metrics.snapshot_requests.labels("too_large").inc()
            await self._error(req, "500", "snapshot part over the server's max_payload: ask for a new one")
            return
        await req.respond(data)

    @staticmethod
    async def _error(req: Request, code: str, description: str) -> None:
        # Header values: one short line, whatever the text holds.
        await req.respond_error(code, _printable(description))

    async def take(self, rank: int) -> list[SnapshotPart] | None:
        """A new snapshot of the rank, as the parts its answers carry. When
        nothing was applied to the rank since the last one taken, that one is
        answered again: asking often costs one catch-up, not one encoding
        of the whole rank each time."""
        keeper = self._keeper
        began = time.perf_counter()
        # Everything logged so far, in slices: ZMQ and the sink keep going meanwhile.
        await keeper.catch_up_all()
        position = (keeper.applied.get(rank, 0), keeper.sheds)
        last = self._last.get(rank)
        if last is not None and last[0] == position and last[1] in self._kept:
            # kept anew from now: its later parts are asked for after this answer
            parts = self._kept.pop(last[1])[1]
            self._keep(last[1], parts)
            return parts
        taken = await keeper.export(rank)
        if taken is None:
            return None
        snap, data = taken
        self._next_id += 1
        snap_id = f"{snap.epoch}-{int(snap.taken_at * 1000)}-{self._next_id}"
        parts = split(snap, data, snap_id, max(1024, self._max_payload() - PART_OVERHEAD))
        self._keep(snap_id, parts)
        self._last[rank] = (position, snap_id)
        self._metrics.snapshot_bytes.set(len(data))
        self._metrics.snapshot_seconds.inc(time.perf_counter() - began)
        return parts

    def _keep(self, snap_id: str, parts: list[SnapshotPart]) -> None:
        now = time.monotonic()
        kept = self._kept
        kept[snap_id] = (now, parts)
        while len(kept) > _KEPT or (kept and now - next(iter(kept.values()))[0] > _KEEP_S):
            kept.popitem(last=False)
