"""`kv-bridge tail`: live lines with --count, and a JetStream replay as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import anyio
import nats
import pytest

from bridge.cli import main
from bridge.producer.sink.encode import MessageEncoder
from bridge.producer.sink.subjects import SubjectBook
from bridge.runtime.nats_server import NatsServerProcess
from tests.client.builders import hb, hi, msg, record, removed, stored

pytestmark = pytest.mark.anyio


def _encoded(fmt: str, seq: int):
    book = SubjectBook("kv", "pod a", 1)
    group = msg([stored([hb(seq), hb(seq + 1)], medium="CPU"), removed([hi(seq)])], worker="pod a", rank=1, seq=seq)
    return MessageEncoder(fmt).group(group, book, f"pod~20a-dp1:1:1:{seq}")


async def test_tail_prints_one_line_per_message_and_stops_after_count(
    nats_server: NatsServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    codes: list[int] = []
    argv = ["tail", "--nats-url", nats_server.url, "--count", "3"]
    thread = threading.Thread(target=lambda: codes.append(main(argv)))
    thread.start()
    nc = await nats.connect(nats_server.url)
    try:
        seq = 0
        with anyio.fail_after(15):
            # tail subscribes in its own thread: publish until it has had three
            while thread.is_alive():
                out = _encoded("msgpack" if seq % 2 else "json", seq)
                await nc.publish(out.subject, out.payload, headers=out.headers)
                seq += 1
                await anyio.sleep(0.05)
    finally:
        await nc.close()
        thread.join(5)
    assert codes == [0]
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    for line in lines:
        # worker, rank, seq, group, family/kind, medium, short hashes (bytes as hex, ints as hex too)
        assert line.startswith("pod a dp1 seq=") and " g0 attention/full_attention: " in line
        n = int(line.split("seq=")[1].split()[0])
        assert f"stored[CPU] {hb(n).hex()[:8]},{hb(n + 1).hex()[:8]}" in line
        assert f"removed[GPU] {hi(n):016x}"[:21] in line


async def test_tail_since_all_replays_the_stream_as_json(nats_server: NatsServerProcess) -> None:
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    await js.add_stream(name="KV_EVENTS", subjects=["kv.>"])
    for seq in range(3):
        out = _encoded("json" if seq == 1 else "msgpack", seq)
        await js.publish(out.subject, out.payload, headers=out.headers)
    book = SubjectBook("kv", "pod a", 1)
    rec = MessageEncoder("msgpack").record(record("gap", worker="pod a", rank=1, gap=(7, 9)), book, "gap-1")
    await js.publish(rec.subject, rec.payload, headers=rec.headers)
    await nc.close()

    proc = await anyio.run_process(
        [sys.executable, "-m", "bridge", "tail", "--nats-url", nats_server.url, "--since", "all", "--count", "4",
         "--json"],
        check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    docs = [json.loads(line) for line in proc.stdout.decode().splitlines()]
    assert [d["stream_seq"] for d in docs] == [1, 2, 3, 4]
    assert [d["type"] for d in docs] == ["group", "group", "group", "record"]
    assert docs[0]["subject"] == "kv.pod~20a-dp1.0"
    first = docs[0]["message"]
    assert first["worker"] == "pod a" and first["dp_rank"] == 1 and first["family"] == "attention"
    assert first["events"][0]["type"] == "BlockStored"
    assert first["events"][0]["block_hashes"] == [hb(0).hex(), hb(1).hex()]
    assert first["events"][1]["block_hashes"] == [hi(0)]
    assert docs[1]["headers"]["Kvb-Format"] == "json" and docs[1]["message"]["seq"] == 1
    assert docs[3]["message"]["type"] == "gap" and docs[3]["message"]["gap_to"] == 9

    # from a stream sequence, and from an age, as text lines tagged with the stream sequence
    for since, count, first in (("3", 2, 3), ("1h", 4, 1)):
        proc = await anyio.run_process(
            [sys.executable, "-m", "bridge", "tail", "--nats-url", nats_server.url, "--since", since,
             "--count", str(count)],
            check=False,
        )
        lines = proc.stdout.decode().splitlines()
        assert [int(line.split()[0][1:]) for line in lines] == list(range(first, first + count)), since
        assert lines[-1].endswith("WORKER GAP epoch=1 lost=7..9 reason=None")


def test_tail_reports_an_unreachable_server_and_a_bad_since() -> None:
    started = time.monotonic()
    bad = subprocess.run([sys.executable, "-m", "bridge", "tail", "--nats-url", "nats://127.0.0.1:1", "--count", "1"],
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 1 and "no NATS server answered" in bad.stderr
    assert time.monotonic() - started < 20
    assert main(["tail", "--since", "yesterday"]) == 2


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
async def test_tail_ends_on_ctrl_c_or_sigterm(nats_server: NatsServerProcess, sig: str) -> None:
    """Ctrl-C or SIGTERM ends a tail at once, its connection closed, exit code 0."""
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "bridge", "tail", "--nats-url", nats_server.url],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        await anyio.sleep(3.0)
        assert proc.poll() is None
        proc.send_signal(getattr(signal, sig))
        _, err = await anyio.to_thread.run_sync(lambda: proc.communicate(timeout=10))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err.decode()
    assert b"Traceback" not in err
