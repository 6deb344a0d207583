"""The observe service's run loop: the bus into the index, the registry, the
HTTP server, and the prefix query as a NATS micro service."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import nats.js.errors
import nats.micro
import structlog
from nats.micro.request import Request
from nats.micro.service import ServiceConfig

from bridge import __version__
from bridge.apps.fleet import indexer
from bridge.apps.fleet.http import Response, serve_http
from bridge.apps.fleet.metrics import HybridCache, make_registry, render
from bridge.apps.fleet.options import ObserveOptions
from bridge.apps.fleet.query import QueryError, decode_query, int_form, query_chain, usable_algos
from bridge.apps.fleet.scope import ModelMissing
from bridge.apps.fleet.state import ObserveState, hybrid_effect, hybrid_steps
from bridge.client.bootstrap import BootstrapOptions
from bridge.client.connection import BusConnection
from bridge.client.registry import RegistryFollower, declare_entry
from bridge.client.subscribe import BusMessage, BusSubscriber
from bridge.contract import BlockHash, WorkerRecord
from bridge.contract.snapshot import RankSnapshot
from bridge.contract.subjects import parse_worker_token
from bridge.residency.views import WorkerKey
from bridge.runtime.access import NatsAccess
from bridge.runtime.inbox_service import InboxOnlyService, UnguardedDiscovery, reply_of, to_inbox
from bridge.runtime.stopping import close_quietly

log = structlog.get_logger("bridge.apps.fleet")

SERVICE_NAME = "kv-observe"
_JSON = "application/json"
_OPEN_POLL_S = 0.01  # how often run() looks whether the bootstrap is applied
LIVE_WITHIN_S = 10.0  # /healthz fails when the ticker has not run for this long
_INDEXER_QUERIES = ("/query", "/query_by_hash")
_ANSWERED_WHEN_READY = ("/v1/prefix", "/v1/workers", *_INDEXER_QUERIES)
# The indexer API's registration: this indexer is fed by the bus, where each
# engine's bridge registers its worker; no request here can change that.
_REGISTRATION = ("/register", "/unregister")
REGISTRATION_ON_NATS = ("not implemented: this indexer is fed by NATS, where each engine's bridge "
                        "(kv-bridge run) registers its worker; run one beside the engine instead")


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def _error(status: int, why: str) -> Response:
    return status, _JSON, _json({"error": why})


def _query_error(exc: QueryError) -> Response:
    """A 400; one refused for want of a model lists the fleet's models."""
    body: dict[str, Any] = {"error": str(exc)}
    if isinstance(exc, ModelMissing):
        body["models"] = exc.models
    return 400, _JSON, _json(body)


async def _checkpoint() -> None:
    await anyio.lowlevel.checkpoint()


class ObserveService:
    def __init__(self, opts: ObserveOptions) -> None:
        self.opts = opts
        self.state = ObserveState()
        self.hybrid = HybridCache()
        self.registry = make_registry(self.state, self.hybrid, opts.max_worker_series)
        self.http_port: int | None = None
        self.ready = anyio.Event()  # listening, connected, subscribed and bootstrapped
        self._tick = time.monotonic()
        self.micro: nats.micro.service.Service | None = None
        self.algos = usable_algos()
        # Prefix queries decoded and hashed at once; the rest wait their turn.
        self._queries = anyio.CapacityLimiter(opts.query_concurrency)
        self._sub: BusSubscriber | None = None
        self._fed = False  # the subscription ended

    # -- answers -----------------------------------------------------------

    async def answer_indexer(self, body: bytes, by_hash: bool) -> Response:
        """An indexer API query's reply (`/query`, `/query_by_hash`); never
        raises, like answer_prefix."""
        try:
            async with self._queries:
                t0 = time.perf_counter()
                if by_hash:
                    iq, tokens = await indexer.decode_by_hash(body, _checkpoint), None
                else:
                    iq, tokens = await indexer.decode_by_tokens(body, _checkpoint)
                chain = await self._lookup_form(await query_chain(iq.prefix, _checkpoint, self.algos, tokens))
                answer = indexer.answer(self.state, iq, chain, "http", spent=time.perf_counter() - t0)
            return 200, _JSON, _json(answer)
        except QueryError as exc:
            self.state.queries[("http", "error")] += 1
            return _query_error(exc)
        except Exception:  # one bad query must not take the service down
            log.exception("indexer_query_failed", by_hash=by_hash)
            self.state.queries[("http", "error")] += 1
            return _error(500, "internal error")

    async def _lookup_form(self, chain: list[BlockHash]) -> list[BlockHash]:
        """The chain in the form the index matches fastest."""
        ints = await int_form(chain, _checkpoint)
        if ints is not None and not self.state.index.fleet.holds_digests:
            return ints  # the same answer, without matching both forms block by block
        return chain

    async def answer_prefix(self, body: bytes, transport: str) -> Response:
        """A prefix query's reply; never raises (an unexpected failure is a 500
        with a JSON body, logged)."""
        try:
            async with self._queries:
                t0 = time.perf_counter()
                q, tokens = await decode_query(body, _checkpoint)
                chain = await self._lookup_form(await query_chain(q, _checkpoint, self.algos, tokens))
                # The lookup runs in one go, on a view no message changes meanwhile.
                answer = self.state.prefix(q, chain, transport, spent=time.perf_counter() - t0)
            return 200, _JSON, _json(answer)
        except QueryError as exc:
            self.state.queries[(transport, "error")] += 1
            return _query_error(exc)
        except Exception:  # one bad query must not take the service down
            log.exception("prefix_query_failed", transport=transport)
            self.state.queries[(transport, "error")] += 1
            return _error(500, "internal error")

    def live(self) -> bool:
        return time.monotonic() - self._tick < LIVE_WITHIN_S

    def bootstrapped(self) -> bool:
        """Every rank the subscription found is in the index, from its snapshot
        or marked missing, with what was buffered meanwhile."""
        return self._sub is not None and self._sub.opened

    def is_ready(self) -> bool:
        return self.live() and self.state.nats_connected and self.state.subscribed and self.bootstrapped()

    async def route(self, method: str, path: str, body: bytes) -> Response:
        try:
            return await self._route(method, path, body)
        except Exception:  # one bad request must not take the server down
            log.exception("http_handler_failed", path=path)
            return _error(500, "internal error")

    async def _route(self, method: str, path: str, body: bytes) -> Response:
        if path in _ANSWERED_WHEN_READY and not self.bootstrapped():
            return _error(503, "not ready: bootstrapping")
        if path in _INDEXER_QUERIES:
            if method != "POST":
                return _error(405, "POST a JSON query")
            return await self.answer_indexer(body, by_hash=path == "/query_by_hash")
        if path in _REGISTRATION:
            return _error(501, REGISTRATION_ON_NATS)
        if path == "/v1/prefix":
            if method != "POST":
                return _error(405, "POST a JSON query")
            return await self.answer_prefix(body, "http")
        if method != "GET":
            return _error(405, "GET only")
        if path == "/metrics":
            return 200, "text/plain; version=0.0.4; charset=utf-8", render(self.registry)
        if path == "/v1/workers":
            return 200, _JSON, _json(self.state.workers())
        if path == "/healthz":
            return (200, "text/plain", b"ok\n") if self.live() else _error(503, "stalled")
        if path == "/readyz":
            if self.is_ready():
                return 200, "text/plain", b"ready\n"
            return 503, _JSON, _json({"error": "not ready", "live": self.live(),
                                      "nats_connected": self.state.nats_connected,
                                      "subscribed": self.state.subscribed, "bootstrapped": self.bootstrapped()})
        return _error(404, "not found")

    # -- tasks -------------------------------------------------------------

    async def _feed(self, sub: BusSubscriber) -> None:
        try:
            await self._apply_all(sub)
        finally:
            self._fed = True

    async def _apply_all(self, sub: BusSubscriber) -> None:
        state = self.state
        index = state.index
        async for item in sub:
            kind = type(item)
            if state.expired:
                self._back_from_expiry(item)
            index.apply(item)
            if kind is BusMessage:
                state.bus_messages += 1
            elif kind is RankSnapshot:
                snap: RankSnapshot = item  # type: ignore[assignment]
                # Staleness counts from the snapshot's last batch (vLLM's clock), or its own time.
                state.snapshot_at[WorkerKey(snap.worker, snap.dp_rank)] = snap.last_ts or snap.taken_at
            state.undecodable = sub.undecodable

    def _back_from_expiry(self, item: object) -> None:
        """A rank forgotten on expiry that speaks again: with a record that
        resets it, it starts afresh; otherwise its view lacks its past and is
        partial (stale) until such a record. The rank is the subject's."""
        if type(item) is not BusMessage:
            return
        try:
            worker, rank = parse_worker_token(item.subject.rsplit(".", 2)[-2])
        except (ValueError, IndexError):
            return
        key = WorkerKey(worker, rank)
        if self.state.expired.pop(key, None) is None:
            return
        body = item.body
        resets = type(body) is WorkerRecord and body.type in ("start", "restart")
        if not resets:
            self.state.index.missing(worker, rank)

    async def _ticker(self, conn: BusConnection) -> None:
        while True:
            self._tick = time.monotonic()
            nc = conn.nc
            self.state.nats_connected = nc is not None and nc.is_connected
            now = time.time()
            for worker in self.state.expire(now, self.opts.expire_after):
                log.info("worker_expired", worker=worker, after_s=self.opts.expire_after)
            if now - self.hybrid.updated >= self.opts.hybrid_interval:
                await self.refresh_hybrid_async()
            await anyio.sleep(0.5)

    def refresh_hybrid(self) -> None:
        values = {}
        for view in self.state.index:
            values[(view.key.worker, view.key.dp_rank)] = hybrid_effect(view, self.opts.hybrid_sample)
        self.hybrid.values = values
        self.hybrid.updated = time.time()

    async def refresh_hybrid_async(self) -> None:
        """refresh_hybrid, a checkpoint after every 256 sampled blocks."""
        values = {}
        for view in self.state.index:
            steps = hybrid_steps(view, self.opts.hybrid_sample)
            while self.state.index.views.get(view.key) is view:  # not forgotten meanwhile
                try:
                    next(steps)
                except StopIteration as done:
                    values[(view.key.worker, view.key.dp_rank)] = done.value
                    break
                await anyio.lowlevel.checkpoint()
            await anyio.lowlevel.checkpoint()
        self.hybrid.values = values
        self.hybrid.updated = time.time()

    async def _serve_nats(self, nc: Any) -> None:
        async def send(req: Request, status: int, out: bytes) -> None:
            # Not on a reply subject that is no inbox (bridge.runtime.inbox_service).
            reply = reply_of(req)
            if not to_inbox(reply):
                self.state.requests_refused += 1
                if self.state.requests_refused == 1:
                    log.warning("request_refused", subject=req.subject[:300], reply=reply[:300],
                                note="answers go to inbox reply subjects only; logged once")
                return
            # An answer over the server's max_payload would make the server
            # close this connection: an error that fits goes instead. Error
            # texts travel in a header too: one short printable line, and no
            # body that repeats them.
            if status == 200 and len(out) + 256 > nc.max_payload:
                status, out = 413, _json({"error": "answer over the server's max_payload: ask over HTTP"})
            if status != 200:
                body = json.loads(out)
                why = "".join(c if " " <= c <= "~" else "?" for c in str(body["error"])[:200])
                body["error"] = why
                await req.respond_error(str(status), why, data=_json(body))
            else:
                await req.respond(out)

        async def prefix(req: Request) -> None:
            status, _, out = await self.answer_prefix(req.data, "nats")
            await send(req, status, out)

        async def workers(req: Request) -> None:
            try:
                out = _json(self.state.workers())
            except Exception:  # the error reply carries a body like every other
                log.exception("workers_query_failed", transport="nats")
                await send(req, 500, _json({"error": "internal error"}))
                return
            await send(req, 200, out)

        version = __version__ if __version__[0].isdigit() and "+" not in __version__ else "0.0.0"
        self.micro = InboxOnlyService(nc, ServiceConfig(
            name=SERVICE_NAME, version=version, queue_group=self.opts.queue_group,
            description="kv-bridge observe: which workers hold a request's prefix",
            metadata={"http_port": str(self.http_port or "")}))
        await self.micro.start()
        base = self.opts.service_subject
        await self.micro.add_endpoint(name="prefix", subject=f"{base}.prefix", handler=prefix)
        await self.micro.add_endpoint(name="workers", subject=f"{base}.workers", handler=workers)

    def _bootstrap(self, settings: NatsAccess) -> BootstrapOptions | None:
        """The options' bootstrap, under the subject prefix the access settings name."""
        boot = self.opts.bootstrap
        return None if boot is None else msgspec.structs.replace(boot, prefix=settings.subject_prefix)

    async def run(self, settings: NatsAccess, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> int:
        opts = self.opts
        conn = BusConnection()
        async with anyio.create_task_group() as tg:
            self.http_port = await tg.start(serve_http, opts.http_host, opts.http_port, self.route)
            tg.start_soon(self._ticker, conn)
            try:
                nc = await conn.open(settings, "kv-bridge observe", timeout=opts.connect_timeout)
            except (ConnectionError, OSError) as exc:
                print(f"kv-bridge observe: {exc}", file=sys.stderr)
                tg.cancel_scope.cancel()
                return 1
            self.state.nats_connected = True
            index = self.state.index
            if opts.bucket:
                self.state.follower = RegistryFollower(nc, opts.bucket, opts.dead_after,
                                                       on_entry=lambda e: declare_entry(index, e))
                tg.start_soon(self.state.follower.run)
            subject = f"{settings.subject_prefix}.>"
            try:
                async with BusSubscriber(conn, subject, since=opts.since, stream=opts.stream,
                                         bootstrap=self._bootstrap(settings)) as sub:
                    self._sub = sub
                    self.state.subscribed = True
                    try:
                        async with anyio.create_task_group() as feeding:
                            feeding.start_soon(self._feed, sub)
                            # Ready (and answering) once what the subscription found is applied.
                            while not self.bootstrapped() and not self._fed:
                                await anyio.sleep(_OPEN_POLL_S)
                            if opts.serve_nats:
                                try:
                                    await self._serve_nats(nc)
                                except UnguardedDiscovery as exc:  # HTTP still answers
                                    self.micro = None
                                    log.error("nats_service_unavailable", reason=str(exc))
                            self.ready.set()
                            task_status.started(self.http_port)
                            log.info("observe_ready", http_port=self.http_port, subject=subject,
                                     ranks=len(self.state.index.views))
                    finally:
                        self.state.subscribed = False
                        if self.micro is not None:
                            with anyio.CancelScope(shield=True):
                                await self.micro.stop()
            except nats.js.errors.NotFoundError:
                print(f"kv-bridge observe: no JetStream stream {opts.stream!r} holds {subject!r}", file=sys.stderr)
                tg.cancel_scope.cancel()
                return 1
            finally:
                await close_quietly(conn.close)
            tg.cancel_scope.cancel()
        return 0
