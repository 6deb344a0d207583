"""Models, tenants and the indexer API end to end: one nats-server, three
real bridges (their registry entries carry `--model` and `--tenant`), one
observe, and a router's client written from the Mooncake design doc alone
(tests/observe/indexer_client.py).

The fleet: pod-a (model m1, tenant t1) is hybrid (attention, sliding
window, mamba) with two DP ranks and a CPU tier on rank 0; pod-b (m1, t2)
is attention only with a STORAGE tier; pod-c (m2, t1) holds the very
hashes pod-a holds (equal token ids, equal hashes, another model). Every
query, over HTTP (/v1/prefix, /query, /query_by_hash) and NATS (prefix), is
answered only with the workers of its model and tenant; the indexer API's
figures are /v1/prefix's blocks times the block size."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from typing import Any, cast

import anyio
import nats
import pytest

from bridge.apps.demo.publisher import WirePublisher
from bridge.apps.demo.wire_writer import encode_batch, stored
from bridge.apps.fleet import ObserveOptions, ObserveService
from bridge.client.chain import ChainHasher
from bridge.client.connection import settings_for
from bridge.contract import BlockHash, Event
from bridge.residency.hashes import as_int
from bridge.runtime.nats_server import NatsServerProcess
from bridge.runtime.ports import free_port_run
from tests.busutil import make_settings, running_bridge
from tests.observe.indexer_client import IndexerClient, InstanceHit, Reply

pytestmark = pytest.mark.anyio
BS = 16
N = 8  # blocks of the request
TOKENS = list(range(N * BS))
# vLLM's default int form of the request's block hashes (sha256 chain).
CHAIN = [as_int(h) for h in ChainHasher(BS).chain(TOKENS)]
WINDOW: dict[str, Any] = {"kind": "sliding_window", "sliding_window": 32}  # 2 blocks of 16 seen


def _hybrid(window_from: int, checkpoint: int, medium: str = "GPU") -> list[Event]:
    """A hybrid worker rank's stores in one tier: attention 0..N-1, the window
    group blocks window_from..N-1 (GPU) or window_from..checkpoint (offload),
    a mamba checkpoint at `checkpoint`."""
    last = N if medium == "GPU" else checkpoint + 1
    return [
        stored(cast("list[BlockHash]", CHAIN), None, TOKENS, BS, medium=medium, group_idx=0, kind="full_attention"),
        stored(cast("list[BlockHash]", CHAIN[window_from:last]), CHAIN[window_from - 1], TOKENS[window_from * BS:last * BS],
               BS, medium=medium, group_idx=1, **WINDOW),
        stored([CHAIN[checkpoint]], CHAIN[checkpoint - 1], [], BS, medium=medium, group_idx=2, kind="mamba"),
    ]


def _attention(blocks: int, medium: str = "GPU") -> Event:
    return stored(cast("list[BlockHash]", CHAIN[:blocks]), None, TOKENS[:blocks * BS], BS, medium=medium, group_idx=0,
                  kind="full_attention")


# (worker, model, tenant) → per DP rank, the events its publisher sends.
FLEET: dict[tuple[str, str, str], dict[int, list[Event]]] = {
    ("pod-a", "m1", "t1"): {0: _hybrid(4, 5) + _hybrid(2, 3, "CPU"), 1: _hybrid(6, 7)},
    ("pod-b", "m1", "t2"): {0: [_attention(5), _attention(7, "STORAGE")]},
    ("pod-c", "m2", "t1"): {0: [_attention(N)]},
}
# What the hybrid rule lets each rank reuse, in blocks: any tier, and per tier (vLLM's names).
EXPECTED = {
    ("pod-a", 0): {None: 6, "GPU": 6, "CPU": 4},  # GPU: checkpoint at 5; CPU: checkpoint at 3
    ("pod-a", 1): {None: 8, "GPU": 8},
    ("pod-b", 0): {None: 7, "GPU": 5, "STORAGE": 7},
    ("pod-c", 0): {None: 8, "GPU": 8},
}


def _post(port: int, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310 - the test's server
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:  # noqa: S310 - the test's
        return resp.read().decode()


@asynccontextmanager
async def _fleet(nats_url: str) -> AsyncIterator[Callable[[], None]]:
    """The three bridges and their publishers; yields a function that has
    every publisher send its events once more."""
    sends: list[tuple[WirePublisher, int, list[Event]]] = []
    async with AsyncExitStack() as stack:
        for (worker, model, tenant), ranks in FLEET.items():
            base = free_port_run(len(ranks))
            for rank, events in ranks.items():
                pub = WirePublisher(f"tcp://*:{base + rank}", None)
                stack.callback(pub.close)
                sends.append((pub, rank, events))
            settings = make_settings(zmq_endpoint=[f"tcp://127.0.0.1:{base}"], dp_ranks=len(ranks),
                                     nats_url=[nats_url], worker_id=worker, model=model, tenant=tenant)
            await stack.enter_async_context(running_bridge(settings))

        def send() -> None:
            for pub, rank, events in sends:
                pub.publish(encode_batch(time.time(), events, dp_rank=rank))

        yield send


def _converged(service: ObserveService) -> bool:
    """The index holds what every rank sent, and the registry every entry."""
    st = service.state
    if st.follower is None or {w for w, e in st.follower.entries.items() if e.model} != {"pod-a", "pod-b", "pod-c"}:
        return False
    for (worker, rank), want in EXPECTED.items():
        for medium, blocks in want.items():
            got = st.index.match(worker, rank, CHAIN, media=None if medium is None else [medium])
            if got is None or got.blocks != blocks:
                return False
    return True


async def test_models_tenants_and_the_indexer_api(nats_server: NatsServerProcess) -> None:
    service = ObserveService(ObserveOptions(http_host="127.0.0.1", http_port=0, hybrid_interval=60))
    async with _fleet(nats_server.url) as send, anyio.create_task_group() as tg:
        port = await tg.start(service.run, settings_for(nats_server.url))
        with anyio.fail_after(60):
            while not _converged(service):
                send()
                await anyio.sleep(0.3)
        client = IndexerClient(f"http://127.0.0.1:{port}")
        nc = await nats.connect(nats_server.url)
        try:
            await _check_scoping(port, client, nc)
            await _check_indexer_equals_prefix(port, client)
            # Per-worker families carry the worker's model.
            text = await anyio.to_thread.run_sync(_get, port, "/metrics")
            for worker, model in (("pod-a", "m1"), ("pod-b", "m1"), ("pod-c", "m2")):
                assert f'kvobserve_last_seq{{dp_rank="0",model="{model}",worker="{worker}"}}' in text
            assert 'kvobserve_prefix_blocks_total{model="m2",rule="hybrid",worker="pod-c"}' in text
        finally:
            await nc.close()
        tg.cancel_scope.cancel()


async def _prefix(port: int, **body: Any) -> tuple[int, dict[str, Any]]:
    return await anyio.to_thread.run_sync(_post, port, "/v1/prefix", {"chain": CHAIN, "limit": 100, **body})


def _ranks(answer: dict[str, Any]) -> dict[tuple[str, int], int]:
    return {(w["worker"], w["dp_rank"]): w["blocks"] for w in answer["workers"]}


async def _check_scoping(port: int, client: IndexerClient, nc: Any) -> None:
    listed = json.loads(await anyio.to_thread.run_sync(_get, port, "/v1/workers"))["workers"]
    assert {(w["worker"], w["dp_rank"], w["model"], w["tenant"]) for w in listed} == {
        (worker, rank, model, tenant) for (worker, model, tenant), ranks in FLEET.items() for rank in ranks}

    # No model on a two-model fleet: refused, the models listed, on every API.
    status, body = await _prefix(port)
    assert status == 400 and body["models"] == ["m1", "m2"] and "m1, m2" in body["error"]
    reply = await nc.request("kvobserve.prefix", json.dumps({"chain": CHAIN}).encode(), timeout=10)
    assert reply.headers and reply.headers.get("Nats-Service-Error-Code") == "400"
    assert json.loads(reply.data)["models"] == ["m1", "m2"]
    for ask in (lambda: client.query(TOKENS, BS, None, tenant_id="t1"),
                lambda: client.query_by_hash(CHAIN, BS, None, tenant_id="t1")):
        refused: Reply = await anyio.to_thread.run_sync(ask)
        assert refused.status == 400 and refused.body["models"] == ["m1", "m2"]

    # /v1/prefix and NATS prefix: each model's, each tenant's workers only.
    m1 = {k: v[None] for k, v in EXPECTED.items() if k[0] in ("pod-a", "pod-b")}
    cases: list[tuple[dict[str, str], dict[tuple[str, int], int]]] = [
        ({"model": "m1"}, m1),
        ({"model": "m2"}, {("pod-c", 0): 8}),
        ({"model": "m1", "tenant": "t1"}, {k: v for k, v in m1.items() if k[0] == "pod-a"}),
        ({"model": "m1", "tenant": "t2"}, {("pod-b", 0): 7}),
        ({"model": "m2", "tenant": "t2"}, {}),
        ({"model": "m3"}, {}),
    ]
    for scope, want in cases:
        status, body = await _prefix(port, **scope)
        assert status == 200 and _ranks(body) == want, scope
        reply = await nc.request("kvobserve.prefix", json.dumps({"chain": CHAIN, "limit": 100, **scope}).encode(),
                                 timeout=10)
        assert _ranks(json.loads(reply.data)) == want, scope

    # The indexer API: per tenant, per instance of the model.
    for model, tenant, instances in (("m1", "t1", {"pod-a"}), ("m1", "t2", {"pod-b"}), ("m2", "t1", {"pod-c"}),
                                     ("m2", "t2", set()), ("m1", None, set())):
        for ask in (partial(client.query, TOKENS + [1, 2, 3], BS, model, tenant_id=tenant),
                    partial(client.query_by_hash, CHAIN, BS, model, tenant_id=tenant),
                    partial(client.query_by_hash, CHAIN, BS, model, tenant_id=tenant, legacy_name=True)):
            reply = await anyio.to_thread.run_sync(ask)
            # The tenant the doc defaults to is `default`: no worker of this fleet serves it.
            assert reply.status == 200 and list(reply.hits()) == [tenant or "default"], reply.body
            assert set(reply.hits()[tenant or "default"]) == instances, (model, tenant, reply.body)
    one = await anyio.to_thread.run_sync(lambda: client.query_by_hash(CHAIN, BS, "m1", tenant_id="t1",
                                                                      instance_id="pod-b"))
    assert one.status == 200 and one.hits() == {"t1": {}}

    # Registration happens on NATS: the doc's calls are answered, and refused.
    for ask in (lambda: client.register("tcp://10.0.0.1:5557", "m1", "pod-z", BS),
                lambda: client.unregister("m1", "pod-a", BS)):
        reply = await anyio.to_thread.run_sync(ask)
        assert reply.status == 501 and "NATS" in reply.body["error"]


async def _check_indexer_equals_prefix(port: int, client: IndexerClient) -> None:
    """For each (model, tenant): the indexer API's figures are /v1/prefix's
    blocks × block_size, with the same hybrid rule, per rank and per tier."""
    tiers = {"GPU": "GPU", "CPU": "CPU", "DISK": "STORAGE"}  # the doc's media, vLLM's names
    for model, tenant in (("m1", "t1"), ("m1", "t2"), ("m2", "t1")):
        want: dict[str, InstanceHit] = {}
        _, any_tier = await _prefix(port, model=model, tenant=tenant)
        for (worker, rank), blocks in _ranks(any_tier).items():
            hit = want.setdefault(worker, InstanceHit(0, dict.fromkeys(tiers, 0), {}))
            hit.dp[rank] = blocks * BS
            hit.longest_matched = max(hit.longest_matched, blocks * BS)
        for name, vllm_name in tiers.items():
            _, one_tier = await _prefix(port, model=model, tenant=tenant, media=[vllm_name])
            for (worker, _rank), blocks in _ranks(one_tier).items():
                want[worker].media[name] = max(want[worker].media[name], blocks * BS)
        for ask in (partial(client.query, TOKENS, BS, model, tenant_id=tenant),
                    partial(client.query_by_hash, CHAIN, BS, model, tenant_id=tenant)):
            reply = await anyio.to_thread.run_sync(ask)
            assert reply.status == 200 and reply.hits() == {tenant: want}, (model, tenant, reply.body)

    # The figures themselves: pod-a's hybrid ranks, its CPU tier, pod-b's storage tier.
    reply = await anyio.to_thread.run_sync(lambda: client.query(TOKENS, BS, "m1", tenant_id="t1"))
    assert reply.body == {"t1": {"pod-a": {"longest_matched": 128, "GPU": 128, "CPU": 64, "DISK": 0,
                                           "DP": {"0": 96, "1": 128}}}}
    reply = await anyio.to_thread.run_sync(lambda: client.query_by_hash(CHAIN, BS, "m1", tenant_id="t2"))
    assert reply.body == {"t2": {"pod-b": {"longest_matched": 112, "GPU": 80, "CPU": 0, "DISK": 112,
                                           "DP": {"0": 112}}}}
