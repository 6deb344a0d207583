"""Library code never writes stdout: a rank whose snapshot cannot be had is
logged (`snapshot_missing`) on stderr, and stdout holds only the tool's (or
the script's) own output."""

from __future__ import annotations

import json
import sys
import textwrap

import anyio
import nats
import pytest

from bridge.contract.snapshot import SNAPSHOT_SERVICE
from bridge.producer.sink.encode import MessageEncoder
from bridge.producer.sink.subjects import SubjectBook
from bridge.runtime.nats_barrier import flushed
from bridge.runtime.nats_server import NatsServerProcess
from tests.client.builders import hb, msg, stored

pytestmark = pytest.mark.anyio

# A `$SRV.INFO` answer naming a rank whose bridge then answers nothing.
_INFO = json.dumps({"metadata": {"prefix": "kv"},
                    "endpoints": [{"metadata": {"worker": "pod a", "dp_rank": 1}}]}).encode()


async def _ghost_service(nc: nats.NATS) -> None:
    async def answer(m) -> None:
        await nc.publish(m.reply, _INFO)

    await nc.subscribe(f"$SRV.INFO.{SNAPSHOT_SERVICE}", cb=answer)
    await flushed(nc)


async def test_tail_json_with_a_snapshot_missing_keeps_stdout_to_its_lines(nats_server: NatsServerProcess) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        await _ghost_service(nc)
        js = nc.jetstream()
        await js.add_stream(name="KV_EVENTS", subjects=["kv.>"])
        book = SubjectBook("kv", "pod a", 1)
        out = MessageEncoder("msgpack").group(msg([stored([hb(1)])], worker="pod a", rank=1, seq=0), book, "m1")
        await js.publish(out.subject, out.payload, headers=out.headers)
        proc = await anyio.run_process(
            [sys.executable, "-m", "bridge", "tail", "--nats-url", nats_server.url, "--since", "snapshot",
             "--count", "1", "--json", "--snapshot-bucket", ""],
            check=False,
        )
    finally:
        await nc.close()
    assert proc.returncode == 0, proc.stderr.decode()
    docs = [json.loads(line) for line in proc.stdout.decode().splitlines()]  # every line is the tool's JSON
    assert docs[0]["worker"] == "pod a" and docs[0]["dp_rank"] == 1 and docs[-1]["type"] == "group"
    assert "snapshot_missing" in proc.stderr.decode()


async def test_a_client_script_that_configures_nothing_gets_library_logs_on_stderr(
    nats_server: NatsServerProcess,
) -> None:
    nc = await nats.connect(nats_server.url)
    script = textwrap.dedent(f"""
        import anyio
        from bridge.client import BootstrapOptions, BusConnection, BusSubscriber, settings_for

        async def main():
            conn = BusConnection()
            await conn.open(settings_for({nats_server.url!r}), "script")
            async with BusSubscriber(conn, "kv.>", bootstrap=BootstrapOptions(bucket="", discover_s=0.3)) as sub:
                with anyio.move_on_after(3):
                    async for item in sub:
                        print("ITEM", type(item).__name__)
                        break
            await conn.close()

        anyio.run(main)
    """)
    try:
        await _ghost_service(nc)
        proc = await anyio.run_process([sys.executable, "-c", script], check=False)
    finally:
        await nc.close()
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode().splitlines() == ["ITEM SnapshotMissing"]
    assert "snapshot_missing" in proc.stderr.decode()
