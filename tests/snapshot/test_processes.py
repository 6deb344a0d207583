"""Late joiners against real processes: `python -m bridge run` subprocesses,
a real nats-server, WirePublisher speaking vLLM's PUB/replay protocol. A
consumer that watched from the start (`live_index`) is the reference; a
consumer that starts late, bootstraps and then follows must hold the same
views (tests/snapshot/views.py), or say that it cannot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import anyio
import anyio.abc
import nats
import pytest
from anyio.streams.text import TextReceiveStream

from bridge.client.bootstrap import BootstrapOptions
from bridge.client.connection import settings_for
from bridge.client.subscribe import StartAt
from bridge.contract import DEFAULT_STREAM
from bridge.contract.snapshot import DEFAULT_SNAPSHOT_BUCKET, SnapshotHead, decode_head, snapshot_key
from bridge.residency import ResidencyIndex
from bridge.runtime.nats_server import NatsServerProcess
from tests.busutil import wait_until
from tests.client.live import live_index
from tests.faults.harness import http_get, metric_value
from tests.security.secure_nats import READER_INBOX, bridge_permissions, reader_permissions, secret_word, start_server
from tests.snapshot.rig import Worker, caught_up, late_index
from tests.snapshot.views import index_state

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]


async def _trickle(worker: Worker, batches: int, done: anyio.Event, every: float = 0.02) -> None:
    """Traffic while a late consumer bootstraps: its buffer and the snapshot race."""
    for _ in range(batches):
        worker.publish(1)
        await anyio.sleep(every)
    done.set()


async def test_core_mode_a_late_consumer_equals_the_watcher(nats_server: NatsServerProcess, tmp_path: Path) -> None:
    """Core NATS, two ranks: a consumer that starts while traffic flows gets
    each rank's snapshot from the bridge's service and holds, after it, what
    the watcher holds."""
    worker = Worker(tmp_path, "pod-a", nats_server.url, ranks=2)
    try:
        async with live_index(nats_server.url) as watcher:
            await worker.start()
            worker.publish(50, clear_at=20)
            await wait_until(lambda: worker.caught_up(watcher), 20, "the watcher")
            boot = BootstrapOptions(discover_s=0.3)
            async with anyio.create_task_group() as tg:
                # traffic before, during and after the subscription and the snapshot requests
                done = anyio.Event()
                tg.start_soon(_trickle, worker, 40, done)
                await anyio.sleep(0.2)
                async with late_index(nats_server.url, bootstrap=boot) as (late, sub):
                    await wait_until(lambda: len(sub.sources) == 2, 20, "the bootstrap")
                    await done.wait()
                    worker.publish(10)
                    await wait_until(lambda: worker.caught_up(watcher) and worker.caught_up(late), 20,
                                     "both consumers")
                    assert sorted((s.dp_rank, s.source) for s in sub.sources) == [(0, "service"), (1, "service")]
                    state = index_state(watcher)
                    assert set(state) == {("pod-a", 0), ("pod-a", 1)}
                    for view in state.values():
                        assert view["groups"][0][5]["GPU"][0], "the attention group holds blocks"
                    assert index_state(late) == state
                    assert not any(v.stale for v in late)
    finally:
        worker.close()


async def test_jetstream_bridge_gone_a_late_consumer_starts_from_the_bucket(nats_server: NatsServerProcess,
                                                                          tmp_path: Path) -> None:
    """JetStream mode: traffic, then SIGTERM. The bridge's last act is to write
    each rank's snapshot into the bucket; with no bridge to ask, a consumer
    with since=snapshot starts from it and equals the watcher without
    reading the stream from its start."""
    worker = Worker(tmp_path, "pod-b", nats_server.url, jetstream=True)
    try:
        async with live_index(nats_server.url) as watcher:
            await worker.start()
            worker.publish(60, clear_at=20)
            await wait_until(lambda: worker.caught_up(watcher), 20, "the watcher")
            assert not worker.logged("snapshot_written"), "--snapshot-interval is 30 s: no write yet"
            # SIGTERM
            assert await anyio.to_thread.run_sync(lambda: worker.bridge.stop(timeout=20)) == 0
            await wait_until(lambda: not watcher.view("pod-b", 0).watching, 10, "the stop record")  # type: ignore[union-attr]
        written = worker.logged("snapshot_written")
        assert len(written) == 1 and written[0]["through"], written
        async with late_index(nats_server.url, since=StartAt("snapshot"),
                              bootstrap=BootstrapOptions(discover_s=0.3)) as (late, sub):
            await wait_until(lambda: caught_up(late, "pod-b", 0, worker.last_seq()), 10, "the late consumer")
            await anyio.sleep(0.3)  # anything the stream still had after the snapshot
            assert [(s.source, s.dp_rank) for s in sub.sources] == [("bucket", 0)], sub.sources
            assert "no bridge answers" in sub.sources[0].detail
            state = index_state(watcher)
            assert state[("pod-b", 0)]["groups"][0][5]["GPU"][0], "the attention group holds blocks"
            assert state[("pod-b", 0)]["watching"] is False
            assert index_state(late) == state
            # the snapshot was taken after the stop record: nothing of the stream was read
            assert sub.delivered == 0
        # a core consumer too: the bucket's snapshot of a bridge that stopped is whole
        async with late_index(nats_server.url, bootstrap=BootstrapOptions(discover_s=0.3)) as (late, sub):
            await wait_until(lambda: caught_up(late, "pod-b", 0, worker.last_seq()), 10, "the core consumer")
            assert [s.source for s in sub.sources] == ["bucket"]
            assert index_state(late) == state
    finally:
        worker.close()


async def _bucket_head(url: str, worker: str, rank: int) -> SnapshotHead:
    nc = await nats.connect(url)
    try:
        kv = await nc.jetstream().key_value(DEFAULT_SNAPSHOT_BUCKET)
        return decode_head((await kv.get(snapshot_key(worker, rank))).value or b"")
    finally:
        await nc.close()


async def _stream_last_seq(url: str) -> int:
    nc = await nats.connect(url)
    try:
        return int((await nc.jetstream().stream_info(DEFAULT_STREAM)).state.last_seq)
    finally:
        await nc.close()


async def test_jetstream_bridge_killed_rebuilds_from_bucket_and_stream(nats_server: NatsServerProcess,
                                                                      tmp_path: Path) -> None:
    """JetStream mode, kill -9: the bucket holds a snapshot older than the
    stream's tail. With no bridge, a late consumer (since=snapshot) starts
    from the bucket and reads the stream after it. The restarted bridge
    rebuilds its residency from the same two (`snapshot_rebuilt`), recovers
    what vLLM sent while it was away, and its service's snapshots bring late
    consumers, core and stream, to the watcher's view."""
    worker = Worker(tmp_path, "pod-c", nats_server.url, jetstream=True, extra=("--snapshot-interval", "2"))
    url = nats_server.url
    boot = BootstrapOptions(discover_s=0.3)
    try:
        async with live_index(url) as watcher:
            await worker.start()
            worker.publish(40, clear_at=10)
            await wait_until(lambda: worker.caught_up(watcher), 20, "the watcher")
            await worker.wait_logged("snapshot_written")
            worker.publish(30)
            await wait_until(lambda: worker.caught_up(watcher), 20, "the watcher")
            await anyio.to_thread.run_sync(worker.bridge.kill9)
            head = await _bucket_head(url, "pod-c", 0)
            last = await _stream_last_seq(url)
            assert head.stream_seq <= last
            worker.publish(10)  # vLLM goes on; its replay buffer keeps them for the next bridge

            # no bridge: the bucket's snapshot, then the stream after it
            async with late_index(url, since=StartAt("snapshot"), bootstrap=boot) as (late, sub):
                await wait_until(lambda: index_state(late) == index_state(watcher), 10, "the late consumer")
                assert [s.source for s in sub.sources] == ["bucket"]
                assert sub.delivered == last - head.stream_seq
            # a core consumer has only the bucket's snapshot, older than the stream: it cannot
            # know what came between, and says so
            async with late_index(url, bootstrap=boot) as (late, sub):
                await wait_until(lambda: late.view("pod-c", 0) is not None, 10, "the core consumer")
                assert [s.source for s in sub.sources] == ["bucket"]
                view = late.view("pod-c", 0)
                assert view is not None and view.partial and view.stale

            await worker.start()
            rebuilt = await worker.wait_logged("snapshot_rebuilt")
            assert rebuilt["from_snapshot"] is True and rebuilt["partial"] is False, rebuilt
            assert rebuilt["replayed"] == last - head.stream_seq, (rebuilt, head, last)
            await wait_until(lambda: worker.caught_up(watcher), 20, "the watcher after the restart")
            worker.publish(20)
            await wait_until(lambda: worker.caught_up(watcher), 20, "the watcher")
            async with late_index(url, bootstrap=boot) as (core_late, core_sub), \
                    late_index(url, since=StartAt("snapshot"), bootstrap=boot) as (js_late, js_sub):
                worker.publish(10)
                await wait_until(lambda: all(worker.caught_up(i) for i in (watcher, core_late, js_late)), 20,
                                 "every consumer")
                assert [s.source for s in core_sub.sources] == ["service"]
                assert [s.source for s in js_sub.sources] == ["service"]
                state = index_state(watcher)
                assert state[("pod-c", 0)]["groups"][0][5]["GPU"][0], "the attention group holds blocks"
                assert not state[("pod-c", 0)]["stale"]
                assert index_state(core_late) == state
                assert index_state(js_late) == state
    finally:
        worker.close()


def _resident(index: ResidencyIndex, worker: str) -> dict[int, dict[str, dict[object, int]]]:
    """Per group and medium, the trusted copies (empty cells left out)."""
    view = index.view(worker, 0)
    assert view is not None
    return {n: {m: dict(t.items()) for m, t in g.trusted.items() if len(t)} for n, g in view.groups.items()}


async def test_a_rank_without_a_snapshot_is_stale_never_silently_partial(nats_server: NatsServerProcess,
                                                                        tmp_path: Path) -> None:
    """Core mode, two workers: pod-d1's bridge keeps snapshots, pod-d2's runs
    with --no-snapshots (no service, and no bucket in core mode). A late
    consumer holds pod-d1 whole; pod-d2 is partial and stale (a router is
    told: its matches are stale), a cache clear included (a group the view
    never heard of is still unknown), until its bridge starts afresh: then
    it is whole again and equals the watcher's."""
    url = nats_server.url
    whole = Worker(tmp_path, "pod-d1", url)
    blind = Worker(tmp_path, "pod-d2", url, extra=("--no-snapshots",), seed=11)
    try:
        async with live_index(url) as watcher:
            await whole.start()
            await blind.start()
            whole.publish(40)
            blind.publish(40)
            await wait_until(lambda: whole.caught_up(watcher) and blind.caught_up(watcher), 20, "the watcher")
            async with late_index(url, bootstrap=BootstrapOptions(discover_s=0.3, timeout_s=2)) as (late, sub):
                for _ in range(10):
                    whole.publish(1)
                    blind.publish(1)
                    await anyio.sleep(0.05)
                await wait_until(lambda: all(w.caught_up(i) for w in (whole, blind) for i in (watcher, late)), 20,
                                 "both consumers")
                sources = {s.worker: s for s in sub.sources}
                assert sources["pod-d1"].source == "service"
                # pod-d2 was either in the buffer (asked for, nobody answered) or first seen afterwards
                assert "pod-d2" not in sources or sources["pod-d2"].source == "none", sources
                state, late_state = index_state(watcher), index_state(late)
                assert late_state[("pod-d1", 0)] == state[("pod-d1", 0)]
                view = late.view("pod-d2", 0)
                assert view is not None and view.partial and view.stale
                assert not watcher.view("pod-d2", 0).stale  # type: ignore[union-attr]
                assert late.match("pod-d2", 0, []).stale  # type: ignore[union-attr]
                # a clear empties the caches, not what the view does not know of the groups
                blind.publish(5, clear_at=0)
                await wait_until(lambda: blind.caught_up(watcher) and blind.caught_up(late), 20, "the clear")
                view = late.view("pod-d2", 0)
                assert view is not None and view.partial and view.stale
                # a bridge that starts afresh (core mode) resets every view of the rank
                blind.bridge.stop(timeout=15)
                await blind.start()
                blind.publish(5)
                await wait_until(lambda: blind.caught_up(watcher) and blind.caught_up(late), 20, "the fresh start")
                view = late.view("pod-d2", 0)
                assert view is not None and not view.partial and not view.stale
                # caught up means a batch's first group message is applied; its other groups' follow
                await wait_until(lambda: _resident(late, "pod-d2") == _resident(watcher, "pod-d2"), 10,
                                 "the late view equal to the watcher's")
                assert any(_resident(late, "pod-d2").values()), "blocks stored after the fresh start"
    finally:
        whole.close()
        blind.close()


async def test_tail_since_snapshot_prints_each_ranks_snapshot_first(nats_server: NatsServerProcess,
                                                                    tmp_path: Path) -> None:
    """`kv-bridge tail --since snapshot --json --count N` as a process, two
    ranks behind a JetStream bridge: a `snapshot` line per rank, then N
    messages, none of them already in its rank's snapshot."""
    url = nats_server.url
    worker = Worker(tmp_path, "pod-e", url, ranks=2, jetstream=True)
    count = 6
    try:
        async with live_index(url) as watcher:
            await worker.start()
            worker.publish(30)
            await wait_until(lambda: worker.caught_up(watcher), 20, "the watcher")
        argv = [sys.executable, "-m", "bridge", "tail", "--nats-url", url, "--since", "snapshot", "--json",
                "--count", str(count)]
        buffer: list[str] = []
        errors = tmp_path / "tail.err"
        with errors.open("wb") as err:
            proc = await anyio.open_process(argv, cwd=ROOT, stderr=err)
        async with proc:

            async def read() -> None:
                assert proc.stdout is not None
                async for chunk in TextReceiveStream(proc.stdout):
                    buffer.append(chunk)

            async with anyio.create_task_group() as tg:
                tg.start_soon(read)
                with anyio.fail_after(30):
                    # once the snapshots are out, publish until tail has its N messages and exits
                    while await _running(proc):
                        if sum(part.count("\n") for part in buffer) >= 2:
                            worker.publish(1)
                        await anyio.sleep(0.1)
            assert proc.returncode == 0, errors.read_text()
        lines = [json.loads(line) for line in "".join(buffer).splitlines()]
    finally:
        worker.close()
    snaps, rest = lines[:2], lines[2:]
    assert [(d["type"], d["worker"], d["dp_rank"]) for d in snaps] == [("snapshot", "pod-e", 0),
                                                                       ("snapshot", "pod-e", 1)], lines
    for snap in snaps:
        assert snap["complete"] and snap["last_seq"] == 29 and snap["stream_seq"] > 0 and snap["through"]
        assert snap["groups"]["0"]["media"]["GPU"]["trusted"] > 0
    assert len(rest) == count and all(d["type"] in ("group", "record") for d in rest), rest
    after = {snap["dp_rank"]: snap["stream_seq"] for snap in snaps}
    for doc in rest:
        assert doc["stream_seq"] > after[doc["message"]["dp_rank"]], (doc, after)
        if doc["type"] == "group":
            assert doc["message"]["seq"] >= 30


async def _running(proc: anyio.abc.Process) -> bool:
    with anyio.move_on_after(0.01):
        await proc.wait()
    return proc.returncode is None


async def test_least_privilege_reader_bootstraps_and_bridge_rebuilds(tmp_path: Path) -> None:
    """Users with the least privilege of tests/security (bridge_permissions,
    reader_permissions), JetStream: the reader's late consumers bootstrap
    from the bridge's service while it runs and from the bucket (and the
    stream after it) once it is killed; the restarted bridge rebuilds from
    both under its own permissions."""
    pw = {"bridge-w1": secret_word(), "reader": secret_word()}
    users = {"bridge-w1": bridge_permissions("w1"), "reader": reader_permissions()}
    lines = [f'      {{ user: "{name}", password: "{pw[name]}", permissions: {perms.conf()} }}'
             for name, perms in users.items()]
    config = "accounts {\n  KV: {\n    jetstream: enabled\n    users: [\n" + ",\n".join(lines) + "\n    ]\n  }\n}\n"
    server = start_server(tmp_path, config, jetstream=True)
    reader = settings_for(server.url, environ={"KVB_NATS_PASSWORD": pw["reader"]}, nats_user="reader",
                          nats_inbox_prefix=READER_INBOX)
    worker = Worker(tmp_path, "w1", server.url, jetstream=True,
                    extra=("--nats-user", "bridge-w1", "--snapshot-interval", "1"),
                    env={"KVB_NATS_PASSWORD": pw["bridge-w1"]})
    boot = BootstrapOptions(discover_s=0.3)
    try:
        async with late_index(server.url, settings=reader) as (watcher, _):
            await worker.start()
            worker.publish(40, clear_at=10)
            await wait_until(lambda: worker.caught_up(watcher), 20, "the watcher")
            async with late_index(server.url, settings=reader, bootstrap=boot) as (late, sub):
                worker.publish(10)
                await wait_until(lambda: worker.caught_up(watcher) and worker.caught_up(late), 20, "the reader")
                assert [s.source for s in sub.sources] == ["service"], sub.sources
                assert index_state(late) == index_state(watcher)
            await worker.wait_logged("snapshot_written")
            worker.publish(20)
            await wait_until(lambda: worker.caught_up(watcher), 20, "the watcher")
            await anyio.to_thread.run_sync(worker.bridge.kill9)
            async with late_index(server.url, settings=reader, since=StartAt("snapshot"), bootstrap=boot) as (
                    late, sub):
                await wait_until(lambda: index_state(late) == index_state(watcher), 10, "the reader, from the bucket")
                assert [s.source for s in sub.sources] == ["bucket"], sub.sources
            await worker.start()
            rebuilt = await worker.wait_logged("snapshot_rebuilt")
            assert rebuilt["from_snapshot"] is True and rebuilt["partial"] is False, rebuilt
            worker.publish(10)
            await wait_until(lambda: worker.caught_up(watcher), 20, "the watcher")
            async with late_index(server.url, settings=reader, bootstrap=boot) as (late, sub):
                await wait_until(lambda: worker.caught_up(late), 20, "the reader")
                assert [s.source for s in sub.sources] == ["service"], sub.sources
                assert index_state(late) == index_state(watcher)
        for proc in worker.bridges:
            events = {e.get("event") for e in proc.logs()}
            assert not events & {"nats_permission_denied", "snapshot_service_failed", "snapshot_bucket_unavailable",
                                 "snapshot_write_failed", "snapshot_rebuild_failed", "snapshot_bucket_unreadable"}, \
                events
    finally:
        worker.close()
        server.stop()


async def test_snapshots_in_parts_under_a_small_max_payload(tmp_path: Path) -> None:
    """A server with max_payload 16 KiB, JetStream mode, bytes hashes: the
    service answers a snapshot in several parts and the bucket keeps it in
    several; late consumers join them, from the service and from the bucket,
    to the watcher's view."""
    server = start_server(tmp_path, "max_payload: 16384\n", jetstream=True)
    url = server.url
    worker = Worker(tmp_path, "pod-f", url, jetstream=True)
    boot = BootstrapOptions(discover_s=0.3)
    try:
        async with live_index(url) as watcher:
            await worker.start()
            worker.publish(60, clear_at=10)
            await wait_until(lambda: worker.caught_up(watcher), 20, "the watcher")
            async with late_index(url, bootstrap=boot) as (late, sub):
                worker.publish(5)
                await wait_until(lambda: worker.caught_up(watcher) and worker.caught_up(late), 20, "the late consumer")
                assert [s.source for s in sub.sources] == ["service"]
                assert index_state(late) == index_state(watcher)
            text = (await anyio.to_thread.run_sync(http_get, f"http://127.0.0.1:{worker.http}/metrics"))[1]
            assert metric_value(text, "kvbridge_snapshot_requests_total", result="part") >= 1, "answered in parts"
            assert await anyio.to_thread.run_sync(lambda: worker.bridge.stop(timeout=20)) == 0
            await wait_until(lambda: not watcher.view("pod-f", 0).watching, 10, "the stop record")  # type: ignore[union-attr]
            (written,) = worker.logged("snapshot_written")
            assert written["parts"] >= 2, written
            async with late_index(url, since=StartAt("snapshot"), bootstrap=boot) as (late, sub):
                await wait_until(lambda: index_state(late) == index_state(watcher), 10, "the late consumer")
                assert [s.source for s in sub.sources] == ["bucket"]
    finally:
        worker.close()
        server.stop()
