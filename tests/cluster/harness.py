"""A NATS cluster on loopback for the cluster tests: three nats-server
processes joined by cluster routes, JetStream on, each with its store in the
test's directory and a monitoring port; kill -9, SIGSTOP/SIGCONT and restart
of any one of them; where the stream's leader is and which server a client is
connected to; and the stream read back with its headers, for the accounting.

Every server listens on 127.0.0.1 only. Ports are picked free at construction
and kept across restarts, so the routes and the bridge's URLs stay valid.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec
import nats
import nats.errors
import nats.js.api
import nats.js.errors

from bridge.contract import HDR_MSG_ID, GroupMessage, WorkerRecord
from bridge.runtime.nats_server import answers, find_nats_server
from bridge.runtime.ports import free_port

CLUSTER_NAME = "kvb"


class PortTaken(RuntimeError):
    """A port picked free was bound by another process before the server bound it."""


class ClusterNode:
    """One nats-server of the cluster, started from a config file written once."""

    def __init__(self, name: str, workdir: Path, extra_conf: str = "") -> None:
        self.name = name
        self.workdir = workdir
        self.port = self.cluster_port = self.http_port = 0
        self.store_dir = workdir
        self.pick_ports(0)
        self.conf = workdir / f"{name}.conf"
        self.log = workdir / f"{name}.log"
        self.extra_conf = extra_conf
        self.proc: subprocess.Popen[bytes] | None = None
        self.frozen = False

    def pick_ports(self, attempt: int) -> None:
        """Free ports, and a store of its own for each attempt to start the cluster."""
        self.port, self.cluster_port, self.http_port = free_port(), free_port(), free_port()
        self.store_dir = self.workdir / f"{self.name}-store{f'-{attempt}' if attempt else ''}"
        self.store_dir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def write_conf(self, routes: list[str]) -> None:
        route_list = ", ".join(f'"{r}"' for r in routes)
        self.conf.write_text(
            f'server_name: "{self.name}"\n'
            f"listen: 127.0.0.1:{self.port}\n"
            f"http: 127.0.0.1:{self.http_port}\n"
            f'jetstream {{\n  store_dir: "{self.store_dir}"\n}}\n'
            f'cluster {{\n  name: "{CLUSTER_NAME}"\n  listen: 127.0.0.1:{self.cluster_port}\n'
            f"  routes: [{route_list}]\n}}\n"
            f"{self.extra_conf}\n"
        )

    def start(self) -> ClusterNode:
        log = open(self.log, "ab")  # noqa: SIM115 - handed to the child
        try:
            self.proc = subprocess.Popen([find_nats_server(), "-c", str(self.conf)], stdout=log, stderr=log,
                                         start_new_session=True)
        finally:
            log.close()
        self.frozen = False
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-2000:]
                error = PortTaken if "address already in use" in tail else RuntimeError
                raise error(f"nats-server {self.name} exited with {self.proc.returncode}: {tail}")
            if answers(self.port):
                return self
            time.sleep(0.05)
        raise TimeoutError(f"nats-server {self.name} did not listen on {self.port}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()
        self.frozen = False

    def freeze(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
        self.frozen = False

    def stop(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def monitor(self, path: str, timeout: float = 2.0) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}{path}", timeout=timeout) as resp:
            return json.loads(resp.read())


class NatsCluster:
    """Three (or `size`) servers with full-mesh routes and JetStream."""

    def __init__(self, workdir: Path, size: int = 3, extra_conf: str = "") -> None:
        self.nodes = [ClusterNode(f"n{i + 1}", workdir, extra_conf) for i in range(size)]
        self._write_confs()

    def _write_confs(self) -> None:
        routes = [f"nats://127.0.0.1:{n.cluster_port}" for n in self.nodes]
        for node in self.nodes:
            node.write_conf(routes)

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    def node(self, name: str) -> ClusterNode:
        return next(n for n in self.nodes if n.name == name)

    def others(self, *names: str) -> list[ClusterNode]:
        return [n for n in self.nodes if n.name not in names]

    def start(self, attempts: int = 3) -> NatsCluster:
        """Every server started. A port picked free can be taken by another
        process before the server binds it (the suite starts many): then the
        whole cluster starts again on new ports, up to `attempts` times."""
        for attempt in range(1, attempts + 1):
            try:
                for node in self.nodes:
                    node.start()
                return self
            except PortTaken:
                self.stop()
                if attempt == attempts:
                    raise
                for node in self.nodes:
                    node.pick_ports(attempt)
                self._write_confs()
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    async def wait_jetstream(self, timeout: float = 30.0) -> None:
        """Until the JetStream meta group has a leader that every live server knows."""
        def ready() -> bool:
            try:
                leaders = {n.monitor("/jsz").get("meta_cluster", {}).get("leader") for n in self.nodes if n.alive()}
            except OSError:
                return False
            return len(leaders) == 1 and None not in leaders and "" not in leaders

        with anyio.fail_after(timeout):
            while not await anyio.to_thread.run_sync(ready):
                await anyio.sleep(0.2)

    def connected_node(self, client_name: str) -> ClusterNode | None:
        """The live server a client with this connection name is connected to (its /connz)."""
        for node in self.nodes:
            if not node.alive() or node.frozen:
                continue
            try:
                conns = node.monitor("/connz?limit=1024").get("connections") or []
            except OSError:
                continue
            if any(c.get("name") == client_name for c in conns):
                return node
        return None

    async def wait_connected_node(self, client_name: str, timeout: float = 20.0) -> ClusterNode:
        with anyio.fail_after(timeout):
            while True:
                node = await anyio.to_thread.run_sync(self.connected_node, client_name)
                if node is not None:
                    return node
                await anyio.sleep(0.1)

    async def stream_leader(self, stream: str, via: Iterable[ClusterNode] | None = None,
                            timeout: float = 30.0) -> ClusterNode:
        """The stream's leader as stream info names it, asked of a live server."""
        with anyio.fail_after(timeout):
            while True:
                for node in via or self.nodes:
                    if not node.alive() or node.frozen:
                        continue
                    try:
                        nc = await nats.connect(node.url, connect_timeout=1, allow_reconnect=False)
                    except (OSError, nats.errors.Error, TimeoutError):
                        continue
                    try:
                        info = await nc.jetstream(timeout=1).stream_info(stream)
                        leader = info.cluster.leader if info.cluster else None
                        if leader:
                            return self.node(leader)
                    except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
                        pass
                    finally:
                        await nc.close()
                await anyio.sleep(0.2)

    async def step_down(self, stream: str) -> None:
        """A graceful leader change: the stream's leader steps down, another is elected."""
        for node in self.nodes:
            if not node.alive() or node.frozen:
                continue
            nc = await nats.connect(node.url)
            try:
                await nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", b"", timeout=5)
                return
            finally:
                await nc.close()
        raise RuntimeError("no live server to ask")


# -- what the stream holds ---------------------------------------------------------

Body = GroupMessage | WorkerRecord


@dataclass
class Stored:
    seq: int  # stream sequence
    subject: str
    msg_id: str
    body: Body


async def read_stream(urls: list[str], stream: str = "KV_EVENTS", timeout: float = 60.0) -> list[Stored]:
    """Everything the stream holds, in stream order, with each message's
    Nats-Msg-Id; read through the stream leader (not a possibly lagging replica)."""
    with anyio.fail_after(timeout):
        while True:
            try:
                return await _read_stream(urls, stream)
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError, OSError):
                await anyio.sleep(0.5)


async def _read_stream(urls: list[str], stream: str) -> list[Stored]:
    nc = await nats.connect(servers=urls, connect_timeout=2, max_reconnect_attempts=2)
    try:
        js = nc.jetstream(timeout=5)
        info = await js.stream_info(stream)
        out: list[Stored] = []
        if not info.state.messages:
            return out
        # An ordered push consumer: one pass, in stream order, headers included.
        sub = await js.subscribe(">", stream=stream, ordered_consumer=True,
                                 deliver_policy=nats.js.api.DeliverPolicy.ALL)
        try:
            while True:
                msg = await sub.next_msg(timeout=5)
                meta = msg.metadata
                subject = msg.subject
                body: Body = (msgspec.msgpack.decode(msg.data, type=WorkerRecord) if subject.endswith(".worker")
                              else msgspec.msgpack.decode(msg.data, type=GroupMessage))
                out.append(Stored(meta.sequence.stream, subject, (msg.headers or {}).get(HDR_MSG_ID, ""), body))
                if meta.sequence.stream >= info.state.last_seq:
                    return out
        finally:
            await sub.unsubscribe()
    finally:
        await nc.close()


async def stream_count(urls: list[str], stream: str = "KV_EVENTS") -> int:
    try:
        nc = await nats.connect(servers=urls, connect_timeout=2, max_reconnect_attempts=1)
    except (nats.errors.Error, OSError, TimeoutError):
        return -1
    try:
        return int((await nc.jetstream(timeout=2).stream_info(stream)).state.messages)
    except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
        return -1
    finally:
        await nc.close()


# -- accounting ----------------------------------------------------------------------


@dataclass
class ClusterFigures:
    """Per fault, counted per vLLM batch: in the stream exactly once, in order
    per worker and rank, or named by a gap record."""

    name: str
    sent: int
    stored: int = 0  # batches whose every group message is in the stream
    copies: int = 0  # extra copies of a message (by Nats-Msg-Id): must be 0
    late: int = 0  # batches stored after a later batch of the same worker and rank
    late_unannounced: int = 0  # ... that no gap record names: must be 0
    lost: int = 0
    lost_unannounced: int = 0  # must be 0
    gaps: dict[str, int] = field(default_factory=dict)  # gap records by reason
    wrong_seq: int = 0
    # the core subscriber on another server: batches it never saw and no gap names
    live_missing_unannounced: int = -1
    live_duplicates: int = -1
    notes: str = ""

    def line(self) -> str:
        gaps = ",".join(f"{k}:{v}" for k, v in sorted(self.gaps.items())) or "none"
        return (f"CLUSTER {self.name}: sent={self.sent} stored_once={self.stored} copies={self.copies} "
                f"late={self.late} late_unannounced={self.late_unannounced} lost={self.lost} "
                f"lost_unannounced={self.lost_unannounced} gaps={gaps} wrong_seq={self.wrong_seq} "
                f"live_missing_unannounced={self.live_missing_unannounced} live_duplicates={self.live_duplicates}"
                + (f" ({self.notes})" if self.notes else ""))


def _gap_cover(records: Iterable[WorkerRecord]) -> tuple[dict[tuple[int, int], set[int]], dict[str, int]]:
    cover: dict[tuple[int, int], set[int]] = {}
    reasons: dict[str, int] = {}
    for rec in records:
        if rec.type != "gap" or rec.gap_from is None or rec.gap_to is None:
            continue
        reasons[rec.reason or ""] = reasons.get(rec.reason or "", 0) + 1
        cover.setdefault((rec.epoch, rec.dp_rank), set()).update(range(rec.gap_from, rec.gap_to + 1))
    return cover, reasons


def account_stream(name: str, sent: int, stored: list[Stored], groups: tuple[int, ...],
                   ident_of: Any) -> ClusterFigures:
    """`ident_of(first block hash) -> k` names the batch a message belongs to
    (None for foreign ones); `sent`: batches 0..sent-1 of one worker, rank 0."""
    fig = ClusterFigures(name, sent)
    records = [s.body for s in stored if isinstance(s.body, WorkerRecord)]
    cover, fig.gaps = _gap_cover(records)
    ids: dict[str, int] = {}
    got: dict[int, set[int]] = {}
    high: dict[tuple[int, int], int] = {}
    late: set[tuple[int, int, int]] = set()
    for item in stored:
        if item.msg_id:
            ids[item.msg_id] = ids.get(item.msg_id, 0) + 1
        body = item.body
        if not isinstance(body, GroupMessage):
            continue
        first = body.events[0].block_hashes[0] if body.events and body.events[0].block_hashes else None
        k = ident_of(first) if isinstance(first, bytes) else None
        if k is None:
            continue
        if body.seq != k:
            fig.wrong_seq += 1
        got.setdefault(k, set()).add(body.group)
        key = (body.epoch, body.dp_rank)
        if body.seq < high.get(key, -1):
            late.add((body.epoch, body.dp_rank, body.seq))
        high[key] = max(high.get(key, -1), body.seq)
    fig.copies = sum(n - 1 for n in ids.values())
    fig.stored = sum(1 for k in range(sent) if got.get(k, set()) >= set(groups))
    fig.late = len({seq for _, _, seq in late})
    fig.late_unannounced = len({seq for e, r, seq in late if seq not in cover.get((e, r), set())})
    epochs = {e for e, _ in cover} | {s.body.epoch for s in stored if isinstance(s.body, GroupMessage)}
    covered_any = set().union(*(cover.get((e, 0), set()) for e in epochs)) if epochs else set()
    missing = [k for k in range(sent) if got.get(k, set()) < set(groups)]
    fig.lost = len(missing)
    fig.lost_unannounced = sum(1 for k in missing if k not in covered_any)
    return fig


def account_live(fig: ClusterFigures, sent: int, seen: list[tuple[str, Body]], groups: tuple[int, ...],
                 ident_of: Any) -> None:
    """A core subscriber's view: every batch seen (copies allowed: it must
    de-duplicate by Nats-Msg-Id) or named by a gap record it saw."""
    records = [b for _, b in seen if isinstance(b, WorkerRecord)]
    cover, _ = _gap_cover(records)
    covered = set().union(*cover.values()) if cover else set()
    got: dict[int, set[int]] = {}
    copies: dict[tuple[int, int, int], int] = {}
    for _subject, body in seen:
        if not isinstance(body, GroupMessage):
            continue
        first = body.events[0].block_hashes[0] if body.events and body.events[0].block_hashes else None
        k = ident_of(first) if isinstance(first, bytes) else None
        if k is None:
            continue
        got.setdefault(k, set()).add(body.group)
        key = (k, body.group, body.part)
        copies[key] = copies.get(key, 0) + 1
    fig.live_missing_unannounced = sum(1 for k in range(sent) if got.get(k, set()) < set(groups) and k not in covered)
    fig.live_duplicates = sum(n - 1 for n in copies.values())
