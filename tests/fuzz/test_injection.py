"""Worker ids, topics, kinds and prefixes that would inject NATS subject tokens,
header lines or metric labels are escaped or refused."""

from __future__ import annotations

import os
import re
import time

import anyio
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from bridge.apps.demo.publisher import WirePublisher
from bridge.contract import (
    SCHEMA_VERSION,
    BlockStored,
    GroupMessage,
    WorkerRecord,
    clean_kind,
    parse_worker_token,
    validate_prefix,
    worker_token,
)
from bridge.producer.config import ConfigError
from bridge.producer.normalize.normalizer import (
    KindBook,
    Normalizer,
    NormalizeStats,
    StreamIdentity,
)
from bridge.producer.service import Bridge
from bridge.producer.sink.encode import MessageEncoder
from bridge.producer.sink.subjects import SubjectBook
from bridge.runtime.nats_server import NatsServerProcess
from tests.busutil import BusCollector, endpoints, make_settings, running_bridge
from tests.fuzz.live import good_batch, wait_good

EXAMPLES = int(os.environ.get("KVB_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_TOKEN = re.compile(r"^[A-Za-z0-9_~-]+$")
_HEADER_VALUE = re.compile(r"^[\x21-\x7e]*$")  # one visible-ASCII word: no CR, LF, space or colon games
HOSTILE = [
    "pod\r\nKvb-Kind: mamba", "pod\nx", "a.b", "kv.>", "*", ">", "a b", " ", "pod\tname", "tenant/pod",
    "ünïcødé", "日本語", "\U0001f600", "$SYS", "~", "~2E", "a-dp1", "\x00", "\x7f", "x" * 200, "é" * 100, "é" * 101,
    "x" * 201, "", "pod:1:2", 'a"b\\c}{',
]


KNOWN_HEADERS = {"Nats-Msg-Id", "Kvb-Kind", "Kvb-Family", "Kvb-Seq", "Kvb-Epoch", "Kvb-Format", "Kvb-Record"}


def _check_head(head: bytes, headers: dict[str, str]) -> None:
    """The header block as written on the wire (when the encoder pre-builds it
    for HPUB, nats-py's own checks are skipped): exactly the headers, one line
    each, nothing smuggled in."""
    if not head:
        return
    lines = head.decode("ascii").split("\r\n")
    assert lines[0] == "NATS/1.0" and lines[-2:] == ["", ""], head
    pairs = [line.split(": ", 1) for line in lines[1:-2]]
    assert all(len(p) == 2 for p in pairs), head
    assert dict(pairs) == headers and len(pairs) == len(headers), head


def _check_outgoing(subject: str, headers: dict[str, str], prefix: str, head: bytes = b"") -> None:
    assert set(headers) <= KNOWN_HEADERS, headers
    _check_head(head, headers)
    tokens = subject.split(".")
    assert tokens[: len(prefix.split("."))] == prefix.split(".")
    assert len(tokens) == len(prefix.split(".")) + 2, subject
    assert all(_TOKEN.match(t) for t in tokens), subject
    for key, value in headers.items():
        assert _HEADER_VALUE.match(key) and _HEADER_VALUE.match(value), (key, value)


def _messages_for(worker: str, topic: str, kind: str, prefix: str = "kv") -> list[tuple[str, dict[str, str], object, bytes]]:
    """What the bridge would publish for one batch and one record of this worker."""
    subjects = SubjectBook(prefix, worker, 3)
    ident = StreamIdentity(worker=worker, dp_rank=3, topic=topic, epoch=17)
    event = BlockStored(block_hashes=[b"h"], parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                        medium="GPU", lora_name=None, group_idx=1, kv_cache_spec_kind=kind)
    items = Normalizer(KindBook({}), False).normalize(ident, 5, 1.0, [event], time.time(), NormalizeStats())
    token = worker_token(worker, 3)
    out: list[tuple[str, dict[str, str], object, bytes]] = []
    for fmt in ("msgpack", "json"):
        encoder = MessageEncoder(fmt)
        for item in items:
            assert isinstance(item, GroupMessage)
            m = encoder.group(item, subjects, f"{token}:3:17")
            out.append((m.subject, m.headers, item, getattr(m, "head", b"")))
        rec = WorkerRecord(v=SCHEMA_VERSION, worker=worker, dp_rank=3, epoch=17, type="gap", ts=1.0, gap_from=1,
                           gap_to=2, reason="replay_incomplete", topic=topic)
        m = encoder.record(rec, subjects, f"{token}:3:17:1-2:worker:gap")
        out.append((m.subject, m.headers, rec, getattr(m, "head", b"")))
    return out


@pytest.mark.parametrize("worker", HOSTILE, ids=lambda w: repr(w)[:24])
def test_hostile_worker_ids_are_escaped_or_refused(worker: str) -> None:
    try:
        settings_ = make_settings(worker_id=worker or None, zmq_endpoint=["tcp://127.0.0.1:1"])
    except ConfigError as exc:
        assert exc.option == "--worker-id"
        assert worker == "" or len(worker.encode()) > 200 or any(ord(c) < 0x20 or ord(c) == 0x7F for c in worker)
        return
    if worker == "":  # no id: the host name stands in
        return
    assert settings_.worker_id == worker
    assert len(worker.encode()) <= 200 and not any(ord(c) < 0x20 or ord(c) == 0x7F for c in worker)
    for subject, headers, body, head in _messages_for(worker, "", "mamba"):
        _check_outgoing(subject, headers, "kv", head)
        assert parse_worker_token(subject.split(".")[1]) == (worker, 3)
        assert body.worker == worker  # type: ignore[attr-defined]


@FUZZ
@given(st.text(max_size=80), st.text(max_size=40), st.text(max_size=60))
@example("pod\r\nX: y", "topic\r\nKvb-Record: gap", "mamba\r\nKvb-Kind: x")
@example("a.b.*.>", "t.*.>", "full_attention.>")
def test_any_worker_topic_and_kind_yield_one_token_and_clean_headers(worker: str, topic: str, kind: str) -> None:
    try:
        make_settings(worker_id=worker or "w", topic=topic or None, zmq_endpoint=["tcp://127.0.0.1:1"])
    except ConfigError as exc:
        assert exc.option == "--worker-id"
        return
    for subject, headers, _, head in _messages_for(worker or "w", topic, kind, prefix="kv.prod"):
        _check_outgoing(subject, headers, "kv.prod", head)


@FUZZ
@given(st.text(max_size=60))
@example("mamba\r\nKvb-Kind: x")
@example("Mamba")
@example("m" * 49)
def test_wire_kinds_are_plain_identifiers_or_unknown(kind: str) -> None:
    cleaned = clean_kind(kind)
    assert cleaned == kind or cleaned == "unknown"
    assert re.fullmatch(r"[a-z0-9_]{1,48}", cleaned)


@FUZZ
@given(st.text(max_size=40))
@example("kv.>")
@example("kv.*")
@example("kv prod")
@example("kv\r\n")
@example("kv..prod")
def test_subject_prefixes_with_wildcards_or_spaces_are_refused(prefix: str) -> None:
    try:
        validate_prefix(prefix)
    except ValueError:
        with pytest.raises(ConfigError):
            make_settings(subject_prefix=prefix, zmq_endpoint=["tcp://127.0.0.1:1"])
        return
    assert all(re.fullmatch(r"[A-Za-z0-9_-]+", t) for t in prefix.split("."))


def test_metric_labels_escape_a_hostile_worker_id() -> None:
    worker = 'a"b\\c}{x=y,z="q"'
    bridge = Bridge(make_settings(worker_id=worker, zmq_endpoint=["tcp://127.0.0.1:1"]))
    families = {f.name: f for f in text_string_to_metric_families(bridge.metrics.render().decode())}
    samples = families["kvbridge_info"].samples
    assert [s.labels["worker"] for s in samples] == [worker]


@pytest.mark.anyio
async def test_a_hostile_worker_id_on_a_live_bus(nats_server: NatsServerProcess) -> None:
    """`pod.a b*>` must not become `kv.pod.a b*>.0`: everything arrives on
    exactly `kv.<one token>.<group|worker>`, and a subscriber to the subjects
    the raw id would have hit gets nothing."""
    worker = "pod.a b*>\u00e9\u65e5"
    topic = "kv\r\nKvb-Kind: x"
    pub_ep, replay_ep = endpoints()
    pub = WirePublisher(pub_ep.replace("127.0.0.1", "*"), replay_ep.replace("127.0.0.1", "*"), topic=topic)
    settings_ = make_settings(zmq_endpoint=[pub_ep], replay_endpoint=[replay_ep], nats_url=[nats_server.url],
                              worker_id=worker, topic=topic)
    bus = await BusCollector().start(nats_server.url, "kv.*.*")
    leak = await BusCollector().start(nats_server.url, "kv.pod.>")
    try:
        async with running_bridge(settings_):
            await anyio.sleep(0.3)
            for k in range(5):
                pub.publish(good_batch(k))
            await anyio.to_thread.run_sync(pub.wait_idle)
            await wait_good(bus, list(range(5)), timeout=10)
        await bus.wait_for(lambda b: len(b.records("stop")) == 1)
    finally:
        pub.close()
        await bus.close()
        await leak.close()
    assert leak.items == []
    token = worker_token(worker, 0)
    assert {r.subject for r in bus.items} == {f"kv.{token}.0", f"kv.{token}.2", f"kv.{token}.worker"}
    assert all(r.body.worker == worker and r.body.topic == topic for r in bus.items)
    for r in bus.items:
        assert set(r.headers) <= KNOWN_HEADERS, r.headers
        assert all(_HEADER_VALUE.match(v) for v in r.headers.values()), r.headers
