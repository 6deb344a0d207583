"""The bridge process: pipelines, sink, HTTP and signals in one anyio task group."""

from __future__ import annotations

import gc
import time
from collections import Counter as CountOf
from contextlib import ExitStack

import anyio
import anyio.abc
import msgspec
import nats.js
import structlog
import zmq

from bridge import __version__
from bridge.contract import WorkerEntry
from bridge.contract.identity import Refusal
from bridge.producer.config import Settings
from bridge.producer.pipeline import StreamPipeline
from bridge.producer.plan import StreamSettings, stream_plans
from bridge.producer.sink.catalog import GroupCatalog
from bridge.producer.sink.confirm import WrittenRun
from bridge.producer.sink.encode import MessageEncoder
from bridge.producer.sink.jetstream import ResumePoint
from bridge.producer.sink.publisher import NatsSink
from bridge.producer.sink.queue import BatchQueue, LostRange, OutBatch
from bridge.producer.sink.registry_writer import WorkerRegistry, ttl_for
from bridge.producer.sink.reorder import reordered_runs
from bridge.producer.sink.stream_setup import open_stream, stream_state
from bridge.producer.snapshot.bucket import SnapshotWriter, open_bucket
from bridge.producer.snapshot.keeper import ResidencyKeeper, keep_up
from bridge.producer.snapshot.rebuild import rebuild_rank
from bridge.producer.snapshot.service import SnapshotService
from bridge.producer.source.zmq_io import InputWatch
from bridge.producer.telemetry.health import Health
from bridge.producer.telemetry.http import serve_http
from bridge.producer.telemetry.metrics import Metrics
from bridge.residency.cells import NATIVE_CELL
from bridge.runtime.memory import MemoryReturn
from bridge.runtime.nats_server import NatsServerProcess
from bridge.runtime.stopping import stop_on_signal

log = structlog.get_logger("bridge.producer.service")
# Batches queued for NATS beyond which new messages go to the snapshot keeper
# as their payloads alone (`Bridge._keeper_takes_bodies`).
BODIES_QUEUED_AT_MOST = 2


class Bridge:
    """Everything one `kv-bridge run` holds. Tests drive it in-process with
    `run(stop=...)`; the CLI drives it with signals. `nats_fast_path=False`
    keeps the sink to nats-py's public API (bridge.producer.sink.nats_fastpath)."""

    def __init__(self, settings: Settings, *, nats_fast_path: bool = True) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.health = Health(nats_unhealthy_after_s=settings.nats_unhealthy_after)
        self.metrics.info.labels(__version__, settings.worker_id).set(1)
        self.http_port: int | None = None
        self._pipelines: list[StreamPipeline] = []
        self._input = InputWatch()  # the pipelines' ZMQ sockets, for the idle keeper
        self.catalog = GroupCatalog()
        self.started_at = time.time()
        self._registry: WorkerRegistry | None = None
        self.queue = BatchQueue(
            settings.max_buffered_batches, self._gap_batch, self.metrics.dropped_by["queue_overflow"].inc,
            settings.max_buffered_bytes, on_put=self.catalog.observe,
        )
        self.keeper = ResidencyKeeper(settings.worker_id, settings.snapshot_log_bytes,
                                      ranks=sorted({p.dp_rank for p in stream_plans(settings)}),
                                      relay_busy=self._relay_busy) \
            if settings.snapshots else None
        keeper = self.keeper
        self.sink = NatsSink(settings, self.queue, self.metrics, self.health, on_refused=self._refused,
                             on_reordered=self._reordered, on_lost=self._lost, fast_path=nats_fast_path,
                             on_written=keeper.published if keeper else None,
                             on_stored=keeper.stored if keeper else None)
        if keeper is not None:
            self.metrics.watch_residency(keeper.levels, keeper.refusals)
        self.snapshots: SnapshotService | None = None
        self._snapshot_writer: SnapshotWriter | None = None
        self._subscribed = 0
        self.ready = anyio.Event()

    def _max_payload(self) -> int:
        """The server's limit once connected (its INFO says), NATS's default before."""
        nc = self.sink.nc
        limit = nc.max_payload if nc is not None and nc.max_payload else 1024 * 1024
        return int(limit)

    def registry_entry(self) -> WorkerEntry:
        s = self.settings
        return self.catalog.entry(
            worker=s.worker_id, topic=s.topic, subject_prefix=s.subject_prefix,
            ranks=[rank for rank, _, _ in s.stream_endpoints()], started_at=self.started_at,
            heartbeat_interval=s.heartbeat_interval, model=s.model, tenant=s.tenant,
        )

    async def _start_registry(self, tg: anyio.abc.TaskGroup) -> None:
        """The worker's registry entry and heartbeat, where the server has
        JetStream; without it the bus still works and one warning says why."""
        s = self.settings
        if not s.registry_bucket or self.sink.nc is None:
            return
        js = self.sink.js or self.sink.nc.jetstream()
        try:
            await js.account_info()
        except Exception as exc:  # no JetStream on this server or account
            log.warning("registry_unavailable", bucket=s.registry_bucket, error=type(exc).__name__)
            return
        self._registry = WorkerRegistry(js, s.registry_bucket, ttl_for(s.heartbeat_interval))
        tg.start_soon(self._registry.heartbeat, self.registry_entry, s.heartbeat_interval)

    def _relay_busy(self) -> bool:
        """Work waits for the relay: a batch queued for NATS, or one in ZMQ.
        The snapshot keeper's own work goes after it."""
        return len(self.queue) > 0 or self._input.waiting()

    def _keeper_takes_bodies(self) -> bool:
        """Whether the next batch's messages carry their structs for the
        keeper: only while the relay keeps up (no batch waits in ZMQ, and
        few for NATS) and the keeper's log is short. In a burst they carry
        their payloads alone: objects held through a burst cost the relay
        more than the keeper's decode."""
        keeper = self.keeper
        return (keeper is not None and len(self.queue) <= BODIES_QUEUED_AT_MOST and keeper.takes_bodies()
                and not self._input.waiting())

    def _gap_batch(self, lost: LostRange) -> OutBatch:
        return self._pipelines[lost.stream].gap_batch(lost)

    def _refused(self, batch: OutBatch) -> None:
        """The stream refused part of `batch` for good: a gap names it. The
        record may follow later batches; its epoch is the batch's."""
        self._pipelines[batch.stream].announce.gap(batch.seq, batch.seq, "refused", epoch=batch.epoch)

    def _reordered(self, batches: list[OutBatch]) -> None:
        """A `gap` record (reason `reordered`) names each run of batches the
        stream stored behind a later one (bridge.producer.sink.reorder). It follows them."""
        for run in reordered_runs(batches):
            self._pipelines[run.stream].announce.gap(run.first, run.last, "reordered", epoch=run.epoch)

    def _lost(self, run: WrittenRun) -> None:
        """Core mode: batches handed to a NATS client closed for good before
        the server confirmed them: a gap record names them."""
        self._pipelines[run.stream].announce.gap(run.first, run.last, "connection_closed", epoch=run.epoch)

    async def _nats_replaced(self) -> None:
        """A new NATS client in place of one closed for good: what lived on
        the old one made again (stream, registry, snapshot bucket and service)."""
        s = self.settings
        nc, js = self.sink.nc, self.sink.js
        assert nc is not None
        if js is not None:
            await stream_state(js, s)
        if self._registry is not None:
            self._registry.rebind(js or nc.jetstream())
        if self._snapshot_writer is not None and js is not None and s.snapshot_bucket:
            try:
                self._snapshot_writer.rebind(await open_bucket(js, s.snapshot_bucket, replicas=s.stream_replicas,
                                                               max_age=s.stream_max_age))
            except Exception as exc:  # JetStream busy: the writer's next rounds fail and say so
                log.warning("snapshot_bucket_unavailable", bucket=s.snapshot_bucket, error=type(exc).__name__,
                            detail=str(exc)[:200])
        if self.snapshots is not None:
            await self.snapshots.stop()
            try:
                await self.snapshots.start(nc)
            except Exception as exc:  # e.g. no permission for its subjects: the bridge runs on without it
                log.error("snapshot_service_failed", error=type(exc).__name__, detail=str(exc)[:200])

    def _on_subscribed(self) -> None:
        self._subscribed += 1
        if self._subscribed == len(self._pipelines):
            self.health.zmq_subscribed = True

    async def _heartbeat(self) -> None:
        while True:
            self.health.tick()
            if self.health.ready() and not self.ready.is_set():
                self.ready.set()
            await anyio.sleep(0.5 if not self.ready.is_set() else 2.0)

    async def run(self, stop: anyio.Event | None = None, handle_signals: bool = False) -> int:
        s = self.settings
        log.info("bridge_starting", version=__version__, settings=s.redacted())
        if self.keeper is not None and NATIVE_CELL is None:
            log.warning("snapshot_tables_not_native", note="kv-bridge was installed without its C module "
                        "(bridge.residency._cells): snapshots keep hashes in Python dicts, about twice the memory")
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        encoder = MessageEncoder(s.format)
        shared = StreamSettings.of(s)
        watch = self._input
        for plan in stream_plans(s):
            self._pipelines.append(
                StreamPipeline(
                    plan, shared, ctx=ctx, queue=self.queue, encoder=encoder, metrics=self.metrics,
                    max_payload=self._max_payload, nats_up=lambda: self.health.nats_connected, watch=watch,
                    keep_bodies=self._keeper_takes_bodies if self.keeper is not None else None,
                )
            )
        stop = stop or anyio.Event()
        try:
            async with anyio.create_task_group() as tg:
                self.http_port = await tg.start(serve_http, s.http_host, s.http_port, self.metrics, self.health)
                tg.start_soon(self._heartbeat)
                if handle_signals:
                    tg.start_soon(stop_on_signal, stop)
                async with anyio.create_task_group() as readers:
                    if s.jetstream:
                        # Resume needs the stream before the first ZMQ batch is taken.
                        readers.start_soon(self._resume_then_read, readers, tg)
                    else:
                        for pipeline in self._pipelines:
                            readers.start_soon(pipeline.run, self._on_subscribed)
                        tg.start_soon(self._connect_and_publish, tg)
                    await stop.wait()
                    log.info("bridge_stopping", queued=len(self.queue))
                    readers.cancel_scope.cancel()
                for pipeline in self._pipelines:
                    self.queue.put(pipeline.stop_record())
                with anyio.move_on_after(s.drain_timeout) as scope:
                    await self.sink.flush()
                if scope.cancelled_caught:
                    log.warning("drain_timeout", left=len(self.queue))
                await self._stop_snapshots()
                if self._registry is not None:
                    with anyio.move_on_after(2.0):
                        try:
                            await self._registry.stopped(self.registry_entry())
                        except Exception as exc:  # NATS away at the end: the entry ages out instead
                            log.warning("registry_stop_failed", error=type(exc).__name__, detail=str(exc)[:200])
                with anyio.move_on_after(max(1.0, s.drain_timeout / 2)):
                    await self.sink.close()
                tg.cancel_scope.cancel()
        finally:
            ctx.destroy(linger=0)
        log.info("bridge_stopped", published_batches=self.sink.published_batches, left=len(self.queue))
        return 0

    async def _connect_and_publish(self, tg: anyio.abc.TaskGroup) -> None:
        await self.sink.connect()
        tg.start_soon(self.sink.supervise, self._nats_replaced)
        tg.start_soon(self.sink.confirm)
        await self._start_registry(tg)
        await self._start_snapshots(tg)
        await self.sink.run()

    async def _resume_then_read(self, readers: anyio.abc.TaskGroup, tg: anyio.abc.TaskGroup) -> None:
        await self.sink.connect()
        tg.start_soon(self.sink.supervise, self._nats_replaced)
        points = await self._open_stream()
        await self._open_snapshot_bucket(points)
        for pipeline, point in zip(self._pipelines, points):
            if point is not None:
                pipeline.resume(point)
        await self._start_registry(tg)
        await self._start_snapshots(tg)
        tg.start_soon(self.sink.run)
        for pipeline in self._pipelines:
            readers.start_soon(pipeline.run, self._on_subscribed)

    async def _open_snapshot_bucket(self, points: list[ResumePoint | None]) -> None:
        """JetStream mode: the snapshot bucket, and for each rank that resumes
        the residency it had, rebuilt from the bucket and the stream (before
        any new batch is taken, so the rebuilt view and the new acks meet in
        stream order)."""
        s = self.settings
        if self.keeper is None or self.sink.js is None:
            return
        js = self.sink.js
        kv = None
        if s.snapshot_bucket:
            try:
                kv = await open_bucket(js, s.snapshot_bucket, replicas=s.stream_replicas, max_age=s.stream_max_age)
            except Exception as exc:  # no JetStream for the bucket, or no permission: service-only snapshots
                log.warning("snapshot_bucket_unavailable", bucket=s.snapshot_bucket, error=type(exc).__name__,
                            detail=str(exc)[:200])
        writer = None if kv is None else SnapshotWriter(
            self.keeper, kv, self.metrics, interval=s.snapshot_interval, every_messages=s.snapshot_events,
            max_payload=self._max_payload(), rewrite_after=max(s.snapshot_interval, s.stream_max_age / 2 or 3600.0),
        )
        for pipeline, point in zip(self._pipelines, points):
            if point is None:
                continue
            # With no bucket the rank is rebuilt from the stream alone (partial
            # unless the stream still holds the start of its epoch).
            head = await rebuild_rank(js, self.keeper, None if kv is None else s.snapshot_bucket,
                                      stream=s.stream_name, subject_base=pipeline.subjects.base,
                                      dp_rank=pipeline.plan.dp_rank)
            if writer is not None:
                writer.resume_slot(pipeline.plan.dp_rank, head)
        self._snapshot_writer = writer

    async def _start_snapshots(self, tg: anyio.abc.TaskGroup) -> None:
        keeper = self.keeper
        if keeper is None or self.sink.nc is None:
            return
        tg.start_soon(keep_up, keeper, MemoryReturn())
        if self._snapshot_writer is not None:
            tg.start_soon(self._snapshot_writer.run)
        service = SnapshotService(keeper, self.settings.subject_prefix, [p.plan.dp_rank for p in self._pipelines],
                                  self.metrics, self._max_payload)
        try:
            await service.start(self.sink.nc)
        except Exception as exc:  # e.g. no permission for its subjects: the bridge runs on without it
            log.error("snapshot_service_failed", error=type(exc).__name__, detail=str(exc)[:200])
            return
        self.snapshots = service

    async def _stop_snapshots(self) -> None:
        """The last snapshots, after the stop records are stored, into the bucket."""
        if self._snapshot_writer is not None:
            with anyio.move_on_after(max(1.0, self.settings.drain_timeout / 2)):
                try:
                    await self._snapshot_writer.write_due(everything=True)
                except Exception as exc:  # best effort on the way out
                    log.warning("snapshot_final_write_failed", error=type(exc).__name__)
        if self.snapshots is not None:
            await self.snapshots.stop()

    async def _open_stream(self) -> list[ResumePoint | None]:
        ranks = [(p.subjects.base, p.plan.dp_rank) for p in self._pipelines]
        passed: CountOf[Refusal] = CountOf()
        points = await open_stream(self._js, self.settings, self.health, ranks, self.sink.denied, passed)
        for why, n in passed.items():
            self.metrics.read_back_refused_by[why.value].inc(n)
        return points

    def _js(self) -> nats.js.JetStreamContext:
        js = self.sink.js
        assert js is not None
        return js


def run_bridge(settings: Settings) -> int:
    """Entry for `kv-bridge run`: an embedded nats-server when no URL is given."""
    with ExitStack() as stack:
        if not settings.nats_url:
            server = stack.enter_context(NatsServerProcess(jetstream=True))
            log.info("embedded_nats_listening", url=server.url,
                     hint=f"watch with: kv-bridge tail --nats-url {server.url}")
            settings = msgspec.structs.replace(settings, nats_url=[server.url])
        # Everything alive now (modules, settings, logging) lives as long as the
        # process: move it out of the cyclic GC's generations, so the collections
        # that decoding's short-lived lists trigger stop re-scanning it.
        gc.collect()
        gc.freeze()
        if settings.vllm_url:
            from bridge.producer.follow_vllm import follow  # it runs Bridge: imported here, not in a circle

            return anyio.run(follow, settings)
        return anyio.run(lambda: Bridge(settings).run(handle_signals=True))
