"""Hostile amplification: `kv-bridge run` as a real process takes frames up to
the default `--max-frame-bytes`, each made to cost the bridge as much memory as
its bytes allow, and stays under the chart's 512 Mi limit, up, and delivering.

Each case runs a fresh bridge, so the kernel's high-water mark (VmHWM) is that
frame's peak, start-up included; RSS is also sampled while it works, for the
figures the test prints (`-s`)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import msgspec
import nats
import pytest

from bridge.apps.demo.publisher import WirePublisher
from bridge.apps.demo.wire_writer import encode_batch, stored
from bridge.client.codec import BusCodec
from bridge.contract import HDR_RECORD, HDR_SEQ, WorkerRecord
from bridge.producer.config import DEFAULT_MAX_FRAME_BYTES
from bridge.runtime.nats_barrier import flushed
from bridge.runtime.nats_server import NatsServerProcess
from bridge.runtime.ports import free_port
from tests.busutil import endpoints

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/status"),
]

MAX_FRAME = DEFAULT_MAX_FRAME_BYTES["msgpack"]
RSS_LIMIT = 512 * 1024 * 1024  # helm/kv-bridge/values.yaml: resources.limits.memory
enc = msgspec.msgpack.encode
TS = enc(1796000000.5)


def _fill(limit: int, unit: bytes, per_unit: int = 1) -> bytes:
    """A batch `[ts, [unit, unit, ...]]` as close to `limit` as fits; `unit`
    is `per_unit` encoded events."""
    n = (limit - 64) // len(unit)
    return b"\x92" + TS + b"\xdd" + (n * per_unit).to_bytes(4, "big") + unit * n


def _one_event(limit: int, fields: dict[str, Any], name: str, element: bytes) -> bytes:
    """One event whose list field `name` holds as many `element`s as fit."""
    others = {k: v for k, v in fields.items() if k != name}
    head = enc({**others, name: []})[:-1]  # the map with `name` last, its empty list cut off
    n = (limit - len(head) - 64) // len(element)
    event = head + b"\xdd" + n.to_bytes(4, "big") + element * n
    return b"\x92" + TS + b"\x91" + event


def _distinct(limit: int, make: Callable[[int], bytes], per_unit: int = 1) -> bytes:
    """As many distinct units `make(i)` (each `per_unit` encoded events) as fit."""
    parts: list[bytes] = []
    size = 0
    while True:
        unit = make(len(parts))
        if size + len(unit) > limit - 64:
            break
        parts.append(unit)
        size += len(unit)
    return b"\x92" + TS + b"\xdd" + (len(parts) * per_unit).to_bytes(4, "big") + b"".join(parts)


CLEAR_MAP = enc({"type": "AllBlocksCleared"})
TINY_STORE = enc({"type": "BlockStored", "block_hashes": [], "parent_block_hash": None, "token_ids": [],
                  "block_size": 0, "lora_id": None, "medium": None, "lora_name": None})
STORE = {"type": "BlockStored", "block_hashes": [b"h" * 32], "parent_block_hash": None, "token_ids": [1],
         "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0,
         "kv_cache_spec_kind": "full_attention"}
REMOVAL = {"type": "BlockRemoved", "medium": "GPU", "group_idx": 0}

# name: (payload builder, the gap reason its batch must get, or None)
FRAMES: dict[str, tuple[Callable[[int], bytes], str | None]] = {
    "clears": (lambda n: _fill(n, CLEAR_MAP), None),
    "clears_as_arrays": (lambda n: _fill(n, enc(["AllBlocksCleared"])), None),
    "store_clear_alternating": (lambda n: _fill(n, enc(["BlockStored", [b"c"], None, [], 16, None, "GPU"]) + CLEAR_MAP, 2),
                                "malformed"),
    # as many stores as the frame holds (fewer than a batch may hold)
    "tiny_stores_one_group": (lambda n: _fill(n, TINY_STORE), None),
    # more stores than a batch may hold: the tail is cut off
    "tiny_array_stores_one_group": (lambda n: _fill(n, enc(["BlockStored", []])), "malformed"),
    "tiny_array_removals_one_group": (lambda n: _fill(n, enc(["BlockRemoved", [], None, 0])), "malformed"),
    # group ids 0, 1, 2, ...: 256 slices, then the rest cut off (or absurd ids)
    "tiny_stores_new_groups": (lambda n: _distinct(n, lambda i: enc(["BlockStored", [], None, [], 0, None, None, None, None, i])),
                               "malformed"),
    # the slice's kind is cleaned to `unknown`; the event keeps vLLM's word, too long for one NATS message
    "stores_huge_distinct_kinds": (lambda n: _distinct(n, lambda i: enc(
        {**STORE, "group_idx": i, "kv_cache_spec_kind": f"{i}:" + "k" * (1 << 20)})), "unpublishable"),
    "stores_many_distinct_kinds": (lambda n: _distinct(n, lambda i: enc(
        {**STORE, "group_idx": i % 1024, "kv_cache_spec_kind": f"kind_{i:08d}_" + "x" * 30}) + CLEAR_MAP, 2),
        "malformed"),
    "removal_u64_hashes": (lambda n: _one_event(n, REMOVAL, "block_hashes", b"\xcf" + (2**63 + 12345).to_bytes(8, "big")),
                           "unpublishable"),
    "removal_short_byte_hashes": (lambda n: _one_event(n, REMOVAL, "block_hashes", b"\xc4\x02ab"), "unpublishable"),
    "removals_with_digests": (lambda n: _fill(n, enc({**REMOVAL, "block_hashes": [b"d" * 32] * 64})), None),
    "store_many_tokens": (lambda n: _one_event(n, STORE, "token_ids", b"\xcd\x12\x34"), "unpublishable"),
}

# Amplified by decoding (one byte on the wire, one Python object of 32-64 bytes
# once decoded), bounded by what the relay keeps undecoded and by the frame limit.
FRAMES |= {
    "removal_uncached_small_int_hashes": (lambda n: _one_event(n, REMOVAL, "block_hashes", b"\xf9"),  # -7
                                          "unpublishable"),
    "store_extra_keys_of_empty_arrays": (lambda n: _one_event(n, STORE, "extra_keys", b"\x90"), "unpublishable"),
    "store_lookahead_of_empty_arrays": (lambda n: _one_event(n, STORE, "lookahead_token_ids", b"\x90"),
                                        "unpublishable"),
    "store_uncached_small_int_tokens": (lambda n: _one_event(n, STORE, "token_ids", b"\xf9"), "unpublishable"),
}
# JSON output decodes every field (msgpack relays token ids, extra keys and
# lookahead token ids as bytes) and writes numbers as text.
JSON_FRAMES = ("store_many_tokens", "removal_u64_hashes", "tiny_array_stores_one_group",
               "removal_uncached_small_int_hashes", "store_extra_keys_of_empty_arrays",
               "store_lookahead_of_empty_arrays", "store_uncached_small_int_tokens")


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def _metric(port: int, name: str) -> float | None:
    """None while the bridge is too busy with a frame to answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@contextmanager
def _sampled(pid: int) -> Iterator[list[int]]:
    """RSS (bytes) sampled every 10 ms while the block runs."""
    samples: list[int] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            try:
                samples.append(_status_kib(pid, "VmRSS") * 1024)
            except (OSError, AssertionError):
                return
            done.wait(0.01)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        done.set()
        thread.join()


class _Bus:
    """Only what the test reads: gap records and the good batch's seq. The
    hostile batches' own messages are large and skipped undecoded."""

    def __init__(self) -> None:
        self.gaps: dict[int, str | None] = {}
        self.seqs: set[int] = set()
        self.nc: Any = None

    async def start(self, url: str) -> _Bus:
        self.nc = await nats.connect(url, pending_size=512 * 1024 * 1024)
        await self.nc.subscribe("kv.hostile.>", cb=self._on_msg)
        await flushed(self.nc)
        return self

    async def _on_msg(self, msg: Any) -> None:
        headers = msg.headers or {}
        if headers.get(HDR_RECORD) == "gap":
            rec = BusCodec().decode(msg.subject, headers, msg.data)
            assert isinstance(rec, WorkerRecord) and rec.gap_from is not None
            self.gaps[rec.gap_from] = rec.reason
        elif HDR_SEQ in headers and HDR_RECORD not in headers:
            self.seqs.add(int(headers[HDR_SEQ]))


async def _run_bridge(nats_server: NatsServerProcess, payloads: list[bytes], fmt: str = "msgpack") -> dict[str, Any]:
    """Sends `payloads` one at a time (each handled before the next), then a
    good batch. Returns the peak RSS figures, gaps by seq and whether the good
    batch arrived with the bridge still up."""
    pub_ep, _ = endpoints()
    http = free_port()
    pub = WirePublisher(pub_ep.replace("127.0.0.1", "*"), None)
    bus = await _Bus().start(nats_server.url)
    proc = subprocess.Popen(
        [sys.executable, "-m", "bridge", "run", "--zmq-endpoint", pub_ep, "--nats-url", nats_server.url,
         "--http-port", str(http), "--http-host", "127.0.0.1", "--worker-id", "hostile", "--idle-probe-interval", "0",
         "--log-level", "warning", "--format", fmt,
         "--prompt-data", "relay"],  # the frames' token ids, extra keys and lookaheads travel on, as sent
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy(),
    )
    try:
        await anyio.to_thread.run_sync(_wait_ready, http)
        await anyio.sleep(0.5)  # the SUB is connected: nothing is lost to the slow joiner
        idle_rss = _status_kib(proc.pid, "VmRSS") * 1024
        with _sampled(proc.pid) as samples:
            for sent, payload in enumerate(payloads, start=1):
                pub.publish(payload)
                await anyio.to_thread.run_sync(_wait_handled, http, sent, proc)
            good_seq = len(payloads)
            pub.publish(encode_batch(time.time(), [stored([b"g" * 32], None, [1, 2], 16, group_idx=0,
                                                         kind="full_attention")]))
            with anyio.fail_after(60):
                while good_seq not in bus.seqs:
                    await anyio.sleep(0.05)
        return {
            "idle": idle_rss, "sampled": max(samples, default=0), "hwm": _status_kib(proc.pid, "VmHWM") * 1024,
            "gaps": dict(bus.gaps), "alive": proc.poll() is None,
        }
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        pub.close()
        await bus.nc.close()


def _wait_ready(port: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError("the bridge never became ready")


def _wait_handled(port: int, batches: int, proc: subprocess.Popen[bytes]) -> None:
    """Until the bridge took `batches` off ZMQ and its queue to NATS is empty."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the bridge died"
        taken = _metric(port, "kvbridge_batches_in_total")
        if taken is not None and taken >= batches and _metric(port, "kvbridge_queue_depth") == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"the bridge did not handle batch {batches - 1}")


def _report(name: str, sizes: list[int], got: dict[str, Any]) -> None:
    mib = 1024 * 1024
    print(f"\n{name}: {len(sizes)} frame(s) of {max(sizes) / mib:.1f} MiB: RSS idle {got['idle'] / mib:.0f} MiB, "
          f"sampled peak {got['sampled'] / mib:.0f} MiB, VmHWM {got['hwm'] / mib:.0f} MiB")


@pytest.mark.parametrize("name", sorted(FRAMES))
async def test_one_hostile_frame_stays_under_the_memory_limit(nats_server: NatsServerProcess, name: str) -> None:
    build, reason = FRAMES[name]
    payload = build(MAX_FRAME)
    assert len(payload) <= MAX_FRAME
    # twice: what the first one left behind must not add up
    got = await _run_bridge(nats_server, [payload, payload])
    _report(name, [len(payload)] * 2, got)
    assert got["alive"]
    assert got["hwm"] < RSS_LIMIT
    # every batch accounted for: published, or named by a gap with its reason
    assert got["gaps"] == ({0: reason, 1: reason} if reason else {})


@pytest.mark.parametrize("name", JSON_FRAMES)
async def test_a_json_bridge_stays_under_the_memory_limit(nats_server: NatsServerProcess, name: str) -> None:
    build, reason = FRAMES[name]
    limit = DEFAULT_MAX_FRAME_BYTES["json"]
    payload = build(limit)
    assert len(payload) <= limit
    got = await _run_bridge(nats_server, [payload], "json")
    _report(f"{name} (json)", [len(payload)], got)
    assert got["alive"] and got["hwm"] < RSS_LIMIT
    assert got["gaps"] == ({0: reason} if reason else {})


async def test_a_frame_past_the_socket_limit_is_never_read(nats_server: NatsServerProcess) -> None:
    """A frame far over `--max-frame-bytes` (here 128 MiB) is cut off by libzmq
    before it is read into memory: the publisher is disconnected, the SUB
    reconnects, the lost seq is named by a gap when the next batch comes."""
    pub_ep, _ = endpoints()
    http = free_port()
    pub = WirePublisher(pub_ep.replace("127.0.0.1", "*"), None)
    bus = await _Bus().start(nats_server.url)
    proc = subprocess.Popen(
        [sys.executable, "-m", "bridge", "run", "--zmq-endpoint", pub_ep, "--nats-url", nats_server.url,
         "--http-port", str(http), "--http-host", "127.0.0.1", "--worker-id", "hostile", "--idle-probe-interval", "0",
         "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy(),
    )
    try:
        await anyio.to_thread.run_sync(_wait_ready, http)
        await anyio.sleep(0.5)
        huge = b"\x92" + TS + b"\x91" + b"\xc6" + (128 << 20).to_bytes(4, "big") + bytes(128 << 20)
        with _sampled(proc.pid) as samples:
            pub.publish(huge)
            del huge
            good = encode_batch(time.time(), [stored([b"g" * 32], None, [1], 16, group_idx=0, kind="full_attention")])
            with anyio.fail_after(30):
                while not bus.seqs:  # sent again until the reconnected SUB takes one
                    await anyio.sleep(0.5)
                    pub.publish(good)
        assert proc.poll() is None
        assert max(samples) < 128 * 1024 * 1024, f"the frame was read: RSS {max(samples) >> 20} MiB"
        assert bus.gaps.get(0) == "no_replay_endpoint"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        pub.close()
        await bus.nc.close()
