"""Replays the malformed-input corpus in tests/corpus/ (see its README):
offline through the frame checks, decoder, normalizer and encoders, and live
through a bridge among good batches."""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import pytest

from bridge.apps.demo.publisher import WirePublisher
from bridge.contract import GroupMessage
from bridge.producer.decode.decoder import BatchDecodeError, BatchDecoder
from bridge.producer.normalize.normalizer import (
    BAD_GROUP,
    TOO_MANY_EVENTS,
    TOO_MANY_MESSAGES,
    KindBook,
    Normalizer,
    NormalizeStats,
    StreamIdentity,
)
from bridge.producer.sink.encode import MessageEncoder
from bridge.producer.sink.subjects import SubjectBook
from bridge.producer.source.frames import FrameError, parse_pub
from bridge.runtime.nats_server import NatsServerProcess
from tests.busutil import BusCollector, endpoints, make_settings, metric, running_bridge
from tests.corpus.make_corpus import MAX_FRAME, read_frames
from tests.fuzz.live import good_batch, wait_good

CORPUS = Path(__file__).resolve().parent.parent / "corpus"
MANIFEST: dict[str, dict[str, Any]] = json.loads((CORPUS / "manifest.json").read_text())
_SAFE_HEADER = re.compile(r"^[\x21-\x7e]*$")
# refused after decoding: such events count in events_in, then are rejected
NORMALIZER_REASONS = {BAD_GROUP, TOO_MANY_MESSAGES, TOO_MANY_EVENTS}


def _entries() -> list[Any]:
    out = []
    for name, entry in sorted(MANIFEST.items()):
        marks = [pytest.mark.xfail(strict=True, reason=entry["known_bug"])] if "known_bug" in entry else []
        out.append(pytest.param(name, entry, id=name, marks=marks))
    return out


def test_every_corpus_file_is_in_the_manifest() -> None:
    files = {str(p.relative_to(CORPUS)) for p in CORPUS.glob("*/*") if p.suffix in (".hex", ".bin")}
    assert files == set(MANIFEST)


@pytest.mark.parametrize(("name", "entry"), _entries())
def test_corpus_entry_offline(name: str, entry: dict[str, Any]) -> None:
    path = CORPUS / name
    if name.startswith("frames/"):
        with pytest.raises(FrameError) as info:
            parse_pub(read_frames(path), MAX_FRAME)
        assert {info.value.reason: 1} == entry["malformed"]
        return
    payload = path.read_bytes()
    if entry["malformed"].get("bad_batch"):
        with pytest.raises(BatchDecodeError):
            BatchDecoder().decode(payload)
        return
    batch = BatchDecoder().decode(payload)
    stats = NormalizeStats()
    items = Normalizer(KindBook({}), False).normalize(
        StreamIdentity("corpus", 0, "", 1), 7, batch.ts, batch.events, time.time(), stats)
    # the decoder's refusals and the normalizer's, each counted once
    assert Counter(r for r, _ in batch.rejected) + Counter(stats.malformed) == Counter(entry["malformed"])
    assert len(batch.events) - sum(stats.malformed.values()) == entry["good_events"]
    if name == "payloads/hostile_kind.bin":
        assert [i.kind for i in items if isinstance(i, GroupMessage)] == ["unknown"]
    for fmt in ("msgpack",) if entry.get("json_unwritable") else ("msgpack", "json"):
        encoder = MessageEncoder(fmt)
        for item in items:
            if isinstance(item, GroupMessage):
                out = encoder.group(item, SubjectBook("kv", "corpus", 0), "corpus:0:1")
                assert all(_SAFE_HEADER.match(v) for v in out.headers.values()), out.headers



@pytest.mark.anyio
async def test_corpus_through_a_live_bridge(nats_server: NatsServerProcess) -> None:
    """Every entry without a known bug, each between two good batches: the
    counters add up to the manifest, every good batch arrives, and exactly the
    numbered batches with a refusal are named by a `malformed` gap."""
    pub_ep, replay_ep = endpoints()
    pub = WirePublisher(pub_ep.replace("127.0.0.1", "*"), replay_ep.replace("127.0.0.1", "*"))
    settings = make_settings(zmq_endpoint=[pub_ep], replay_endpoint=[replay_ep], nats_url=[nats_server.url],
                             max_frame_bytes=str(MAX_FRAME))
    bus = await BusCollector().start(nats_server.url)
    expected: Counter[str] = Counter()
    decoded = 0
    malformed_seqs: list[int] = []
    seq = 0
    entries = [(n, e) for n, e in sorted(MANIFEST.items()) if "known_bug" not in e]
    try:
        async with running_bridge(settings) as bridge:
            await anyio.sleep(0.3)
            for k, (name, entry) in enumerate(entries):
                pub.publish(good_batch(k))
                seq += 1
                if name.startswith("frames/"):
                    pub.send_raw(read_frames(CORPUS / name))
                else:
                    pub.publish((CORPUS / name).read_bytes())
                    if entry["malformed"]:
                        malformed_seqs.append(seq)
                    seq += 1
                expected.update(entry["malformed"])
                decoded += entry["good_events"] + sum(n for r, n in entry["malformed"].items() if r in NORMALIZER_REASONS)
            pub.publish(good_batch(len(entries)))
            await anyio.to_thread.run_sync(pub.wait_idle)
            await wait_good(bus, list(range(len(entries) + 1)), timeout=15)
            await bus.wait_for(lambda b: len(b.records("gap")) >= len(malformed_seqs))
            await anyio.sleep(0.3)
            got = {r: metric(bridge, "kvbridge_malformed_total", reason=r) for r in expected}
            events_in = metric(bridge, "kvbridge_events_in_total")
            assert bridge.health.live()
    finally:
        pub.close()
        await bus.close()
    assert got == {r: float(n) for r, n in expected.items()}
    assert events_in == 2 * (len(entries) + 1) + decoded
    gaps = bus.records("gap")
    assert [(g.gap_from, g.gap_to, g.reason) for g in gaps] == [(s, s, "malformed") for s in malformed_seqs]
    assert bus.records("restart") == []
    for r in bus.items:
        assert all(_SAFE_HEADER.match(v) for v in r.headers.values()), r.headers
