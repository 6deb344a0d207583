"""Shared pieces of the fault suite: traceable batches, the bus and stream
readers, a subprocess bridge, and the accounting behind every `FAULT` line.

Every batch a test publishes carries, as its first block hash, a digest of
(publisher, k): whatever the bridge does to epochs and seqs, the accounting
recognises each batch on the bus by content and checks that its seq is k.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import anyio
import msgspec
import nats
import nats.js.api
import psutil

from bridge.apps.demo.wire_writer import encode_batch, stored
from bridge.contract import GroupMessage, WorkerRecord
from bridge.runtime.nats_barrier import flushed

ATTN_GROUP, STATE_GROUP = 0, 2
GROUPS = (ATTN_GROUP, STATE_GROUP)
FIRST_SEQ_UNKNOWN = -1


def ident(pub: int, k: int) -> bytes:
    """The first block hash of batch k of publisher process `pub`."""
    return hashlib.sha256(f"fault:{pub}:{k}".encode()).digest()


def fault_batch(pub: int, k: int, pad_tokens: int = 0) -> bytes:
    """One vLLM batch, two groups (attention and mamba): two NATS messages.
    `pad_tokens` token ids make it as large as a test needs (~3 bytes each)."""
    h = ident(pub, k)
    tokens = list(range(16 + pad_tokens))
    return encode_batch(time.time(), [
        stored([h], None, tokens, 16, group_idx=ATTN_GROUP, kind="full_attention"),
        stored([h], None, [], 16, group_idx=STATE_GROUP, kind="mamba"),
    ])


# -- what came out --------------------------------------------------------

Body = GroupMessage | WorkerRecord


def decode_body(subject: str, data: bytes) -> Body:
    if subject.endswith(".worker"):
        return msgspec.msgpack.decode(data, type=WorkerRecord)
    return msgspec.msgpack.decode(data, type=GroupMessage)


class LiveBus:
    """A core NATS subscriber on `kv.>` that reconnects fast (fault tests kill
    its server too). What it misses while away is not the bridge's loss: the
    tests that kill NATS count from a stream instead."""

    def __init__(self) -> None:
        self.items: list[tuple[str, Body]] = []
        self.nc: Any = None

    async def start(self, url: str, subject: str = "kv.>") -> LiveBus:
        self.nc = await nats.connect(url, reconnect_time_wait=0.1, max_reconnect_attempts=-1,
                                     pending_size=64 * 1024 * 1024)
        await self.nc.subscribe(subject, cb=self._on_msg, pending_msgs_limit=1_000_000,
                                pending_bytes_limit=1024 * 1024 * 1024)
        await flushed(self.nc)
        return self

    async def _on_msg(self, msg: Any) -> None:
        self.items.append((msg.subject, decode_body(msg.subject, msg.data)))

    async def wait_interest(self, url: str, timeout: float = 30.0) -> None:
        """Until the server at `url` (another node of the cluster, the
        publisher's) knows of this subscription: a subscription reaches the
        other nodes over their routes some time after its own server took it,
        and what they are sent meanwhile never comes here. A probe subscribed
        after it, over the same routes, arrives once both are known there."""
        probe = f"_kvb_probe.{secrets.token_hex(4)}"
        heard = anyio.Event()

        async def on_probe(_msg: Any) -> None:
            heard.set()

        sub = await self.nc.subscribe(probe, cb=on_probe)
        await flushed(self.nc)
        pub = await nats.connect(url)
        try:
            with anyio.fail_after(timeout):
                while not heard.is_set():
                    await pub.publish(probe, b"")
                    await pub.flush()
                    with anyio.move_on_after(0.1):
                        await heard.wait()
        finally:
            await pub.close()
            await sub.unsubscribe()

    def records(self, type_: str) -> list[WorkerRecord]:
        return [b for _, b in self.items if isinstance(b, WorkerRecord) and b.type == type_]

    async def wait_records(self, type_: str, count: int = 1, timeout: float = 30.0) -> None:
        """Until `count` records of that type arrived (`stop` is a bridge's last word)."""
        with anyio.fail_after(timeout):
            while len(self.records(type_)) < count:
                await anyio.sleep(0.05)

    async def close(self) -> None:
        if self.nc is not None:
            await self.nc.close()


async def capture_stream(url: str, name: str = "FAULT_CAPTURE", subjects: str = "kv.>") -> None:
    """A stream that records everything published on `kv.>`, also in core
    mode: what the server accepted, whoever was subscribed at the time."""
    nc = await nats.connect(url)
    try:
        await nc.jetstream().add_stream(nats.js.api.StreamConfig(
            name=name, subjects=[subjects], storage=nats.js.api.StorageType.FILE, allow_direct=True,
            # short de-duplication: the stream must not hide a duplicate the bridge sends
            duplicate_window=0.1, max_age=600,
        ))
    finally:
        await nc.close()


async def read_stream(url: str, name: str) -> list[tuple[str, Body]]:
    """Everything the stream holds, in stream order."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(name)
        out: list[tuple[str, Body]] = []
        if info.state.messages == 0:
            return out
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            try:
                raw = await js.get_msg(name, seq, direct=True)
            except nats.js.errors.NotFoundError:
                continue
            if raw.data is None or raw.subject is None:
                continue
            out.append((raw.subject, decode_body(raw.subject, raw.data)))
        return out
    finally:
        await nc.close()


async def stream_batches(url: str, name: str) -> int:
    nc = await nats.connect(url)
    try:
        return int((await nc.jetstream().stream_info(name)).state.messages)
    finally:
        await nc.close()


# -- accounting ---------------------------------------------------------------


@dataclass
class Figures:
    name: str
    sent: int
    received: int
    duplicated: int
    lost: int
    announced: int
    # lost batches no gap record covers: must be 0 wherever a loss is possible
    unannounced: int = 0
    # batches a gap record names although they arrived (harmless, but counted)
    overannounced: int = 0
    gap_records: int = 0
    restarts: int = 0
    epochs: int = 0
    out_of_order: int = 0
    wrong_seq: int = 0
    # batches of which some groups' messages arrived and some did not (counted lost)
    partial: int = 0
    notes: str = ""
    lost_seqs: list[tuple[int, int]] = field(default_factory=list)

    def line(self) -> str:
        return (f"FAULT {self.name}: sent={self.sent} received={self.received} duplicated={self.duplicated} "
                f"lost={self.lost} announced={self.announced} unannounced={self.unannounced} "
                f"overannounced={self.overannounced} gaps={self.gap_records} restarts={self.restarts} "
                f"epochs={self.epochs} out_of_order={self.out_of_order} partial={self.partial}"
                + (f" ({self.notes})" if self.notes else ""))


def account(name: str, sent: dict[int, int], items: Iterable[tuple[str, Body]], notes: str = "") -> Figures:
    """`sent`: publisher process id → batches it published (seqs 0..n-1).
    `items`: what reached the bus or the stream, in order."""
    lookup = {ident(pub, k): (pub, k) for pub, n in sent.items() for k in range(n)}
    copies: Counter[tuple[int, int, int, int]] = Counter()
    parts: dict[tuple[int, int], set[int]] = {}
    epochs_of_pub: dict[int, set[int]] = {}
    order: dict[int, list[int]] = {}
    wrong_seq = 0
    gaps: list[WorkerRecord] = []
    restarts = 0
    epochs: set[int] = set()
    for _subject, body in items:
        if isinstance(body, WorkerRecord):
            if body.type == "gap":
                gaps.append(body)
            elif body.type == "restart":
                restarts += 1
            continue
        epochs.add(body.epoch)
        first = body.events[0].block_hashes[0] if body.events and body.events[0].block_hashes else None
        hit = lookup.get(first) if isinstance(first, bytes) else None
        if hit is None:
            continue
        pub, k = hit
        if body.seq != k:
            wrong_seq += 1
        copies[(pub, k, body.group, body.part)] += 1
        parts.setdefault(hit, set()).add(body.group)
        epochs_of_pub.setdefault(pub, set()).add(body.epoch)
        seqs = order.setdefault(body.epoch, [])
        if not seqs or seqs[-1] != body.seq:
            seqs.append(body.seq)
    out_of_order = sum(1 for seqs in order.values() for a, b in pairwise(seqs) if b <= a)
    expected = set(lookup.values())
    # a batch counts as received only when every group's message arrived
    received = {key for key, groups in parts.items() if groups >= set(GROUPS)}
    partial = len(set(parts) - received)
    lost = sorted(expected - received)
    only_pub = next(iter(sent)) if len(sent) == 1 else None

    def pubs_of_epoch(epoch: int) -> set[int]:
        found = {pub for pub, es in epochs_of_pub.items() if epoch in es}
        return found or ({only_pub} if only_pub is not None else set())

    covered: set[tuple[int, int]] = set()
    over = 0
    for gap in gaps:
        if gap.gap_from is None or gap.gap_to is None:
            continue
        for pub in pubs_of_epoch(gap.epoch):
            hi = min(gap.gap_to, sent[pub] - 1)
            for k in range(gap.gap_from, hi + 1):
                if (pub, k) in received:
                    over += 1
                else:
                    covered.add((pub, k))
    announced = sum(1 for x in lost if x in covered)
    return Figures(
        name=name, sent=len(expected), received=len(received), duplicated=sum(n - 1 for n in copies.values()),
        lost=len(lost), announced=announced, unannounced=len(lost) - announced, overannounced=over,
        gap_records=len(gaps), restarts=restarts, epochs=len(epochs), out_of_order=out_of_order,
        wrong_seq=wrong_seq, partial=partial, notes=notes, lost_seqs=_ranges(lost),
    )


def _ranges(pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(pub, k) pairs → compact (first, last) ranges of k, for the report."""
    out: list[tuple[int, int]] = []
    for _pub, k in pairs:
        if out and out[-1][1] == k - 1:
            out[-1] = (out[-1][0], k)
        else:
            out.append((k, k))
    return out[:20]


def report(fig: Figures) -> None:
    """Print the FAULT line and append it to the JSON report (KVB_FAULT_REPORT)."""
    print("\n" + fig.line(), flush=True)
    path = os.environ.get("KVB_FAULT_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(asdict(fig)) + "\n")
    _REPORTED.append(fig)


_REPORTED: list[Figures] = []


def reported() -> list[Figures]:
    return list(_REPORTED)


# -- a bridge as a real process -----------------------------------------------


class BridgeProcess:
    """`python -m bridge run` with its log in a file (a pipe nobody reads
    would block the bridge once full)."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> BridgeProcess:
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "bridge", "run", *self.args],
                                         stdout=subprocess.DEVNULL, stderr=log, env=self.env)
        finally:
            log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def logs(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out


def http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def metric_value(text: str, name: str, **labels: str) -> float:
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def wait_http(port: int, path: str = "/readyz", status: int = 200, timeout: float = 30.0) -> None:
    def probe() -> bool:
        try:
            return http_get(f"http://127.0.0.1:{port}{path}", 1.0)[0] == status
        except OSError:
            return False

    with anyio.fail_after(timeout):
        while not await anyio.to_thread.run_sync(probe):
            await anyio.sleep(0.1)


async def wait_metric(port: int, name: str, cond: Callable[[float], bool], timeout: float = 30.0,
                      **labels: str) -> float:
    def read() -> float:
        try:
            return metric_value(http_get(f"http://127.0.0.1:{port}/metrics", 2.0)[1], name, **labels)
        except OSError:
            return float("nan")

    with anyio.fail_after(timeout):
        while True:
            value = await anyio.to_thread.run_sync(read)
            if not math.isnan(value) and cond(value):
                return value
            await anyio.sleep(0.1)


async def wait_until(cond: Callable[[], bool], timeout: float = 20.0, step: float = 0.05) -> None:
    with anyio.fail_after(timeout):
        while not cond():
            await anyio.sleep(step)


async def wait_stable(read: Callable[[], Any], settle: float = 1.0, timeout: float = 30.0) -> Any:
    """Until `read()` (async) stops changing for `settle` seconds."""
    with anyio.fail_after(timeout):
        last = await read()
        since = time.monotonic()
        while time.monotonic() - since < settle:
            await anyio.sleep(0.2)
            now = await read()
            if now != last:
                last, since = now, time.monotonic()
        return last


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def port_free(endpoint: str) -> bool:
    """Whether a new publisher could bind the endpoint's tcp port now."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZMQ binds
        try:
            s.bind(("0.0.0.0", _port(endpoint)))
        except OSError:
            return False
    return True


async def wait_port_free(endpoint: str, timeout: float = 10.0) -> None:
    """ZMQ releases a closed socket's port a moment later (its I/O thread)."""
    await wait_until(lambda: port_free(endpoint), timeout)


def has_peer(endpoint: str) -> bool:
    """Someone holds an established connection to the endpoint's listening port."""
    port = _port(endpoint)
    return any(c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == port
               for c in psutil.net_connections("tcp"))


async def wait_peer(endpoint: str, timeout: float = 10.0) -> None:
    """Until a subscriber (the bridge's SUB, reconnecting) is connected to a
    publisher bound on `endpoint`."""
    with anyio.fail_after(timeout):
        while not await anyio.to_thread.run_sync(has_peer, endpoint):
            await anyio.sleep(0.05)


def soak() -> bool:
    return os.environ.get("KVB_SOAK", "") not in ("", "0")
