"""The attack table (docs/security.md, "What each credential cannot do"):
against a real nats-server configured from `kv-bridge nats-permissions`,
with two real bridges (workers `a` and `b`), an attacker holding a's
bridge credentials or a reader's tries everything issue 24 lists and the
obvious variants. Each row says what was tried, with whose credentials, and
what happened; an admin user reads back that nothing of b's, and nothing
shared, changed. The last rows write through reply subjects, which subject
permissions cannot stop (docs/security.md, "What the permissions cannot
stop"): the server stores the copy, and the row reads back that a reader's
consumers refused it.

The table is printed in the test output (`pytest -s` not needed)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec
import nats
import nats.errors
import nats.js.api
import nats.js.errors
import pytest

from bridge.apps.permissions import Layout, roles, server_config
from bridge.client.bootstrap import BootstrapOptions, fetch
from bridge.client.bucket import open_snapshot_bucket
from bridge.client.connection import BusConnection, settings_for
from bridge.client.identity import IdentityGuard
from bridge.client.registry import RegistryFollower
from bridge.client.subscribe import BusItem, BusMessage, BusSubscriber, StartAt
from bridge.contract import BlockStored, GroupMessage, WorkerRecord
from bridge.contract.identity import Refusal, reply_copy
from bridge.contract.snapshot import (
    SNAPSHOT_VERSION,
    RankSnapshot,
    SnapshotHead,
    SnapshotMissing,
    encode_head,
    encode_part,
    encode_snapshot,
    split,
)
from bridge.runtime.nats_barrier import flushed
from bridge.runtime.nats_server import NatsServerProcess
from tests.faults.harness import ATTN_GROUP, http_get, wait_http
from tests.security.secure_nats import secret_word, start_server
from tests.security.test_least_privilege import Worker

pytestmark = pytest.mark.anyio

REFUSED = "refused"
HARMLESS = "harmless"
# The bus delivers it on the publisher's own subject; consumers take the
# worker from the subject and refuse a payload that names another (issue 24, 1).
CONSUMER = "consumers refuse"


@dataclass
class Row:
    mode: str
    who: str
    attempt: str
    expected: str
    outcome: str = ""
    verdict: str = ""


@dataclass
class Client:
    """One user's connection, with the server's asynchronous errors kept."""

    nc: Any
    errors: list[str] = field(default_factory=list)

    async def _refused(self, needle: str, before: int, wait: float = 0.6) -> str | None:
        with anyio.move_on_after(wait):
            while True:
                for err in self.errors[before:]:
                    if needle in err.lower():
                        return err
                await anyio.sleep(0.02)
        return None

    async def publish(self, subject: str, data: bytes = b"x", headers: dict[str, str] | None = None) -> str:
        before = len(self.errors)
        await self.nc.publish(subject, data, headers=headers)
        await self.nc.flush()
        if await self._refused(f'permissions violation for publish to "{subject.lower()}"', before):
            return "refused: permissions violation"
        return "delivered"

    async def subscribe(self, subject: str) -> str:
        before = len(self.errors)
        sub = await self.nc.subscribe(subject)
        await flushed(self.nc)
        refused = await self._refused(f'permissions violation for subscription to "{subject.lower()}"', before)
        await sub.unsubscribe()
        return "refused: permissions violation" if refused else "subscribed"

    async def request(self, subject: str, body: Any = b"", headers: dict[str, str] | None = None) -> str:
        """A request; the answer's JetStream or service error, or what it was."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        before = len(self.errors)
        try:
            msg = await self.nc.request(subject, data, timeout=1.5, headers=headers)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            if await self._refused(f'permissions violation for publish to "{subject.lower()}"', before, 0.3):
                return "refused: permissions violation"
            return "no answer"
        hdrs = msg.headers or {}
        if "Nats-Service-Error-Code" in hdrs:
            size = len(msg.data) + sum(len(k) + len(v) for k, v in hdrs.items())
            return f"error {hdrs['Nats-Service-Error-Code']} ({size} bytes)"
        try:
            answer = json.loads(msg.data)
        except ValueError:
            return f"answered ({len(msg.data)} bytes)"
        if isinstance(answer, dict) and "error" in answer:
            return f"refused by JetStream: {answer['error'].get('description', answer['error'])}"
        return "accepted"

    async def js_publish(self, subject: str, data: bytes, headers: dict[str, str]) -> str:
        before = len(self.errors)
        try:
            await self.nc.jetstream().publish(subject, data, headers=headers, timeout=1.5)
        except nats.js.errors.APIError as exc:
            return f"refused by the stream: {exc.description}"
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            if await self._refused(f'permissions violation for publish to "{subject.lower()}"', before, 0.3):
                return "refused: permissions violation"
            return "no answer"
        return "stored"


async def connect(url: str, user: str, password: str) -> Client:
    client = Client(None)

    async def on_error(exc: Exception) -> None:
        client.errors.append(str(exc))

    client.nc = await nats.connect(url, user=user, password=password, inbox_prefix=f"_INBOX.{user}",
                                   error_cb=on_error, allow_reconnect=False)
    return client


def judge(row: Row) -> None:
    out = row.outcome
    if row.expected == REFUSED:
        row.verdict = "ok" if out.startswith("refused") or out.startswith("error 4") else "FAIL"
    elif row.expected == HARMLESS:
        row.verdict = "ok" if not out.startswith("FAIL") else "FAIL"
    else:
        row.verdict = "bus: delivered on the publisher's own subject" if out == "delivered" else "FAIL"


def table(rows: list[Row]) -> str:
    head = ["mode", "credentials", "attempt", "expected", "what happened", "verdict"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        lines.append(f"| {r.mode} | {r.who} | {r.attempt} | {r.expected} | {r.outcome} | {r.verdict} |")
    return "\n".join(lines)


def _print(rows: list[Row], capsys: pytest.CaptureFixture[str]) -> None:
    with capsys.disabled():
        print("\n" + table(rows) + "\n")


LAYOUT = Layout(workers=["a", "b"], readers=["reader", "reader2"])


def _server(tmp: Path, jetstream: bool) -> tuple[NatsServerProcess, dict[str, str]]:
    all_roles = roles(LAYOUT)
    pw = {r.user: secret_word() for r in all_roles}
    conf = server_config(all_roles, passwords=pw)
    if not jetstream:
        conf = conf.replace("    jetstream: enabled\n", "")
    return start_server(tmp, conf, jetstream=jetstream), pw


def _bridge(tmp: Path, worker: str, url: str, pw: dict[str, str], jetstream: bool) -> Worker:
    user = f"bridge-{worker}"
    return Worker(tmp, worker, 1, url, ["--nats-user", user, "--snapshot-interval", "1"],
                  {"KVB_NATS_PASSWORD": pw[user]}, jetstream=jetstream)


Attempt = tuple[str, str, str, Callable[[], Awaitable[str]]]


async def _common(mode: str, a: Client, reader: Client) -> list[Attempt]:
    """What both modes share: subjects, records, service subjects, inboxes, requests."""
    big = json.dumps({"id": "x" * (900 * 1024), "part": 1}).encode()
    forged_group = msgspec.msgpack.encode(GroupMessage(
        v=1, worker="b", dp_rank=0, epoch=1, seq=1, ts=0.0, group=0, kind="full_attention", family="attention",
        kind_source="event", events=[BlockStored(block_hashes=[7], parent_block_hash=None, token_ids=[], block_size=16,
                                                 lora_id=None, medium="GPU", lora_name=None)]))
    forged_restart = msgspec.msgpack.encode(WorkerRecord(v=1, worker="b", dp_rank=0, epoch=2**62, type="restart",
                                                         ts=0.0))
    return [
        ("bridge a", "publish b's group subject kv.b.0", REFUSED, lambda: a.publish("kv.b.0")),
        ("bridge a", "publish a restart record for b on kv.b.worker", REFUSED, lambda: a.publish("kv.b.worker")),
        ("bridge a", "publish b's rank 1, kv.b-dp1.0", REFUSED, lambda: a.publish("kv.b-dp1.0")),
        ("bridge a", "publish outside the prefix, kvx.b.0", REFUSED, lambda: a.publish("kvx.b.0")),
        ("bridge a", "a group message saying worker b, on its own kv.a.0", CONSUMER,
         lambda: a.publish("kv.a.0", forged_group)),
        ("bridge a", "a restart record for b (a later epoch), on its own kv.a.worker", CONSUMER,
         lambda: a.publish("kv.a.worker", forged_restart)),
        ("bridge a", "read the events, subscribe kv.>", REFUSED, lambda: a.subscribe("kv.>")),
        ("bridge a", "serve b's snapshots, subscribe kvbridge.snapshot.kv.b", REFUSED,
         lambda: a.subscribe("kvbridge.snapshot.kv.b")),
        ("bridge a", "read every reply, subscribe _INBOX.>", REFUSED, lambda: a.subscribe("_INBOX.>")),
        ("bridge a", "read b's replies, subscribe _INBOX.bridge-b.>", REFUSED,
         lambda: a.subscribe("_INBOX.bridge-b.>")),
        ("bridge a", "answer observe's queries, subscribe kvobserve.prefix", REFUSED,
         lambda: a.subscribe("kvobserve.prefix")),
        ("reader", "publish kv.a.0", REFUSED, lambda: reader.publish("kv.a.0")),
        ("reader", "publish a record kv.a.worker", REFUSED, lambda: reader.publish("kv.a.worker")),
        ("reader", "read another reader's replies, subscribe _INBOX.reader2.>", REFUSED,
         lambda: reader.subscribe("_INBOX.reader2.>")),
        ("reader", "read every reply, subscribe _INBOX.>", REFUSED, lambda: reader.subscribe("_INBOX.>")),
        ("reader", "serve a's snapshots, subscribe kvbridge.snapshot.kv.a", REFUSED,
         lambda: reader.subscribe("kvbridge.snapshot.kv.a")),
        ("reader", "snapshot request of 900 KiB (a long id) to a", REFUSED,
         lambda: reader.request("kvbridge.snapshot.kv.a", big)),
        ("reader", "malformed snapshot request to a", REFUSED, lambda: reader.request("kvbridge.snapshot.kv.a", b"{no")),
        ("reader", "snapshot request whose id holds CR LF and a header", REFUSED,
         lambda: reader.request("kvbridge.snapshot.kv.a", {"id": "1\r\nNats-Rollup: all\r\n", "part": 1})),
    ]


async def _snapshot_to_a_stream(reader: Client, admin: Any, subject: str,
                                request: str = "kvbridge.snapshot.kv.a") -> str:
    """A request to the bridges whose reply subject is one of the stream's:
    they answer inboxes only."""
    js = admin.jetstream()

    async def count() -> int:
        info = await js.stream_info("KV_EVENTS", subjects_filter=subject)
        return (info.state.subjects or {}).get(subject, 0)

    before = await count()
    await reader.nc.publish(request, b"", reply=subject)
    await reader.nc.flush()
    await anyio.sleep(0.5)
    return "nothing written" if await count() == before else "FAIL: written into the stream"


async def test_attack_table_jetstream(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    server, pw = _server(tmp_path, jetstream=True)
    workers = [_bridge(tmp_path, w, server.url, pw, jetstream=True) for w in ("a", "b")]
    clients: list[Client] = []
    rows: list[Row] = []
    try:
        workers[0].start()
        await wait_http(workers[0].http, timeout=30)
        workers[1].start()
        await wait_http(workers[1].http, timeout=30)
        for w in workers:
            w.publish(10)
        admin = await connect(server.url, "admin", pw["admin"])
        a = await connect(server.url, "bridge-a", pw["bridge-a"])
        reader = await connect(server.url, "reader", pw["reader"])
        clients += [admin, a, reader]
        ajs = admin.nc.jetstream()

        async def settled() -> bool:
            try:
                heads = [await ajs.get_last_msg("KV_kv_snapshots", f"$KV.kv_snapshots.{w}") for w in ("a", "b")]
                regs = [await ajs.get_last_msg("KV_kv_workers", f"$KV.kv_workers.{w}") for w in ("a", "b")]
            except nats.js.errors.NotFoundError:
                return False
            info = await ajs.stream_info("KV_EVENTS", subjects_filter="kv.b.>")
            return bool(heads and regs) and info.state.messages > 0

        with anyio.fail_after(30):
            while not await settled():
                await anyio.sleep(0.3)
        # A durable consumer of someone else's, and the state to read back.
        await ajs.add_consumer("KV_EVENTS", nats.js.api.ConsumerConfig(
            durable_name="someone-elses", ack_policy=nats.js.api.AckPolicy.EXPLICIT, filter_subject="kv.>"))
        before = await _state(ajs)

        attempts = await _common("jetstream", a, reader)
        rollup = {"Nats-Rollup": "all"}
        attempts += [
            ("bridge a", "put b's registry key $KV.kv_workers.b", REFUSED, lambda: a.publish("$KV.kv_workers.b")),
            ("bridge a", "delete marker on b's registry key", REFUSED,
             lambda: a.publish("$KV.kv_workers.b", b"", {"KV-Operation": "DEL"})),
            ("bridge a", "put b's snapshot head $KV.kv_snapshots.b", REFUSED,
             lambda: a.publish("$KV.kv_snapshots.b")),
            ("bridge a", "put a part of b's snapshot $KV.kv_snapshots.b.a.0", REFUSED,
             lambda: a.publish("$KV.kv_snapshots.b.a.0")),
            ("bridge a", "Nats-Rollup: all on its own registry key", REFUSED,
             lambda: a.js_publish("$KV.kv_workers.a", b"{}", rollup)),
            ("bridge a", "Nats-Rollup: all on its own snapshot key", REFUSED,
             lambda: a.js_publish("$KV.kv_snapshots.a.b.9", b"{}", rollup)),
            ("bridge a", "Nats-Rollup: sub on its own snapshot head", REFUSED,
             lambda: a.js_publish("$KV.kv_snapshots.a", b"{}", {"Nats-Rollup": "sub"})),
            ("bridge a", "Nats-Rollup: all on its own events subject kv.a.0", REFUSED,
             lambda: a.js_publish("kv.a.0", b"x", rollup)),
            ("bridge a", "purge the stream", REFUSED, lambda: a.request("$JS.API.STREAM.PURGE.KV_EVENTS", {})),
            ("bridge a", "purge b's subjects from the stream", REFUSED,
             lambda: a.request("$JS.API.STREAM.PURGE.KV_EVENTS", {"filter": "kv.b.>"})),
            ("bridge a", "purge the registry bucket", REFUSED, lambda: a.request("$JS.API.STREAM.PURGE.KV_kv_workers", {})),
            ("bridge a", "delete a stream message", REFUSED,
             lambda: a.request("$JS.API.STREAM.MSG.DELETE.KV_EVENTS", {"seq": 1})),
            ("bridge a", "delete the stream", REFUSED, lambda: a.request("$JS.API.STREAM.DELETE.KV_EVENTS")),
            ("bridge a", "update the stream to allow rollups", REFUSED,
             lambda: a.request("$JS.API.STREAM.UPDATE.KV_EVENTS", {"name": "KV_EVENTS", "subjects": ["kv.>"],
                                                                   "allow_rollup_hdrs": True})),
            ("bridge a", "create the stream again, rollups allowed", REFUSED,
             lambda: a.request("$JS.API.STREAM.CREATE.KV_EVENTS", {"name": "KV_EVENTS", "subjects": ["kv.>"],
                                                                   "allow_rollup_hdrs": True, "allow_direct": True})),
            ("bridge a", "create the registry bucket again, rollups allowed", REFUSED,
             lambda: a.request("$JS.API.STREAM.CREATE.KV_kv_workers", {
                 "name": "KV_kv_workers", "subjects": ["$KV.kv_workers.>"], "allow_rollup_hdrs": True,
                 "max_msgs_per_subject": 1, "allow_direct": True})),
            ("bridge a", "read b's last message (direct get kv.b.>)", REFUSED,
             lambda: a.request("$JS.API.DIRECT.GET.KV_EVENTS.kv.b.>")),
            ("bridge a", "read b's snapshot head (direct get)", REFUSED,
             lambda: a.request("$JS.API.DIRECT.GET.KV_kv_snapshots.$KV.kv_snapshots.b")),
            ("bridge a", "create b's rebuild consumer", REFUSED,
             lambda: a.request("$JS.API.CONSUMER.CREATE.KV_EVENTS.kvb-rebuild-b.kv.b.>", {
                 "stream_name": "KV_EVENTS", "config": {"name": "kvb-rebuild-b", "filter_subject": "kv.b.>"}})),
            ("bridge a", "its own rebuild consumer, filtered on b's subjects", REFUSED,
             lambda: a.request("$JS.API.CONSUMER.CREATE.KV_EVENTS.kvb-rebuild-a.kv.a.>", {
                 "stream_name": "KV_EVENTS", "config": {"name": "kvb-rebuild-a", "filter_subject": "kv.b.>"}})),
            ("bridge a", "its own rebuild consumer on the snapshot bucket, filtered on b's keys", REFUSED,
             lambda: a.request("$JS.API.CONSUMER.CREATE.KV_kv_snapshots.kvb-rebuild-a.$KV.kv_snapshots.b.>", {
                 "stream_name": "KV_kv_snapshots", "config": {"name": "kvb-rebuild-a",
                                                              "filter_subject": "$KV.kv_snapshots.b.>"}})),
            ("bridge a", "its own rebuild consumer on the snapshot bucket, its key in the subject, b's in the body",
             REFUSED, lambda: a.request("$JS.API.CONSUMER.CREATE.KV_kv_snapshots.kvb-rebuild-a.$KV.kv_snapshots.a", {
                 "stream_name": "KV_kv_snapshots", "config": {"name": "kvb-rebuild-a",
                                                              "filter_subject": "$KV.kv_snapshots.b"}})),
            ("bridge a", "delete someone else's consumer", REFUSED,
             lambda: a.request("$JS.API.CONSUMER.DELETE.KV_EVENTS.someone-elses")),
            ("reader", "put $KV.kv_workers.a", REFUSED, lambda: reader.publish("$KV.kv_workers.a")),
            ("reader", "put $KV.kv_snapshots.a", REFUSED, lambda: reader.publish("$KV.kv_snapshots.a")),
            ("reader", "delete someone else's durable consumer", REFUSED,
             lambda: reader.request("$JS.API.CONSUMER.DELETE.KV_EVENTS.someone-elses")),
            ("reader", "delete a bridge's rebuild consumer", REFUSED,
             lambda: reader.request("$JS.API.CONSUMER.DELETE.KV_EVENTS.kvb-rebuild-a")),
            ("reader", "create a named consumer (kvb-rebuild-a)", REFUSED,
             lambda: reader.request("$JS.API.CONSUMER.CREATE.KV_EVENTS.kvb-rebuild-a.kv.a.>", {
                 "stream_name": "KV_EVENTS", "config": {"name": "kvb-rebuild-a", "filter_subject": "kv.a.>"}})),
            ("reader", "create a durable (legacy API)", REFUSED,
             lambda: reader.request("$JS.API.CONSUMER.DURABLE.CREATE.KV_EVENTS.mine", {
                 "stream_name": "KV_EVENTS", "config": {"durable_name": "mine"}})),
            ("reader", "an ephemeral consumer that names someone else's durable", REFUSED,
             lambda: reader.request("$JS.API.CONSUMER.CREATE.KV_EVENTS", {
                 "stream_name": "KV_EVENTS", "config": {"durable_name": "someone-elses"}})),
            ("reader", "ack for another consumer ($JS.ACK)", REFUSED,
             lambda: reader.publish("$JS.ACK.KV_EVENTS.someone-elses.1.1.1.1.0")),
            ("reader", "consumer info of another's consumer", REFUSED,
             lambda: reader.request("$JS.API.CONSUMER.INFO.KV_EVENTS.someone-elses")),
            ("reader", "purge the snapshot bucket", REFUSED,
             lambda: reader.request("$JS.API.STREAM.PURGE.KV_kv_snapshots", {})),
            ("reader", "snapshot request with a stream subject (kv.b.0) as reply", HARMLESS,
             lambda: _snapshot_to_a_stream(reader, admin.nc, "kv.b.0")),
            ("reader", "service discovery ($SRV.INFO) with a stream subject (kv.b.6) as reply", HARMLESS,
             lambda: _snapshot_to_a_stream(reader, admin.nc, "kv.b.6", "$SRV.INFO.kv-bridge-snapshot")),
        ]
        for who, what, expected, run in attempts:
            row = Row("JetStream", who, what, expected)
            try:
                row.outcome = await run()
            except Exception as exc:  # an attempt that breaks the client is an outcome too
                row.outcome = f"client error {type(exc).__name__}"
            judge(row)
            rows.append(row)

        # The bridges keep relaying after all of it, and read back nothing of b's changed.
        for w in workers:
            w.publish(5)
        after = await _wait_state(ajs, before)
        rows.append(_readback("JetStream", before, after))
        for w in workers:
            status, body = await anyio.to_thread.run_sync(http_get, f"http://127.0.0.1:{w.http}/readyz")
            ready = Row("JetStream", "admin", f"bridge {w.worker} still ready and relaying", HARMLESS,
                        f"/readyz {status}, {after['events'][w.worker] - before['events'][w.worker]} new messages")
            ready.verdict = "ok" if status == 200 and after["events"][w.worker] > before["events"][w.worker] else "FAIL"
            rows.append(ready)

        # What subject permissions cannot stop, and consumer names: read back.
        rows += await _reply_copy_rows(a, reader, admin, server.url, pw)
        rows += await _restart_rows(a, admin, workers[1], server.url, pw)
        _print(rows, capsys)
        assert [r for r in rows if r.verdict.startswith("FAIL")] == [], \
            table([r for r in rows if r.verdict.startswith("FAIL")])
        for w in workers:
            assert await anyio.to_thread.run_sync(w.bridge.stop) == 0
    finally:
        for c in clients:
            await c.nc.close()
        for w in workers:
            w.close()
        server.stop()


async def _state(js: Any) -> dict[str, Any]:
    events = {}
    for w in ("a", "b"):
        info = await js.stream_info("KV_EVENTS", subjects_filter=f"kv.{w}.>")
        events[w] = info.state.messages
    regs = {w: (await js.get_last_msg("KV_kv_workers", f"$KV.kv_workers.{w}")).data for w in ("a", "b")}
    heads = {w: json.loads((await js.get_last_msg("KV_kv_snapshots", f"$KV.kv_snapshots.{w}")).data)["worker"]
             for w in ("a", "b")}
    consumer = await js.consumer_info("KV_EVENTS", "someone-elses")
    configs = {name: (await js.stream_info(name)).config for name in ("KV_EVENTS", "KV_kv_workers", "KV_kv_snapshots")}
    return {"events": events, "registry": {w: json.loads(v)["worker"] for w, v in regs.items()}, "heads": heads,
            "consumer": (consumer.config.filter_subject, consumer.config.ack_policy),
            "rollups": {n: bool(c.allow_rollup_hdrs) for n, c in configs.items()}}


async def _wait_state(js: Any, before: dict[str, Any]) -> dict[str, Any]:
    with anyio.move_on_after(15):
        while True:
            after = await _state(js)
            if all(after["events"][w] > before["events"][w] for w in ("a", "b")):
                return after
            await anyio.sleep(0.3)
    return await _state(js)


def _readback(mode: str, before: dict[str, Any], after: dict[str, Any]) -> Row:
    same = (after["registry"] == before["registry"] == {"a": "a", "b": "b"} and after["heads"] == before["heads"]
            and after["consumer"] == before["consumer"] and not any(after["rollups"].values())
            and all(after["events"][w] >= before["events"][w] for w in ("a", "b")))
    row = Row(mode, "admin", "read back: registry keys, snapshot heads, stream messages, consumers, rollups",
              HARMLESS, "all intact" if same else f"FAIL: {before} -> {after}")
    row.verdict = "ok" if same else "FAIL"
    return row


async def _reader_view(url: str, pw: dict[str, str]) -> BusConnection:
    conn = BusConnection()
    await conn.open(settings_for(url, environ={"KVB_NATS_PASSWORD": pw["reader"]}, nats_user="reader",
                                 nats_inbox_prefix="_INBOX.reader"), "attack-table-reader")
    return conn


async def _collect(sub: BusSubscriber, into: list[BusItem]) -> None:
    async for item in sub:
        into.append(item)


def _forged_b7(item: BusItem) -> bool:
    """The store a crafted for b's group 7 (hash 0xBAD), applied as b's."""
    return type(item) is BusMessage and item.subject == "kv.b.7" and type(item.body) is GroupMessage \
        and any(0xBAD in getattr(e, "block_hashes", []) for e in item.body.events)


async def _reply_copy_rows(a: Client, reader: Client, admin: Client, url: str, pw: dict[str, str]) -> list[Row]:
    """JetStream answers a request on whatever reply subject the requester
    names, stream and bucket subjects included, past every permission; the
    copies it stores there are refused by the consumers (a reader's live
    subscription, its stream replay, its registry follower), which is what
    the rows read back."""
    js = admin.nc.jetstream()
    rows = []
    conn = await _reader_view(url, pw)
    live: list[BusItem] = []
    follower = RegistryFollower(conn.nc)  # type: ignore[arg-type]
    try:
        async with anyio.create_task_group() as tg, BusSubscriber(conn, "kv.b.>") as sub:
            tg.start_soon(_collect, sub, live)
            tg.start_soon(follower.run)
            with anyio.fail_after(15):
                while "b" not in follower.entries:
                    await anyio.sleep(0.05)

            # 1. A group message of a's making that says b's group 7 (no
            # Nats-Msg-Id: a copy of one of the bridge's own would be dropped as
            # a duplicate), on a's own subject, read back onto b's kv.b.7.
            async def on_b7() -> tuple[int, int]:
                info = await js.stream_info("KV_EVENTS", subjects_filter="kv.b.7")
                return (info.state.subjects or {}).get("kv.b.7", 0), info.state.last_seq

            before, _ = await on_b7()
            crafted = msgspec.msgpack.encode(GroupMessage(
                v=1, worker="b", dp_rank=0, epoch=1, seq=1, ts=0.0, group=7, kind="full_attention",
                family="attention", kind_source="event",
                events=[BlockStored(block_hashes=[0xBAD], parent_block_hash=None, token_ids=[], block_size=16,
                                    lora_id=None, medium="GPU", lora_name=None)]))
            await a.nc.jetstream().publish("kv.a.9", crafted, headers={"Kvb-Format": "msgpack"})
            await a.nc.publish("$JS.API.DIRECT.GET.KV_EVENTS.kv.a.9", b"", reply="kv.b.7")
            await a.nc.flush()
            count, copy_seq = await on_b7()
            # The flush answers once the server has the request; the stream
            # stores the reply a moment later.
            with anyio.move_on_after(5):
                while count == before:
                    await anyio.sleep(0.05)
                    count, copy_seq = await on_b7()
            stored = count - before
            replay = BusSubscriber(conn, "kv.b.7", since=StartAt("seq", seq=copy_seq))
            replayed: list[BusItem] = []
            async with replay, anyio.create_task_group() as rtg:
                rtg.start_soon(_collect, replay, replayed)
                with anyio.move_on_after(10):
                    while not replay.identity.refused[Refusal.REPLY_COPY]:
                        await anyio.sleep(0.05)
                rtg.cancel_scope.cancel()
            with anyio.move_on_after(5):
                while not sub.identity.refused[Refusal.REPLY_COPY]:
                    await anyio.sleep(0.05)
            refused = (sub.identity.refused[Refusal.REPLY_COPY], replay.identity.refused[Refusal.REPLY_COPY])
            applied = sum(map(_forged_b7, live + replayed))
            row = Row("JetStream", "bridge a", "direct get of a message of its own (saying b's group 7) with kv.b.7 "
                      "as the reply subject", HARMLESS,
                      f"the server stored {stored} copy on kv.b.7; refused as a reply copy by a reader's live "
                      f"subscription and its stream replay ({refused[0]}, {refused[1]}); applied as b's: {applied}")
            row.verdict = "ok" if stored == 1 and min(refused) >= 1 and applied == 0 else "FAIL"
            rows.append(row)

            # 2. A JetStream read call answered onto b's registry key: its JSON
            # is no entry. Then a delete marker of a's own, read back onto b's key.
            for attempt, send in (
                ("a JetStream read call with b's registry key as the reply subject", lambda: reader.nc.publish(
                    "$JS.API.STREAM.INFO.KV_EVENTS", b"", reply="$KV.kv_workers.b")),
                ("bridge a: a delete marker of its own snapshot key read back onto b's registry key",
                 lambda: _delete_marker_onto_b(a)),
            ):
                bad_before, copies_before = follower.bad_entries, follower.identity.refused[Refusal.REPLY_COPY]
                await send()
                await reader.nc.flush()
                with anyio.move_on_after(5):
                    while (follower.bad_entries, follower.identity.refused[Refusal.REPLY_COPY]) == \
                            (bad_before, copies_before) and "b" in follower.entries:
                        await anyio.sleep(0.05)
                seen = (follower.bad_entries - bad_before) + (follower.identity.refused[Refusal.REPLY_COPY]
                                                             - copies_before)
                kept = follower.entries.get("b") is not None and follower.status("b") == "alive"
                # A follower that starts now finds b's key holding the copy: it
                # has b again from b's next heartbeat on (the bucket keeps one value a key).
                interval = follower.entries["b"].heartbeat_interval if kept else 5.0
                late = RegistryFollower(conn.nc)  # type: ignore[arg-type]
                with anyio.move_on_after(3 * interval):
                    async with anyio.create_task_group() as late_tg:
                        late_tg.start_soon(late.run)
                        while "b" not in late.entries:
                            await anyio.sleep(0.05)
                        late_tg.cancel_scope.cancel()
                row = Row("JetStream", "reader" if attempt.startswith("a JetStream") else "bridge a",
                          attempt.removeprefix("bridge a: "), HARMLESS,
                          f"stored on b's key; a running follower refused it ({seen}) and "
                          f"{'kept b alive' if kept else 'lost b'}; a late one had b "
                          f"{'from' if 'b' in late.entries else 'not even after'} b's next heartbeat "
                          f"(every {interval:g} s)")
                row.verdict = "ok" if kept and seen == 1 and "b" in late.entries else "FAIL"
                rows.append(row)
            tg.cancel_scope.cancel()
    finally:
        await conn.close()

    # 3. A consumer named in the request body (the call for an ephemeral
    # consumer): JetStream would take a name it knows as an update. Then under
    # a name of another reader's, in the API subject. The consumer read back.
    for attempt, subject, name in (
        ("ephemeral-consumer call naming someone else's consumer in its body", "$JS.API.CONSUMER.CREATE.KV_EVENTS",
         "someone-elses"),
        ("a consumer under another reader's name (kvr-reader2-0)",
         "$JS.API.CONSUMER.CREATE.KV_EVENTS.kvr-reader2-0.kv.none.>", "kvr-reader2-0"),
    ):
        if name != "someone-elses":
            await admin.nc.jetstream().add_consumer("KV_EVENTS", nats.js.api.ConsumerConfig(
                name=name, ack_policy=nats.js.api.AckPolicy.NONE, filter_subject="kv.>", inactive_threshold=60.0))
        answer = await reader.request(subject, {
            "stream_name": "KV_EVENTS", "config": {"name": name, "ack_policy": "explicit", "deliver_policy": "all",
                                                   "filter_subject": "kv.none.>"}})
        kept = (await js.consumer_info("KV_EVENTS", name)).config.filter_subject == "kv.>"
        row = Row("JetStream", "reader", attempt, REFUSED, f"{answer}; its filter {'kept' if kept else 'changed'}")
        judge(row)
        if not kept:
            row.verdict = "FAIL"
        rows.append(row)
    return rows


async def _delete_marker_onto_b(a: Client) -> None:
    """A message of a's own that says `KV-Operation: DEL` (a delete marker);
    read back with b's registry key as the reply, it says so there."""
    await a.nc.jetstream().publish("kv.a.zz", b"", headers={"KV-Operation": "DEL"})
    await a.nc.publish("$JS.API.DIRECT.GET.KV_EVENTS.kv.a.zz", b"", reply="$KV.kv_workers.b")
    await a.nc.flush()


async def _restart_rows(a: Client, admin: Client, b: Worker, url: str, pw: dict[str, str]) -> list[Row]:
    """While b is down, a has copies of messages of its own making read back
    onto b's subjects and snapshot keys: one saying b's epoch at seq +1000
    (were it b's resume point, b would take its next batches as stored
    already), a snapshot head and part saying b. A reader's bootstrap, which
    b's service cannot answer, and b itself on restart must take none of it."""
    js = admin.nc.jetstream()
    assert await anyio.to_thread.run_sync(b.bridge.stop) == 0
    stop = msgspec.msgpack.decode((await js.get_last_msg("KV_EVENTS", "kv.b.worker")).data, type=WorkerRecord)
    assert stop.type == "stop" and stop.seq is not None
    ajs = a.nc.jetstream()
    await ajs.publish("kv.a.9", msgspec.msgpack.encode(GroupMessage(
        v=1, worker="b", dp_rank=0, epoch=stop.epoch, seq=stop.seq + 1000, ts=0.0, group=ATTN_GROUP,
        kind="full_attention", family="attention", kind_source="event",
        events=[BlockStored(block_hashes=[0xBAD], parent_block_hash=None, token_ids=[], block_size=16,
                            lora_id=None, medium="GPU", lora_name=None)])), headers={"Kvb-Format": "msgpack"})
    for _ in range(3):
        await a.nc.publish("$JS.API.DIRECT.GET.KV_EVENTS.kv.a.9", b"", reply=f"kv.b.{ATTN_GROUP}")
    forged = RankSnapshot(v=SNAPSHOT_VERSION, worker="b", dp_rank=0, epoch=stop.epoch, taken_at=1.0, through="x",
                          stream_seq=1 << 40)
    data = encode_snapshot(forged)
    (part,) = split(forged, data, "forged", 1 << 20)
    head = SnapshotHead(v=1, worker="b", dp_rank=0, id="forged", slot="a", parts=1, epoch=stop.epoch,
                        stream_seq=1 << 40, taken_at=1.0, bytes=len(data))
    for subject, body, key in (("kv.a.97", encode_part(part), "b.a.0"), ("kv.a.98", encode_head(head), "b")):
        await ajs.publish(subject, body)
        await a.nc.publish(f"$JS.API.DIRECT.GET.KV_EVENTS.{subject}", b"", reply=f"$KV.kv_snapshots.{key}")
    await a.nc.flush()
    with anyio.fail_after(10):
        while reply_copy((await js.get_last_msg("KV_kv_snapshots", "$KV.kv_snapshots.b")).headers) is False:
            await anyio.sleep(0.05)
    rows = []

    conn = await _reader_view(url, pw)
    try:
        guard = IdentityGuard()
        bucket = await open_snapshot_bucket(conn.nc, "kv_snapshots")  # type: ignore[arg-type]
        got, source = await fetch(conn.nc, BootstrapOptions(timeout_s=2.0), bucket, "b", 0,  # type: ignore[arg-type]
                                  guard)
    finally:
        await conn.close()
    row = Row("JetStream", "bridge a", "a snapshot head and part saying b, of its own making, read back onto b's "
              "snapshot keys while b is down; a reader's bootstrap", HARMLESS,
              f"{type(got).__name__} from {source.source}; refused as copies: {guard.refused[Refusal.REPLY_COPY]}")
    row.verdict = "ok" if type(got) is SnapshotMissing and guard.refused[Refusal.REPLY_COPY] == 1 else "FAIL"
    rows.append(row)

    b.bridge.start()
    await wait_http(b.http, timeout=30)
    b.publish(5)
    last = stop.seq + 5

    async def own_last() -> int:
        raw = await js.get_last_msg("KV_EVENTS", f"kv.b.{ATTN_GROUP}")  # the stream's message get: stored headers
        return -1 if reply_copy(raw.headers) else msgspec.msgpack.decode(raw.data, type=GroupMessage).seq

    with anyio.move_on_after(20):
        while await own_last() < last:
            await anyio.sleep(0.1)
    seen = await own_last()
    logs = b.bridge.logs()
    passed = [e.get("passed") for e in logs if e.get("event") == "resume_point_copies_passed"]
    unreadable = [str(e.get("error", "")) for e in logs if e.get("event") == "snapshot_bucket_unreadable"]
    row = Row("JetStream", "bridge a", "3 copies of a group message saying b's epoch at seq +1000 read back onto "
              f"kv.b.{ATTN_GROUP} while b is down; b restarts and relays 5 batches", HARMLESS,
              f"b passed over {passed[-1] if passed else 0} copies to its own last message; its newest stored "
              f"batch is seq {seen} (sent up to {last})")
    row.verdict = "ok" if passed and passed[-1] == 3 and seen == last else "FAIL"
    rows.append(row)
    row = Row("JetStream", "bridge a", "the snapshot copies above; b's rebuild on restart", HARMLESS,
              f"b's rebuild refused the bucket: {unreadable[-1] if unreadable else 'no'}")
    row.verdict = "ok" if unreadable and "copy" in unreadable[-1] else "FAIL"
    rows.append(row)
    return rows


async def test_attack_table_core(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    server, pw = _server(tmp_path, jetstream=False)
    workers = [_bridge(tmp_path, w, server.url, pw, jetstream=False) for w in ("a", "b")]
    clients: list[Client] = []
    rows: list[Row] = []
    try:
        for w in workers:
            w.start()
        for w in workers:
            await wait_http(w.http, timeout=30)
        a = await connect(server.url, "bridge-a", pw["bridge-a"])
        reader = await connect(server.url, "reader", pw["reader"])
        clients += [a, reader]
        seen: list[str] = []
        strangers: list[str] = []

        async def on_msg(msg: Any) -> None:
            seen.append(msg.subject)
            if not msg.subject.endswith(".worker"):
                try:
                    msgspec.msgpack.decode(msg.data, type=GroupMessage)
                except msgspec.DecodeError:
                    strangers.append(msg.subject)

        await reader.nc.subscribe("kv.>", cb=on_msg)
        await flushed(reader.nc)
        for who, what, expected, run in await _common("core", a, reader):
            row = Row("core", who, what, expected)
            try:
                row.outcome = await run()
            except Exception as exc:
                row.outcome = f"client error {type(exc).__name__}"
            judge(row)
            rows.append(row)
        await reader.nc.publish("kvbridge.snapshot.kv.a", b"", reply="kv.b.0")
        await reader.nc.publish("$SRV.INFO.kv-bridge-snapshot", b"", reply="kv.b.0")
        await reader.nc.flush()
        for w in workers:
            w.publish(5)

        async def relayed() -> bool:
            return all(any(s.startswith(f"kv.{w}.") and not s.endswith(".worker") for s in seen) for w in ("a", "b"))

        with anyio.move_on_after(15):
            while not await relayed():
                await anyio.sleep(0.2)
        row = Row("core", "reader", "snapshot request and $SRV.INFO with kv.b.0 as reply; then both bridges relay",
                  HARMLESS,
                  f"both relayed; messages on kv.> that are no group message: {strangers or 'none'}")
        row.verdict = "ok" if await relayed() and not strangers else "FAIL"
        rows.append(row)
        for w in workers:
            status, _ = await anyio.to_thread.run_sync(http_get, f"http://127.0.0.1:{w.http}/readyz")
            ready = Row("core", "admin", f"bridge {w.worker} still ready", HARMLESS, f"/readyz {status}")
            ready.verdict = "ok" if status == 200 else "FAIL"
            rows.append(ready)
        _print(rows, capsys)
        assert [r for r in rows if r.verdict.startswith("FAIL")] == [], \
            table([r for r in rows if r.verdict.startswith("FAIL")])
        for w in workers:
            assert await anyio.to_thread.run_sync(w.bridge.stop) == 0
    finally:
        for c in clients:
            await c.nc.close()
        for w in workers:
            w.close()
        server.stop()
