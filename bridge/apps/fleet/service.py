"""The observe service's run loop: the bus into the index, the registry, the
HTTP server, and the prefix query as a NATS micro service."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import anyio
import msgspec
import nats.js.errors
import nats.micro
import structlog
from nats.micro.request import Request

from bridge import __version__
from bridge.apps.fleet.http import Response, serve_http
from bridge.apps.fleet.metrics import HybridCache, make_registry, render
from bridge.apps.fleet.options import ObserveOptions
from bridge.apps.fleet.state import ObserveState, PrefixQuery, QueryError, hybrid_effect
from bridge.client.bootstrap import BootstrapOptions
from bridge.client.connection import BusConnection
from bridge.client.registry import RegistryFollower, declare_entry
from bridge.client.subscribe import BusMessage, BusSubscriber
from bridge.runtime.access import NatsAccess
from bridge.runtime.stopping import close_quietly

log = structlog.get_logger("bridge.apps.fleet")

SERVICE_NAME = "kv-observe"
_JSON = "application/json"
_decoder = msgspec.json.Decoder(PrefixQuery)


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def _error(status: int, why: str) -> Response:
    return status, _JSON, _json({"error": why})


class ObserveService:
    def __init__(self, opts: ObserveOptions) -> None:
        self.opts = opts
        self.state = ObserveState()
        self.hybrid = HybridCache()
        self.registry = make_registry(self.state, self.hybrid, opts.max_worker_series)
        self.http_port: int | None = None
        self.ready = anyio.Event()  # listening, connected, subscribed
        self._tick = time.monotonic()
        self.micro: nats.micro.service.Service | None = None

    # -- answers -----------------------------------------------------------

    def answer_prefix(self, body: bytes, transport: str) -> Response:
        try:
            q = _decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.state.queries[(transport, "error")] += 1
            return _error(400, f"bad query: {exc}")
        try:
            return 200, _JSON, _json(self.state.prefix(q, transport))
        except QueryError as exc:
            return _error(400, str(exc))

    def live(self) -> bool:
        return time.monotonic() - self._tick < 10.0

    def is_ready(self) -> bool:
        return self.live() and self.state.nats_connected and self.state.subscribed

    async def route(self, method: str, path: str, body: bytes) -> Response:
        if path == "/v1/prefix":
            if method != "POST":
                return _error(405, "POST a JSON query")
            return self.answer_prefix(body, "http")
        if method != "GET":
            return 405, "text/plain", b"GET only\n"
        if path == "/metrics":
            return 200, "text/plain; version=0.0.4; charset=utf-8", render(self.registry)
        if path == "/v1/workers":
            return 200, _JSON, _json(self.state.workers())
        if path == "/healthz":
            return (200, "text/plain", b"ok\n") if self.live() else (503, "text/plain", b"stalled\n")
        if path == "/readyz":
            if self.is_ready():
                return 200, "text/plain", b"ready\n"
            why = f"nats_connected={self.state.nats_connected} subscribed={self.state.subscribed}\n"
            return 503, "text/plain", why.encode()
        return 404, "text/plain", b"not found\n"

    # -- tasks -------------------------------------------------------------

    async def _feed(self, sub: BusSubscriber) -> None:
        index = self.state.index
        async for item in sub:
            index.apply(item)
            if type(item) is BusMessage:
                self.state.bus_messages += 1
            self.state.undecodable = sub.undecodable

    async def _ticker(self, conn: BusConnection) -> None:
        while True:
            self._tick = time.monotonic()
            nc = conn.nc
            self.state.nats_connected = nc is not None and nc.is_connected
            if time.time() - self.hybrid.updated >= self.opts.hybrid_interval:
                self.refresh_hybrid()
            await anyio.sleep(0.5)

    def refresh_hybrid(self) -> None:
        values = {}
        for view in self.state.index:
            values[(view.key.worker, view.key.dp_rank)] = hybrid_effect(view, self.opts.hybrid_sample)
        self.hybrid.values = values
        self.hybrid.updated = time.time()

    async def _serve_nats(self, nc: Any) -> None:
        async def send(req: Request, status: int, out: bytes) -> None:
            # An answer over the server's max_payload would make the server
            # close this connection: an error that fits goes instead. Error
            # texts travel in a header too: one short printable line, and no
            # body that repeats them.
            if status == 200 and len(out) + 256 > nc.max_payload:
                status, out = 413, _json({"error": "answer over the server's max_payload: ask over HTTP"})
            if status != 200:
                why = "".join(c if " " <= c <= "~" else "?" for c in str(json.loads(out)["error"])[:200])
                await req.respond_error(str(status), why, data=_json({"error": why}))
            else:
                await req.respond(out)

        async def prefix(req: Request) -> None:
            status, _, out = self.answer_prefix(req.data, "nats")
            await send(req, status, out)

        async def workers(req: Request) -> None:
            await send(req, 200, _json(self.state.workers()))

        version = __version__ if __version__[0].isdigit() and "+" not in __version__ else "0.0.0"
        self.micro = await nats.micro.add_service(
            nc, name=SERVICE_NAME, version=version, queue_group=self.opts.queue_group,
            description="kv-bridge observe: which workers hold a request's prefix",
            metadata={"http_port": str(self.http_port or "")})
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
                    self.state.subscribed = True
                    if opts.serve_nats:
                        await self._serve_nats(nc)
                    self.ready.set()
                    task_status.started(self.http_port)
                    log.info("observe_ready", http_port=self.http_port, subject=subject)
                    try:
                        await self._feed(sub)
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
