"""Least privilege against a real nats-server with JetStream: each bridge's
NATS user may publish only its own worker's subjects (each rank's), call only
the JetStream API the bridge needs, write only its own registry key; readers
are read-only. Both forms of the set-up in docs/security.md: accounts with
users in the server config, and operator/account/user JWTs (`.creds`).

- a bridge under its permissions works, JetStream and core mode;
- a bridge whose worker id its user may not publish says so at start (one
  log line naming the subject and the violation), is not ready, counts it,
  keeps running (no crash loop), and in JetStream mode does not stall;
- a bridge allowed rank 0 but not rank 1 loses nothing of rank 0.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio
import nats
import nats.errors
import pytest

from bridge.contract import GroupMessage, WorkerRecord
from bridge.runtime.nats_barrier import flushed
from bridge.runtime.nats_server import NatsServerProcess
from bridge.runtime.ports import free_port
from tests.busutil import rank_publishers
from tests.faults.harness import BridgeProcess, fault_batch, http_get, ident, metric_value, wait_http
from tests.security.secure_nats import (
    READER_INBOX,
    Permissions,
    bridge_permissions,
    make_operator,
    reader_permissions,
    secret_word,
    start_server,
)

pytestmark = pytest.mark.anyio

BATCHES = 20


class Worker:
    """vLLM's publishers for `ranks` data-parallel ranks and a bridge for them."""

    def __init__(self, tmp: Path, worker: str, ranks: int, url: str, auth: list[str], env: dict[str, str],
                 jetstream: bool) -> None:
        self.worker = worker
        self.ranks = ranks
        self.sent = 0
        pub_port, replay_port, self.pubs = rank_publishers(ranks)
        self.http = free_port()
        args = ["--zmq-endpoint", f"tcp://127.0.0.1:{pub_port}", "--replay-endpoint",
                f"tcp://127.0.0.1:{replay_port}", "--dp-ranks", str(ranks), "--nats-url", url, "--worker-id",
                worker, "--http-port", str(self.http), "--http-host", "127.0.0.1", "--drain-timeout", "3",
                *auth, *(["--jetstream"] if jetstream else [])]
        clean = {k: v for k, v in os.environ.items() if not k.startswith("KVB_")}
        self.bridge = BridgeProcess(args, tmp / f"{worker}.log", env={})
        self.bridge.env = {**clean, **env}

    def start(self) -> Worker:
        self.bridge.start()
        return self

    def publish(self, count: int) -> None:
        """`count` more batches on every rank, numbered on from the last."""
        for rank, pub in enumerate(self.pubs):
            for k in range(self.sent, self.sent + count):
                pub.publish(fault_batch(rank, k))
        self.sent += count

    def metrics(self) -> str:
        return http_get(f"http://127.0.0.1:{self.http}/metrics")[1]

    def denials(self) -> list[dict[str, Any]]:
        return [e for e in self.bridge.logs() if e.get("event") == "nats_permission_denied"]

    def close(self) -> None:
        self.bridge.stop()
        for pub in self.pubs:
            pub.close()


def _accounts_config(users: dict[str, tuple[str, Permissions]]) -> str:
    """Accounts with users (docs/security.md): one account with JetStream."""
    lines = [f'      {{ user: "{name}", password: "{pw}", permissions: {perms.conf()} }}'
             for name, (pw, perms) in users.items()]
    return "accounts {\n  KV: {\n    jetstream: enabled\n    users: [\n" + ",\n".join(lines) + "\n    ]\n  }\n}\n"


async def _reader(url: str, **auth: Any) -> tuple[Any, list[tuple[str, GroupMessage | WorkerRecord]], list[str]]:
    errors: list[str] = []
    seen: list[tuple[str, GroupMessage | WorkerRecord]] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    async def on_msg(msg: Any) -> None:
        import msgspec

        type_: type[GroupMessage | WorkerRecord] = WorkerRecord if msg.subject.endswith(".worker") else GroupMessage
        seen.append((msg.subject, msgspec.msgpack.decode(msg.data, type=type_)))

    nc = await nats.connect(url, error_cb=on_error, **auth)
    await nc.subscribe("kv.>", cb=on_msg)
    await flushed(nc)
    return nc, seen, errors


def _batches(seen: list[tuple[str, GroupMessage | WorkerRecord]], worker: str, rank: int) -> set[int]:
    """Batches k of publisher `rank` whose both group messages a reader saw."""
    lookup = {ident(rank, k): k for k in range(BATCHES * 2)}
    groups: dict[int, set[int]] = {}
    for _, body in seen:
        if isinstance(body, GroupMessage) and body.worker == worker and body.dp_rank == rank and body.events:
            first = body.events[0].block_hashes[0] if body.events[0].block_hashes else None
            k = lookup.get(first) if isinstance(first, bytes) else None
            if k is not None:
                groups.setdefault(k, set()).add(body.group)
    return {k for k, g in groups.items() if g >= {0, 2}}


async def _stream_batches(url: str, worker: str, rank: int, **auth: Any) -> set[int]:
    """What the stream holds of a worker's rank, read as a reader reads: stream info and direct gets."""
    import msgspec

    nc = await nats.connect(url, **auth)
    try:
        js = nc.jetstream()
        info = await js.stream_info("KV_EVENTS")
        items: list[tuple[str, GroupMessage | WorkerRecord]] = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            raw = await js.get_msg("KV_EVENTS", seq, direct=True)
            assert raw.subject is not None and raw.data is not None
            type_: type[GroupMessage | WorkerRecord] = WorkerRecord if raw.subject.endswith(".worker") else GroupMessage
            items.append((raw.subject, msgspec.msgpack.decode(raw.data, type=type_)))
        return _batches(items, worker, rank)
    finally:
        await nc.close()


async def _wait(cond: Any, timeout: float = 30.0) -> None:
    with anyio.fail_after(timeout):
        while not await cond():
            await anyio.sleep(0.2)


async def _assert_refused_at_start(worker: Worker, subject_prefix: str) -> None:
    """One clear log line naming the subject and the violation, /readyz false,
    the metric, the process alive a while later, and nothing left unacked."""
    def ours() -> list[dict[str, Any]]:
        return [e for e in worker.denials() if e["subject"].startswith(subject_prefix)]

    async def said() -> bool:
        return bool(await anyio.to_thread.run_sync(ours))

    await _wait(said, 30)
    line = ours()[0]
    assert line["subject"].startswith(subject_prefix), line
    assert "permissions violation for publish" in line["violation"].lower(), line
    assert line["operation"] == "publish" and line["level"] == "error"
    worker.publish(5)
    await anyio.sleep(2.0)
    assert worker.bridge.proc is not None and worker.bridge.proc.poll() is None, "the bridge exited"
    status, body = await anyio.to_thread.run_sync(http_get, f"http://127.0.0.1:{worker.http}/readyz")
    assert status == 503, body
    text = await anyio.to_thread.run_sync(worker.metrics)
    assert metric_value(text, "kvbridge_nats_permission_denied_total", operation="publish") >= 1
    assert metric_value(text, "kvbridge_js_in_flight_messages") == 0, "forbidden publishes hold up the window"
    # one line per subject, not one per message
    subjects = [e["subject"] for e in worker.denials()]
    assert len(subjects) == len(set(subjects)), subjects


async def test_least_privilege_users_both_modes_and_a_reader(tmp_path: Path) -> None:
    """Accounts with users: bridge w1 (JetStream, two ranks) and bridge w2
    (core) under their own permissions; a read-only reader sees everything,
    reads the stream and the registry, and may publish nothing."""
    pw = {name: secret_word() for name in ("bridge-w1", "bridge-w2", "reader")}
    server: NatsServerProcess = start_server(tmp_path, _accounts_config({
        "bridge-w1": (pw["bridge-w1"], bridge_permissions("w1", ranks=2)),
        "bridge-w2": (pw["bridge-w2"], bridge_permissions("w2")),
        "reader": (pw["reader"], reader_permissions()),
    }), jetstream=True)
    reader_auth = {"user": "reader", "password": pw["reader"], "inbox_prefix": READER_INBOX}
    js_worker = Worker(tmp_path, "w1", 2, server.url, ["--nats-user", "bridge-w1"],
                       {"KVB_NATS_PASSWORD": pw["bridge-w1"]}, jetstream=True)
    core_worker = Worker(tmp_path, "w2", 1, server.url, ["--nats-user", "bridge-w2"],
                         {"KVB_NATS_PASSWORD": pw["bridge-w2"]}, jetstream=False)
    nc = None
    try:
        js_worker.start()
        await wait_http(js_worker.http, timeout=30)  # the stream exists before the core bridge publishes
        core_worker.start()
        await wait_http(core_worker.http, timeout=30)
        nc, seen, errors = await _reader(server.url, **reader_auth)
        js_worker.publish(BATCHES)
        core_worker.publish(BATCHES)

        async def all_seen() -> bool:
            return all(_batches(seen, w, r) == set(range(BATCHES)) for w, r in (("w1", 0), ("w1", 1), ("w2", 0)))

        await _wait(all_seen)
        for rank in (0, 1):
            assert await _stream_batches(server.url, "w1", rank, **reader_auth) == set(range(BATCHES))
        # the registry, as a reader reads it
        registry = await nc.jetstream().key_value("kv_workers")
        for key in ("w1", "w2"):
            entry = await registry.get(key)
            assert entry.value and b'"worker"' in entry.value
        # the reader may not publish on the events
        await nc.publish("kv.w1.0", b"forged")
        await nc.flush()
        await anyio.sleep(0.3)
        assert any('permissions violation for publish to "kv.w1.0"' in e.lower() for e in errors), errors
        assert await anyio.to_thread.run_sync(js_worker.bridge.stop) == 0
        assert await anyio.to_thread.run_sync(core_worker.bridge.stop) == 0
    finally:
        if nc is not None:
            await nc.close()
        js_worker.close()
        core_worker.close()
        server.stop()
    for worker in (js_worker, core_worker):
        events = [e.get("event") for e in worker.bridge.logs()]
        assert "nats_permission_denied" not in events, worker.worker
        assert "registry_unavailable" not in events, worker.worker
        for secret in pw.values():
            assert secret not in worker.bridge.log_path.read_text()


async def test_a_worker_id_the_user_may_not_publish_is_refused_clearly(tmp_path: Path) -> None:
    """User bridge-w1 may publish kv.w1.> only; bridges started as `intruder`
    (JetStream) and `intruder-core` (core) with its credentials."""
    password = secret_word()
    server = start_server(tmp_path, _accounts_config({"bridge-w1": (password, bridge_permissions("w1"))}),
                          jetstream=True)
    # The stolen credentials used as they work: with their user's inbox prefix.
    auth, env = ["--nats-user", "bridge-w1", "--nats-inbox-prefix", "_INBOX.bridge-w1"], {"KVB_NATS_PASSWORD": password}
    js_worker = Worker(tmp_path, "intruder", 1, server.url, auth, env, jetstream=True).start()
    core_worker = Worker(tmp_path, "intruder-core", 1, server.url, auth, env, jetstream=False).start()
    try:
        await wait_http(js_worker.http, "/healthz", timeout=30)
        await wait_http(core_worker.http, "/healthz", timeout=30)
        await _assert_refused_at_start(js_worker, "kv.intruder.")
        await _assert_refused_at_start(core_worker, "kv.intruder-core.")
        # JetStream: its last message could not be read back either; it started fresh, saying so
        assert any(e.get("event") == "resume_point_forbidden" for e in js_worker.bridge.logs())
        assert await anyio.to_thread.run_sync(js_worker.bridge.stop) == 0
        assert await anyio.to_thread.run_sync(core_worker.bridge.stop) == 0
    finally:
        js_worker.close()
        core_worker.close()
        server.stop()


async def test_a_rank_the_user_may_not_publish_costs_nothing_of_the_others(tmp_path: Path) -> None:
    """User bridge-w3 may publish rank 0 (kv.w3.>) but not rank 1
    (kv.w3-dp1.>); the bridge runs both ranks, JetStream. Rank 0 is stored
    whole; rank 1 is refused, said and counted; nothing stalls."""
    password, reading = secret_word(), secret_word()
    server = start_server(tmp_path, _accounts_config({
        "bridge-w3": (password, bridge_permissions("w3", ranks=1)),
        "reader": (reading, reader_permissions()),
    }), jetstream=True)
    worker = Worker(tmp_path, "w3", 2, server.url, ["--nats-user", "bridge-w3"], {"KVB_NATS_PASSWORD": password},
                    jetstream=True).start()
    reader = {"user": "reader", "password": reading, "inbox_prefix": READER_INBOX}
    try:
        await wait_http(worker.http, "/healthz", timeout=30)
        worker.publish(BATCHES)
        await _assert_refused_at_start(worker, "kv.w3-dp1.")

        async def rank0_stored() -> bool:
            return await _stream_batches(server.url, "w3", 0, **reader) == set(range(BATCHES + 5))

        await _wait(rank0_stored)
        assert await _stream_batches(server.url, "w3", 1, **reader) == set()
        assert await anyio.to_thread.run_sync(worker.bridge.stop) == 0
    finally:
        worker.close()
        server.stop()


async def test_least_privilege_with_operator_account_and_user_jwts(tmp_path: Path) -> None:
    """The same permissions in user JWTs (`.creds`), an account JWT with
    JetStream: a bridge in each mode works under its own; one started with
    another worker's id is refused clearly."""
    op = make_operator(jetstream=True)
    good_js = tmp_path / "wj.creds"
    good_core = tmp_path / "wc.creds"
    reader = tmp_path / "reader.creds"
    op.creds(good_js, permissions=bridge_permissions("wj"), name="bridge-wj")
    op.creds(good_core, permissions=bridge_permissions("wc"), name="bridge-wc")
    op.creds(reader, permissions=reader_permissions(), name="reader")
    server = start_server(tmp_path, op.server_config(), jetstream=True)
    js_worker = Worker(tmp_path, "wj", 1, server.url, ["--nats-creds-file", str(good_js)], {}, jetstream=True)
    core_worker = Worker(tmp_path, "wc", 1, server.url, ["--nats-creds-file", str(good_core)], {}, jetstream=False)
    intruder = Worker(tmp_path, "wx", 1, server.url, ["--nats-creds-file", str(good_js), "--nats-inbox-prefix",
                                                      "_INBOX.bridge-wj"], {}, jetstream=True)
    nc = None
    try:
        js_worker.start()
        await wait_http(js_worker.http, timeout=30)
        core_worker.start()
        intruder.start()
        await wait_http(core_worker.http, timeout=30)
        nc, seen, _ = await _reader(server.url, user_credentials=str(reader), inbox_prefix=READER_INBOX)
        js_worker.publish(BATCHES)
        core_worker.publish(BATCHES)

        async def all_seen() -> bool:
            return all(_batches(seen, w, 0) == set(range(BATCHES)) for w in ("wj", "wc"))

        await _wait(all_seen)
        assert await _stream_batches(server.url, "wj", 0, user_credentials=str(reader),
                                     inbox_prefix=READER_INBOX) == set(range(BATCHES))
        await _assert_refused_at_start(intruder, "kv.wx.")
        for worker in (js_worker, core_worker, intruder):
            assert await anyio.to_thread.run_sync(worker.bridge.stop) == 0
    finally:
        if nc is not None:
            await nc.close()
        for worker in (js_worker, core_worker, intruder):
            worker.close()
        server.stop()
    for worker in (js_worker, core_worker):
        assert not worker.denials(), worker.worker
