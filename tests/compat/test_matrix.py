"""The compatibility matrix: what every vLLM release from 0.9.0 to 0.34.0 put on
the wire (tests/compat/goldens, made by scripts/make_compat_goldens.py from each
release's own publisher) goes through the bridge's real code.

- every golden decodes, nothing rejected, every field as the release sent it;
- replay answers of both layouts (no topic frame through 0.25.1, topic from 0.26.0)
  through the bridge's ReplayClient against a real ROUTER;
- the whole path (golden PUB -> the bridge -> nats-server -> a subscriber) for the
  oldest release, two array releases and the newest, in msgpack and JSON, and
  every relayed event read back with vLLM 0.33.0's own structs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Union

import anyio
import msgspec
import pytest
import zmq

from bridge.contract import AllBlocksCleared, BlockRemoved, BlockStored, GroupMessage, WorkerRecord
from bridge.producer.decode.decoder import BatchDecoder
from bridge.producer.decode.wire import RelayBlockStored
from bridge.producer.source.frames import END_SEQ, parse_pub, parse_replay
from bridge.producer.source.replay import ReplayClient
from bridge.producer.telemetry.metrics import MALFORMED_REASONS
from bridge.runtime.nats_server import NatsServerProcess
from bridge.runtime.ports import free_port, free_port_run
from tests.busutil import BusCollector, Received, make_settings, metric, running_bridge
from tests.compat.goldens import END, Golden, all_names, find, index, load, sent_value, token_ids, version_key

MAX_FRAME = 1 << 20

# ------------------------------------------------------------------ the matrix


def test_the_matrix_holds_every_release_from_0_9_0_to_0_34_0() -> None:
    versions = [r["version"] for r in index()["releases"]]
    assert len(versions) == 44
    assert versions == sorted(versions, key=version_key)
    assert versions[0] == "0.9.0" and versions[-1] == "0.34.0"
    # the point releases PyPI has are in, as releases of their own
    assert {"0.9.0.1", "0.10.1.1", "0.15.0", "0.15.1"} <= set(versions)
    for release in index()["releases"]:
        assert release["goldens"], release["version"]
        for name in release["goldens"]:
            assert load(name).version == release["version"]


def test_each_release_sends_what_the_design_says() -> None:
    """DESIGN.md §1's release facts, against what each release's publisher did."""
    wrong = []
    for r in index()["releases"]:
        v = version_key(r["version"])
        want = {
            "event_encoding": "array" if v < (0, 24) else "map",
            "replay_layout": "no-topic" if v < (0, 26) else "topic",
            "hash_forms": ["signed-int"] if v < (0, 10, 2) else ["uint64", "bytes32"],
            "default_hash_form": "signed-int" if v < (0, 10, 2) else "uint64",
            "data_parallel_rank": None if v < (0, 9, 1) else 1,
            "has group_idx": v >= (0, 20),
            "has kinds": v >= (0, 22),
            "has medium": v >= (0, 10, 2),
        }
        got = {key: r.get(key) for key in want}
        got["has group_idx"] = "group_idx" in r["stored_fields"] and "group_idx" in r["removed_fields"]
        got["has kinds"] = "kv_cache_spec_kind" in r["stored_fields"]
        got["has medium"] = "medium" in r["stored_fields"] and "medium" in r["removed_fields"]
        wrong += [f"{r['version']} {key}: {got[key]!r}, not {want[key]!r}" for key in want if got[key] != want[key]]
    assert wrong == []


# --------------------------------------------------------------------- decoding


def _bridge_class(event_type: str, relay: bool) -> type:
    return {
        "BlockStored": RelayBlockStored if relay else BlockStored,
        "BlockRemoved": BlockRemoved,
        "AllBlocksCleared": AllBlocksCleared,
    }[event_type]


def _plain(value: Any) -> Any:
    """Tuples (how vLLM's structs type extra_keys) compare as the lists msgpack has."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def event_mismatches(got: Any, sent: dict[str, Any]) -> list[str]:
    """Every field `sent` names, compared; every field the release did not have is the default."""
    out = []
    for name, value in sent.items():
        if name == "type":
            continue
        have = token_ids(getattr(got, name, "<missing>"))
        if _plain(have) != _plain(sent_value(name, value)):
            out.append(f"{sent['type']}.{name}: got {have!r}, sent {sent_value(name, value)!r}")
    for f in msgspec.structs.fields(type(got)):
        # what vLLM itself takes for a field an older release never sent
        absent = None if f.default is msgspec.NODEFAULT else f.default
        if f.name not in sent and getattr(got, f.name) != absent:
            out.append(f"{sent['type']}.{f.name}: {getattr(got, f.name)!r} for a field the release lacks")
    return out


@pytest.mark.parametrize("relay", [False, True], ids=["decoded", "relay"])
@pytest.mark.parametrize("name", all_names())
def test_every_golden_decodes_as_sent(name: str, relay: bool) -> None:
    golden = load(name)
    decoder = BatchDecoder(relay=relay)
    problems: list[str] = []
    for seq, (frames, sent) in enumerate(zip(golden.live, golden.batches, strict=True)):
        frame = parse_pub(frames, MAX_FRAME)
        assert (frame.topic, frame.seq) == (golden.topic.encode(), seq)
        batch = decoder.decode(frame.payload)
        assert batch.rejected == [], f"seq {seq}: {batch.rejected}"
        assert (batch.ts, batch.dp_rank) == (sent["ts"], sent.get("data_parallel_rank"))
        assert [type(e) for e in batch.events] == [_bridge_class(e["type"], relay) for e in sent["events"]]
        for got, want in zip(batch.events, sent["events"]):
            problems += [f"seq {seq} {p}" for p in event_mismatches(got, want)]
    assert problems == []


@pytest.mark.parametrize("name", all_names())
def test_every_replay_answer_parses_in_its_layout(name: str) -> None:
    golden = load(name)
    frames = [parse_replay(parts, MAX_FRAME) for parts in golden.replay]
    assert frames[-1].seq == END_SEQ
    data = frames[:-1]
    assert [f.seq for f in data] == list(range(len(golden.live)))
    assert [f.payload for f in data] == golden.payloads
    assert {f.topic for f in data} == {b"" if golden.replay_layout == "no-topic" else golden.topic.encode()}


# ----------------------------------------------------------------------- replay


class GoldenRouter:
    """A replay ROUTER that answers as the golden's release did: the buffered
    batches with seq >= the one asked for, then the end marker, in its layout.
    `golden=None` stands for a publisher with an empty buffer."""

    def __init__(self, endpoint: str, golden: Golden | None, layout: str) -> None:
        self._endpoint = endpoint
        self._data = golden.replay[:-1] if golden else []
        self._end = golden.replay[-1] if golden else ([b"", END, b""] if layout == "no-topic" else [b"", b"", END, b""])
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._error: BaseException | None = None
        self.requests: list[int] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> GoldenRouter:
        self._thread.start()
        if not self._bound.wait(5) or self._error is not None:
            raise RuntimeError(f"replay router did not bind: {self._error}")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _serve(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        try:
            sock.bind(self._endpoint)
        except zmq.ZMQError as exc:
            self._error = exc
            self._bound.set()
            sock.close(linger=0)
            ctx.term()
            return
        self._bound.set()
        try:
            while not self._stop.is_set():
                if not sock.poll(50):
                    continue
                ident, _, start = sock.recv_multipart()
                first = int.from_bytes(start, "big")
                self.requests.append(first)
                for frames in self._data:
                    if int.from_bytes(frames[-2], "big") >= first:
                        sock.send_multipart([ident, *frames])
                sock.send_multipart([ident, *self._end])
        finally:
            sock.close(linger=0)
            ctx.term()


REPLAY_CASES = [("0.9.0", "signed-int"), ("0.25.1", "uint64"), ("0.26.0", "bytes32"), ("0.34.0", "uint64")]


@pytest.mark.anyio
@pytest.mark.parametrize("version,form", REPLAY_CASES)
async def test_replay_client_reads_both_layouts(version: str, form: str) -> None:
    golden = find(version, form)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    bad: list[Exception] = []
    try:
        with GoldenRouter(endpoint, golden, golden.replay_layout) as router:
            client = ReplayClient(ctx, endpoint, timeout_s=5.0, max_frame_bytes=MAX_FRAME, on_bad_frame=bad.append)
            result = await client.fetch(0)
            later = await client.fetch(3)
    finally:
        ctx.term()
    assert router.requests == [0, 3]
    assert (result.complete, result.rejected, bad) == (True, 0, [])
    assert [f.seq for f in result.frames] == list(range(len(golden.live)))
    assert [f.payload for f in result.frames] == golden.payloads
    topic = b"" if golden.replay_layout == "no-topic" else golden.topic.encode()
    assert {f.topic for f in result.frames} == {topic}
    assert later.complete and [f.seq for f in later.frames] == [3, 4]
    # what replay returns decodes like the live stream
    for frame, sent in zip(result.frames, golden.batches):
        batch = BatchDecoder().decode(frame.payload)
        assert batch.rejected == [] and len(batch.events) == len(sent["events"])


# ------------------------------------------------------------------ whole path

FAMILY = {"full_attention": "attention", "sliding_window": "window", "mamba": "state", "unknown": "other"}
WORKER = "compat-w"


class Expected(msgspec.Struct):
    what: str  # "group" or "cleared"
    seq: int
    part: int = 0
    group: int = 0
    kind: str = ""
    source: str = ""
    events: list[dict[str, Any]] = []


def _parts(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """A batch cut at each AllBlocksCleared (the clear ends its part)."""
    parts: list[list[dict[str, Any]]] = [[]]
    for event in events:
        if event["type"] == "AllBlocksCleared":
            parts.append([])
        else:
            parts[-1].append(event)
    return parts


def expected_messages(golden: Golden) -> list[Expected]:
    """What the bridge must publish for the golden, in order (DESIGN.md §3): one
    message per (batch, part, group) in first-seen order, a `cleared` record at
    each clear; kinds as named, else learned; without any kind, group 0 is legacy
    full attention and other groups are unknown."""
    learned: dict[int, str] = {}
    out: list[Expected] = []
    for seq, batch in enumerate(golden.batches):
        for part, events in enumerate(_parts(batch["events"])):
            if part:
                out.append(Expected("cleared", seq))
            slices: dict[int, list[dict[str, Any]]] = {}
            named: dict[int, str] = {}
            for event in events:
                group = event.get("group_idx") or 0
                slices.setdefault(group, []).append(event)
                kind = event.get("kv_cache_spec_kind")
                if event["type"] == "BlockStored" and kind and group not in named:
                    named[group] = kind
                    learned.setdefault(group, kind)
            for group, grouped in slices.items():
                if group in learned:
                    kind = learned[group]
                    source = "event" if named.get(group) == kind else "learned"
                else:
                    kind, source = ("full_attention", "legacy") if group == 0 else ("unknown", "unknown")
                out.append(Expected("group", seq, part, group, kind, source, grouped))
    return out


@contextmanager
def golden_worker(golden: Golden, ctx: zmq.Context[zmq.Socket[bytes]]) -> Iterator[tuple[list[zmq.Socket[bytes]], int, int]]:
    """The golden's release as a vLLM worker: every data-parallel rank up to the
    golden's has an XPUB (a PUB that tells when a subscriber arrives) and a
    replay ROUTER; only the golden's rank has batches."""
    rank = golden.dp_rank or 0
    # one run of ports for both sockets, so the two sets cannot overlap
    pub_base = free_port_run(2 * (rank + 1))
    replay_base = pub_base + rank + 1
    pubs = []
    with ExitStack() as stack:
        for r in range(rank + 1):
            pub = ctx.socket(zmq.XPUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.bind(f"tcp://127.0.0.1:{pub_base + r}")
            stack.callback(pub.close)
            pubs.append(pub)
            stack.enter_context(GoldenRouter(f"tcp://127.0.0.1:{replay_base + r}", golden if r == rank else None,
                                             golden.replay_layout))
        yield pubs, pub_base, replay_base


async def _subscribed(pub: zmq.Socket[bytes], topic: bytes) -> None:
    with anyio.fail_after(10):
        while True:
            while pub.poll(0):
                if pub.recv() == b"\x01" + topic:
                    return
            await anyio.sleep(0.02)


def _vllm_decoders(fmt: str) -> tuple[Any, Any]:
    """An envelope that keeps each relayed event raw, and vLLM 0.33.0's own event
    structs: decoding with them fails on any field vLLM requires that is missing."""
    kv_events = pytest.importorskip("vllm.distributed.kv_events")

    class Envelope(msgspec.Struct):
        events: list[msgspec.Raw]

    event_type: Any = Union[kv_events.BlockStored, kv_events.BlockRemoved]
    module = msgspec.msgpack if fmt == "msgpack" else msgspec.json
    return module.Decoder(Envelope), module.Decoder(event_type)


def _observed(items: list[Received], token: str) -> list[tuple[str, int, int, int]]:
    """(what, seq, part, group) of the worker-rank's group messages and clears, in arrival order."""
    out: list[tuple[str, int, int, int]] = []
    for item in items:
        body = item.body
        if not item.subject.startswith(f"kv.{token}."):
            continue
        if isinstance(body, WorkerRecord):
            if body.type == "cleared" and body.seq is not None:
                out.append(("cleared", body.seq, 0, 0))
        else:
            out.append(("group", body.seq, body.part, body.group))
    return out


PATH_CASES = [("0.9.0", "signed-int"), ("0.20.0", "uint64"), ("0.23.0", "bytes32"), ("0.34.0", "uint64"), ("0.34.0", "bytes32")]


@pytest.mark.anyio
@pytest.mark.parametrize("fmt", ["msgpack", "json"])
@pytest.mark.parametrize("version,form", PATH_CASES)
async def test_whole_path_relays_every_event(nats_server: NatsServerProcess, version: str, form: str, fmt: str) -> None:
    golden = find(version, form)
    envelope, vllm_event = _vllm_decoders(fmt)
    rank = golden.dp_rank or 0
    token = WORKER if rank == 0 else f"{WORKER}-dp{rank}"
    want = expected_messages(golden)
    n_groups = sum(1 for e in want if e.what == "group")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    bus = await BusCollector(fmt).start(nats_server.url)
    try:
        with golden_worker(golden, ctx) as (pubs, pub_base, replay_base):
            settings = make_settings(
                zmq_endpoint=[f"tcp://127.0.0.1:{pub_base}"], replay_endpoint=[f"tcp://127.0.0.1:{replay_base}"],
                dp_ranks=rank + 1, nats_url=[nats_server.url], topic=golden.topic, format=fmt, worker_id=WORKER,
                prompt_data="relay",  # every field as sent, token ids and extra_keys included
            )
            async with running_bridge(settings) as bridge:
                await _subscribed(pubs[rank], golden.topic.encode())
                for frames in golden.live:
                    pubs[rank].send_multipart(frames)

                def arrived(b: BusCollector) -> bool:
                    got = _observed(b.items, token)
                    return sum(1 for g in got if g[0] == "group") >= n_groups and any(g[0] == "cleared" for g in got)

                # on a timeout the assertions below say what is missing
                with anyio.move_on_after(15):
                    await bus.wait_for(arrived, timeout=30)
                await anyio.sleep(0.3)  # anything extra would show now
                malformed = {r: metric(bridge, "kvbridge_malformed_total", reason=r) for r in MALFORMED_REASONS}
    finally:
        await bus.close()
        ctx.term()

    assert {r: n for r, n in malformed.items() if n} == {}
    assert bus.wrong_format == []
    assert bus.records("gap") == []
    # every event once, in order, each group's slice on its subject
    assert _observed(bus.items, token) == [(e.what, e.seq, e.part, e.group) for e in want]
    groups = [(item, raw) for item, raw in zip(bus.items, bus.raw) if item.subject.startswith(f"kv.{token}.")
              and not item.subject.endswith(".worker")]
    assert len(groups) == n_groups
    problems: list[str] = []
    for (item, raw), exp in zip(groups, [e for e in want if e.what == "group"]):
        msg = item.body
        assert isinstance(msg, GroupMessage)
        assert item.subject == f"kv.{token}.{exp.group}"
        assert (msg.worker, msg.dp_rank, msg.topic) == (WORKER, rank, golden.topic)
        assert (msg.kind, msg.family, msg.kind_source) == (exp.kind, FAMILY[exp.kind], exp.source), f"seq {exp.seq} g{exp.group}"
        assert item.headers["Kvb-Family"] == msg.family and item.headers["Kvb-Kind"] == msg.kind
        assert len(msg.events) == len(exp.events)
        for got, sent in zip(msg.events, exp.events):
            problems += [f"bus seq {exp.seq}: {p}" for p in event_mismatches(got, sent)]
        # vLLM's own structs read every relayed event back, every field as sent
        for raw_event, sent in zip(envelope.decode(raw).events, exp.events):
            try:
                theirs = vllm_event.decode(raw_event)
            except msgspec.ValidationError as exc:
                problems.append(f"vLLM 0.33.0 rejects a relayed {sent['type']} (seq {exp.seq}): {exc}")
                continue
            assert type(theirs).__name__ == sent["type"]
            for name, value in sent.items():
                if name != "type" and _plain(token_ids(getattr(theirs, name))) != _plain(sent_value(name, value)):
                    problems.append(f"vLLM reads {sent['type']}.{name} = {getattr(theirs, name)!r} (seq {exp.seq})")
    assert problems == []


# -------------------------------------------------------------------- the docs


def test_the_docs_table_is_the_matrix() -> None:
    """docs/compatibility.md lists exactly the releases verified, with what each sent."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "compatibility.md").read_text()
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in page.splitlines() if line.startswith("| 0.")]
    table = {row[0]: (row[1], "topic" in row[3]) for row in rows}
    assert table == {r["version"]: (r["event_encoding"], r["replay_layout"] == "topic") for r in index()["releases"]}
