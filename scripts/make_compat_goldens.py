#!/usr/bin/env python3
"""Make the compatibility matrix's golden frames: tests/compat/goldens/*.json.

For every vLLM release on PyPI from 0.9.0 to 0.34.0 this script
  1. fetches the release's source distribution from PyPI's simple index (the
     wheel, read by HTTP ranges, where a release has no sdist), keeping only
     `vllm/distributed/kv_events.py` and the two files it reads one definition
     from (`ExternalBlockHash` in kv_cache_utils.py, the default hash form in
     envs.py), in a git-ignored cache (.cache/vllm-sdists/<version>/);
  2. loads that kv_events.py in isolation: the vllm modules it imports (logger,
     config, network helpers) are minimal stand-ins that exist only while the
     file is executed, so the release's OWN msgspec structs and its OWN
     ZmqEventPublisher run, not the vLLM installed in the venv;
  3. runs that publisher for real (pyzmq PUB and ROUTER sockets, read on loopback),
     publishes one fixed scenario, captures the live frames with a SUB socket and
     the raw replay answer (end marker included) with a DEALER socket;
  4. writes, per release and hash form, the frames and the events as the
     release's structs held them (field -> value, only that release's fields,
     hashes tagged so bytes and ints stay apart), plus an index of the matrix.

No vLLM source is kept in the repository: the goldens are the publishers' output.
Remake them with:  .venv/bin/python scripts/make_compat_goldens.py
"""

from __future__ import annotations

import argparse
import ast
import base64
import hashlib
import inspect
import io
import json
import logging
import re
import socket
import sys
import tarfile
import tempfile
import time
import types
import typing
import urllib.request
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "vllm-sdists"
OUT = ROOT / "tests" / "compat" / "goldens"
INDEX_URL = "https://pypi.org/simple/vllm/"
OLDEST, NEWEST = (0, 9, 0), (0, 34, 0)
KV_EVENTS = "vllm/distributed/kv_events.py"
KV_CACHE_UTILS = "vllm/v1/core/kv_cache_utils.py"
ENVS = "vllm/envs.py"
# What the script keeps of each release, besides kv_events.py: the files it reads
# one definition from (the hash type; the default hash form, for the record).
MEMBERS = (KV_EVENTS, KV_CACHE_UTILS, ENVS)
TOPIC = "kv"
DP_RANK = 1


# --------------------------------------------------------------------------- fetch


@dataclass(frozen=True)
class Dist:
    version: str
    filename: str
    url: str
    sha256: str
    size: int


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def _index_files(index_url: str) -> dict[str, list[Dist]]:
    """version -> files of every release in [OLDEST, NEWEST] not yanked, from the
    PEP 691 JSON form of the simple index (the page pip reads)."""
    req = urllib.request.Request(index_url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        listing = json.load(resp)
    out: dict[str, list[Dist]] = {}
    for f in listing["files"]:
        if f.get("yanked"):
            continue
        m = re.match(r"vllm-(\d+(?:\.\d+)+)(?:\.tar\.gz|-.*\.whl)$", f["filename"])
        if not m or not (OLDEST <= version_key(m.group(1)) <= NEWEST):
            continue
        dist = Dist(m.group(1), f["filename"], f["url"], f["hashes"]["sha256"], int(f.get("size") or 0))
        out.setdefault(dist.version, []).append(dist)
    return out


def pick_dist(files: list[Dist]) -> Dist:
    """The sdist; a release without one (0.15.x) gives its smallest wheel, read by ranges."""
    sdists = [d for d in files if d.filename.endswith(".tar.gz")]
    if sdists:
        return sdists[0]
    return min((d for d in files if d.filename.endswith(".whl")), key=lambda d: d.size)


def cached_sources(version: str, dist: Dist | None, cache: Path = CACHE) -> dict[str, str]:
    """The release's member files, from the cache or fetched into it."""
    folder = cache / version
    stamp = folder / "source.json"
    if stamp.exists():
        return {m: (folder / m).read_text() for m in MEMBERS if (folder / m).exists()}
    if dist is None:
        raise SystemExit(f"{version}: not cached and no index listing")
    members = _fetch_sdist(dist) if dist.filename.endswith(".tar.gz") else _fetch_wheel(dist)
    if KV_EVENTS not in members:
        raise SystemExit(f"{version}: {dist.filename} has no {KV_EVENTS}")
    for name, text in members.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    stamp.write_text(json.dumps({"filename": dist.filename, "sha256": dist.sha256}, indent=1))
    return members


def _fetch_sdist(dist: Dist) -> dict[str, str]:
    """Download the whole sdist (its sha256 is checked), keep only MEMBERS."""
    digest = hashlib.sha256()
    with tempfile.TemporaryFile() as tmp:
        with urllib.request.urlopen(dist.url, timeout=300) as resp:
            while chunk := resp.read(1 << 20):
                digest.update(chunk)
                tmp.write(chunk)
        if digest.hexdigest() != dist.sha256:
            raise SystemExit(f"{dist.filename}: sha256 mismatch")
        tmp.seek(0)
        out: dict[str, str] = {}
        with tarfile.open(fileobj=tmp, mode="r:gz") as tar:
            for info in tar:
                name = info.name.split("/", 1)[1] if "/" in info.name else info.name
                if name in MEMBERS and info.isfile():
                    fh = tar.extractfile(info)
                    assert fh is not None
                    out[name] = fh.read().decode()
        return out


class _RangeFile(io.RawIOBase):
    """A remote file read with HTTP range requests, so zipfile can pull one member
    of a wheel of several hundred MB without downloading it."""

    def __init__(self, url: str, size: int) -> None:
        self._url, self._size, self._pos = url, size, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = {0: offset, 1: self._pos + offset, 2: self._size + offset}[whence]
        return self._pos

    def readinto(self, buf: Any) -> int:
        n = min(len(buf), self._size - self._pos)
        if n <= 0:
            return 0
        req = urllib.request.Request(self._url, headers={"Range": f"bytes={self._pos}-{self._pos + n - 1}"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            data = resp.read()
        buf[: len(data)] = data
        self._pos += len(data)
        return len(data)


def _fetch_wheel(dist: Dist) -> dict[str, str]:
    """MEMBERS of a wheel, read by ranges. The index's sha256 covers the whole
    wheel, which is not downloaded; instead zipfile checks each member's CRC and
    each member is checked against the sha256 the wheel's RECORD lists."""
    raw = _RangeFile(dist.url, dist.size)
    with zipfile.ZipFile(io.BufferedReader(raw, buffer_size=1 << 16)) as zf:
        names = set(zf.namelist())
        record_name = next(n for n in names if n.endswith(".dist-info/RECORD"))
        record = {row.split(",")[0]: row.split(",")[1] for row in zf.read(record_name).decode().splitlines() if row}
        out = {}
        for member in MEMBERS:
            if member not in names:
                continue
            data = zf.read(member)
            digest = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            if record.get(member) != digest:
                raise SystemExit(f"{dist.filename}: {member} does not match the wheel's RECORD")
            out[member] = data.decode()
        return out


# --------------------------------------------------------------- load in isolation


def external_hash_type(kv_cache_utils: str | None) -> Any:
    """The release's own `ExternalBlockHash` (e.g. `Union[bytes, int]`), read from
    its kv_cache_utils.py by parsing that one assignment: importing the module
    would pull in torch and half of vLLM."""
    if kv_cache_utils is None:
        return None
    for node in ast.parse(kv_cache_utils).body:
        if isinstance(node, ast.Assign):
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id == "ExternalBlockHash":
            expr = ast.Expression(value)
            return eval(compile(expr, "<ExternalBlockHash>", "eval"), {"Union": typing.Union, "bytes": bytes, "int": int})
    return None


class _KVEventsConfig:
    """Stand-in for vllm.config's KVEventsConfig: newer publishers build one to
    report their resolved endpoints; nothing here reads it back."""

    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)


def _not_here(name: str) -> Callable[..., Any]:
    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        # Only `tcp://*:0` needs the node's IP; the scenario never binds it.
        raise RuntimeError(f"stand-in vllm.utils.network_utils.{name} called")

    return refuse


def _stand_ins(external_hash: Any) -> dict[str, types.ModuleType]:
    """The vllm modules a release's kv_events.py imports, reduced to the names it uses."""
    mods: dict[str, types.ModuleType] = {}
    for name in ("vllm", "vllm.config", "vllm.config.kv_events", "vllm.logger", "vllm.utils",
                 "vllm.utils.network_utils", "vllm.v1", "vllm.v1.core", "vllm.v1.core.kv_cache_utils"):
        mod = types.ModuleType(name)
        mod.__path__ = []  # type: ignore[attr-defined]  # a package, so submodules resolve
        mods[name] = mod
    mods["vllm.config"].KVEventsConfig = _KVEventsConfig  # type: ignore[attr-defined]
    mods["vllm.config.kv_events"].KVEventsConfig = _KVEventsConfig  # type: ignore[attr-defined]
    mods["vllm.logger"].init_logger = logging.getLogger  # type: ignore[attr-defined]
    for fn in ("get_ip", "get_tcp_uri", "is_valid_ipv6_address", "split_zmq_path"):
        setattr(mods["vllm.utils.network_utils"], fn, _not_here(fn))
    mods["vllm.v1.core.kv_cache_utils"].ExternalBlockHash = external_hash  # type: ignore[attr-defined]
    return mods


@contextmanager
def _only_stand_ins(mods: dict[str, types.ModuleType]) -> Iterator[None]:
    """sys.modules sees the stand-ins, never a real vllm, while the file runs."""
    real = {k: v for k, v in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}
    for k in real:
        del sys.modules[k]
    sys.modules.update(mods)
    try:
        yield
    finally:
        for k in mods:
            sys.modules.pop(k, None)
        sys.modules.update(real)


def load_release(version: str, sources: dict[str, str]) -> types.ModuleType:
    """The release's kv_events.py as a module of its own (registered under a
    private name: msgspec resolves the structs' annotations through it)."""
    name = "_vllm_" + version.replace(".", "_") + "_kv_events"
    module = types.ModuleType(name)
    module.__file__ = f"<vllm {version}>/{KV_EVENTS}"
    code = compile(sources[KV_EVENTS], module.__file__, "exec")
    with _only_stand_ins(_stand_ins(external_hash_type(sources.get(KV_CACHE_UTILS)))):
        sys.modules[name] = module
        exec(code, module.__dict__)
    return module


# ------------------------------------------------------------------- the scenario

# Hashes by role, per form. Before 0.10.2 vLLM published Python hash() values
# (signed 64-bit, often negative); from 0.10.2 the low 64 bits of the digest as
# an unsigned int (values >= 2**63 are common) or the 32-byte digest itself.
_SIGNED = [-(2**63), -1, -7_046_029_254_386_353_131, 0, 2**63 - 1, 3_123_456_789_012_345_678]
_UNSIGNED = [2**64 - 1, 2**63, 0x9E37_79B9_7F4A_7C15, 1, 2**63 - 1, 0x0123_4567_89AB_CDEF]
_DIGESTS = [hashlib.sha256(f"kv-bridge compat block {i}".encode()).digest() for i in range(6)]
HASHES: dict[str, list[Any]] = {"signed-int": _SIGNED, "uint64": _UNSIGNED, "bytes32": _DIGESTS}
BLOCK = 4
TS0 = 1_750_000_000.0


def _tokens(first: int, n_blocks: int) -> list[int]:
    # Ids past 2**16 too, so msgpack's wider int forms are on the wire.
    return [first + 7919 * i for i in range(n_blocks * BLOCK)]


def _stored(hashes: list[int], parent: int | None, n_tokens_blocks: int, group: int, kind: str, **more: Any) -> dict[str, Any]:
    ev: dict[str, Any] = {
        "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
        "token_ids": _tokens(100 + 13 * hashes[0], n_tokens_blocks), "block_size": BLOCK, "lora_id": None,
        "medium": "GPU", "lora_name": None, "extra_keys": None, "group_idx": group, "kv_cache_spec_kind": kind,
        "kv_cache_spec_sliding_window": None, "locality": None, "ownership": None, "session_id": None,
        "lookahead_token_ids": None,
    }
    ev.update(more)
    return ev


def _removed(hashes: list[int], group: int, **more: Any) -> dict[str, Any]:
    ev: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": group,
                          "locality": None, "ownership": None}
    ev.update(more)
    return ev


def scenario() -> list[list[dict[str, Any]]]:
    """Five batches of a hybrid model (attention g0, sliding window g1, mamba g2),
    every field vLLM has ever sent, hashes as indices into HASHES. A release keeps
    the fields it has; a release without groups sends everything as its one group."""
    return [
        [
            _stored([0, 1, 2], None, 3, 0, "full_attention", session_id="req-1", locality="LOCAL"),
            _stored([1, 2], 0, 2, 1, "sliding_window", kv_cache_spec_sliding_window=2 * BLOCK),
            # a GPU mamba checkpoint: one hash, no token ids
            {**_stored([2], 1, 0, 2, "mamba"), "token_ids": []},
        ],
        [
            _stored([3], 2, 1, 0, "full_attention", lora_id=3, lora_name="adapter-a",
                    extra_keys=[("adapter-a", "salt-1")], lookahead_token_ids=[[5, 6]], session_id="req-2"),
            _removed([0], 0),
            _removed([1], 1),
        ],
        [
            # the offload tier: a copy on CPU owned by a secondary tier
            _stored([0, 1], None, 2, 0, "full_attention", medium="CPU", locality="REMOTE", ownership="tier-1"),
            _removed([0, 1], 0, medium="CPU", ownership="tier-1"),
        ],
        [_removed([2], 2), {"type": "AllBlocksCleared"}],
        [_stored([4, 5], None, 2, 0, "full_attention")],
    ]


@dataclass
class Release:
    version: str
    module: types.ModuleType
    stored_fields: tuple[str, ...]
    removed_fields: tuple[str, ...]
    batch_fields: tuple[str, ...]
    array_like: bool
    hash_forms: list[str]
    has_dp_rank: bool


def describe(version: str, module: types.ModuleType) -> Release:
    """What the release's own structs say about its wire."""
    stored: Any = msgspec.inspect.type_info(module.BlockStored)
    hash_type = next(f.type for f in stored.fields if f.name == "block_hashes").item_type
    members = hash_type.types if isinstance(hash_type, msgspec.inspect.UnionType) else (hash_type,)
    kinds = {type(t).__name__ for t in members}
    forms = (["uint64"] if "IntType" in kinds else []) + (["bytes32"] if "BytesType" in kinds else [])
    if forms == ["uint64"] and version_key(version) < (0, 10, 2):
        forms = ["signed-int"]  # list[int] of Python hash() values
    return Release(
        version=version,
        module=module,
        stored_fields=module.BlockStored.__struct_fields__,
        removed_fields=module.BlockRemoved.__struct_fields__,
        batch_fields=module.KVEventBatch.__struct_fields__,
        array_like=bool(module.KVCacheEvent.__struct_config__.array_like),
        hash_forms=forms,
        has_dp_rank="data_parallel_rank" in module.KVEventBatch.__struct_fields__,
    )


def build_batches(rel: Release, form: str) -> list[Any]:
    """The scenario as the release's own KVEventBatch objects: each event keeps
    only the fields its class has."""
    table = HASHES[form]
    out = []
    for i, events in enumerate(scenario()):
        objs = []
        for spec in events:
            cls = getattr(rel.module, spec["type"])
            kwargs: dict[str, Any] = {k: v for k, v in spec.items() if k in cls.__struct_fields__}
            if "block_hashes" in kwargs:
                kwargs["block_hashes"] = [table[h] for h in kwargs["block_hashes"]]
            if kwargs.get("parent_block_hash") is not None:
                kwargs["parent_block_hash"] = table[kwargs["parent_block_hash"]]
            objs.append(cls(**kwargs))
        # data_parallel_rank left unset: the release's publisher stamps its own rank.
        out.append(rel.module.KVEventBatch(ts=TS0 + 0.25 * i, events=objs))
    return out


# ------------------------------------------------------------ run the publisher


@dataclass
class Capture:
    live: list[list[bytes]] = field(default_factory=list)
    replay: list[list[bytes]] = field(default_factory=list)
    endpoint: str = ""
    replay_endpoint: str = ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_connected(monitor: zmq.Socket[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if monitor.poll(100):
            if recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return
    raise TimeoutError("the release's PUB never connected")


def _recv_until(sock: zmq.Socket[bytes], done: Callable[[list[list[bytes]]], bool], timeout_s: float) -> list[list[bytes]]:
    got: list[list[bytes]] = []
    deadline = time.monotonic() + timeout_s
    while not done(got):
        left = deadline - time.monotonic()
        if left <= 0 or not sock.poll(int(left * 1000) + 1):
            raise TimeoutError(f"got {len(got)} messages")
        got.append(sock.recv_multipart())
    return got


def run_publisher(rel: Release, batches: list[Any]) -> Capture:
    """The release's ZmqEventPublisher, for real, configured the way vLLM is
    deployed: both endpoints wildcard (`tcp://*:PORT`), so it binds them, and
    with a data-parallel rank it offsets both ports itself; we connect on
    loopback to the endpoints it reports. (A host endpoint would make its PUB
    connect to our SUB instead, and a PUB that connects learns a subscription
    only when next used: the first batch would be lost.)"""
    ctx = zmq.Context()
    kwargs: dict[str, Any] = {
        "endpoint": f"tcp://*:{_free_port()}",
        "replay_endpoint": f"tcp://*:{_free_port()}",
        "topic": TOPIC,
    }
    if "data_parallel_rank" in inspect.signature(rel.module.ZmqEventPublisher).parameters:
        kwargs["data_parallel_rank"] = DP_RANK
    pub = rel.module.ZmqEventPublisher(**kwargs)
    cap = Capture(endpoint=_loopback(pub._endpoint), replay_endpoint=_loopback(pub._replay_endpoint))
    sub = ctx.socket(zmq.SUB)
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    dealer = ctx.socket(zmq.DEALER)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(cap.endpoint)
        _wait_connected(monitor, 10.0)
        time.sleep(0.3)  # the subscription travels after the handshake
        for batch in batches:
            pub.publish(batch)
        cap.live = _recv_until(sub, lambda got: len(got) == len(batches), 5.0)
        dealer.connect(cap.replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        cap.replay = _recv_until(dealer, lambda got: bool(got) and got[-1][-2] == b"\xff" * 8, 5.0)
    finally:
        pub.shutdown()
        sub.disable_monitor()
        for s in (monitor, sub, dealer):
            s.close(linger=0)
        ctx.term()
    return cap


def _loopback(endpoint: str) -> str:
    return endpoint.replace("tcp://*:", "tcp://127.0.0.1:")


# ------------------------------------------------------------------ the goldens

HASH_FIELDS = ("block_hashes", "parent_block_hash")


def tag_hash(value: Any) -> Any:
    """Tagged so JSON keeps bytes and ints apart: {"bytes": hex} or {"int": n}."""
    if value is None:
        return None
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    return {"int": value}


def plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, bytes):
        raise TypeError("bytes outside a hash field")
    return value


def neutral_event(event: Any) -> dict[str, Any]:
    """field name -> value, every field the release's class has, in its order."""
    out: dict[str, Any] = {"type": type(event).__name__}
    for name in type(event).__struct_fields__:
        value = getattr(event, name)
        if name == "block_hashes":
            out[name] = [tag_hash(h) for h in value]
        elif name == "parent_block_hash":
            out[name] = tag_hash(value)
        else:
            out[name] = plain(value)
    return out


def neutral_batch(batch: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"ts": batch.ts, "events": [neutral_event(e) for e in batch.events]}
    if "data_parallel_rank" in type(batch).__struct_fields__:
        out["data_parallel_rank"] = batch.data_parallel_rank
    return out


def b64(frames: list[bytes]) -> list[str]:
    return [base64.b64encode(f).decode() for f in frames]


class Disagreement(Exception):
    """What the release did is not what its structs or our notes say."""


def check_capture(rel: Release, batches: list[Any], cap: Capture) -> dict[str, Any]:
    """The facts the frames show, each checked against the release's structs."""
    n = len(batches)
    facts: dict[str, Any] = {}
    decode = msgspec.msgpack.Decoder(rel.module.KVEventBatch)
    for i, (frames, batch) in enumerate(zip(cap.live, batches)):
        topic, seq, payload = frames
        if topic != TOPIC.encode() or seq != i.to_bytes(8, "big"):
            raise Disagreement(f"live frame {i}: topic {topic!r} seq {seq.hex()}")
        if decode.decode(payload) != batch:
            raise Disagreement(f"live payload {i} does not decode back to what was published")
        generic = msgspec.msgpack.decode(payload)
        if not isinstance(generic, list):
            raise Disagreement("batch is not a msgpack array")
        encoding = "array" if isinstance(generic[1][0], list) else "map"
        if facts.setdefault("event_encoding", encoding) != encoding:
            raise Disagreement("mixed event encodings")
    if (facts["event_encoding"] == "array") != rel.array_like:
        raise Disagreement("event encoding differs from the struct's array_like")
    *data, end = cap.replay
    shapes = {len(f) for f in data}
    if len(data) != n or len(shapes) != 1:
        raise Disagreement(f"replay answered {len(data)} batches, shapes {shapes}")
    layout = {3: "no-topic", 4: "topic"}[shapes.pop()]
    for i, (frames, live) in enumerate(zip(data, cap.live)):
        if frames[0] != b"" or frames[-2] != i.to_bytes(8, "big") or frames[-1] != live[2]:
            raise Disagreement(f"replay frame {i} differs from the live one")
        if layout == "topic" and frames[1] != TOPIC.encode():
            raise Disagreement(f"replay topic {frames[1]!r}")
    expected_end = [b"", b"\xff" * 8, b""] if layout == "no-topic" else [b"", b"", b"\xff" * 8, b""]
    if end != expected_end:
        raise Disagreement(f"replay end marker {end!r}")
    facts["replay_layout"] = layout
    facts["data_parallel_rank"] = getattr(batches[0], "data_parallel_rank", None)
    return facts


def default_hash_form(version: str, envs: str | None) -> str:
    """What a release sends unless told otherwise, from its envs.py."""
    if version_key(version) < (0, 10, 2):
        return "signed-int"
    m = re.search(r'getenv\(\s*"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES",\s*"(\d)"\s*\)', envs or "")
    if not m:
        raise Disagreement(f"{version}: no VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES default in envs.py")
    return "uint64" if m.group(1) == "1" else "bytes32"


def golden(rel: Release, form: str, source: dict[str, str], batches: list[Any], cap: Capture,
           facts: dict[str, Any]) -> dict[str, Any]:
    return {
        "version": rel.version,
        "hash_form": form,
        "source": source,
        "event_encoding": facts["event_encoding"],
        "replay_layout": facts["replay_layout"],
        "topic": TOPIC,
        "fields": {
            "KVEventBatch": list(rel.batch_fields),
            "BlockStored": list(rel.stored_fields),
            "BlockRemoved": list(rel.removed_fields),
        },
        "batches": [neutral_batch(b) for b in batches],
        "live": [b64(f) for f in cap.live],
        "replay_start_seq": 0,
        "replay": [b64(f) for f in cap.replay],
    }


def make_release(version: str, dist: Dist | None, cache: Path, attempts: int = 3) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    sources = cached_sources(version, dist, cache)
    stamp = json.loads((cache / version / "source.json").read_text())
    module = load_release(version, sources)
    rel = describe(version, module)
    goldens = []
    facts: dict[str, Any] = {}
    for form in rel.hash_forms:
        for _ in range(attempts):
            batches = build_batches(rel, form)
            try:
                cap = run_publisher(rel, batches)
                break
            except (TimeoutError, zmq.ZMQError) as exc:
                # a port taken between choosing and binding, or a slow start
                print(f"  {version} {form}: {exc}; again", file=sys.stderr)
        else:
            raise SystemExit(f"{version} {form}: no capture after {attempts} attempts")
        facts = check_capture(rel, batches, cap)
        goldens.append(golden(rel, form, stamp, batches, cap, facts))
    entry = {
        "version": version,
        "source": stamp["filename"],
        "sha256": stamp["sha256"],
        "event_encoding": facts["event_encoding"],
        "batch_fields": list(rel.batch_fields),
        "hash_forms": rel.hash_forms,
        "default_hash_form": default_hash_form(version, sources.get(ENVS)),
        "replay_layout": facts["replay_layout"],
        "data_parallel_rank": facts["data_parallel_rank"],
        "stored_fields": list(rel.stored_fields),
        "removed_fields": list(rel.removed_fields),
        "goldens": [golden_name(version, form) for form in rel.hash_forms],
    }
    return entry, goldens


def golden_name(version: str, form: str) -> str:
    return f"vllm-{version}-{form}.json"


def write_json(path: Path, obj: Any) -> None:
    # One line per frame and per event keeps diffs readable without padding bytes.
    text = json.dumps(obj, indent=1, separators=(",", ":"))
    text = re.sub(r"\n\s+(?=[^\[{\s])", "", text)  # scalars stay on their container's line
    text = re.sub(r"\n\s*(?=[\]}])", "", text)
    path.write_text(text + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--index-url", default=INDEX_URL, help="PEP 691 JSON simple index page of vllm")
    ap.add_argument("--offline", action="store_true", help="use only what the cache holds")
    ap.add_argument("--cache", type=Path, default=CACHE, help=f"where the releases' files are kept (default {CACHE})")
    ap.add_argument("--only", nargs="*", help="these versions only (the index is rewritten for them)")
    args = ap.parse_args(argv)
    started = time.monotonic()
    if args.offline:
        files: dict[str, list[Dist]] = {v.name: [] for v in args.cache.iterdir() if (v / "source.json").exists()}
    else:
        files = _index_files(args.index_url)
    versions = sorted(args.only or files, key=version_key)
    OUT.mkdir(parents=True, exist_ok=True)
    entries = []
    for version in versions:
        t = time.monotonic()
        dist = pick_dist(files[version]) if files.get(version) else None
        entry, goldens = make_release(version, dist, args.cache)
        for g in goldens:
            write_json(OUT / golden_name(version, g["hash_form"]), g)
        entries.append(entry)
        print(f"{version:9} {entry['event_encoding']:5} {'+'.join(entry['hash_forms']):17} "
              f"replay {entry['replay_layout']:8} dp={entry['data_parallel_rank']} ({time.monotonic() - t:.1f}s)")
    if not args.only:
        for stale in set(OUT.glob("vllm-*.json")) - {OUT / n for e in entries for n in e["goldens"]}:
            stale.unlink()
        write_json(OUT / "index.json", {"made_by": "scripts/make_compat_goldens.py", "topic": TOPIC,
                                        "dp_rank": DP_RANK, "releases": entries})
    print(f"{len(entries)} releases in {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
