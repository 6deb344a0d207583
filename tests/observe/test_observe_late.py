"""`kv-bridge observe` started late: after two bridges have published, it
bootstraps from their snapshots, and the moment its /readyz says 200 its
answers equal those of an observe that watched from the start."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any, cast

import anyio
import pytest

from bridge.apps.demo.publisher import WirePublisher
from bridge.apps.demo.wire_writer import encode_batch, removed, stored
from bridge.apps.fleet import ObserveOptions, ObserveService
from bridge.client.chain import ChainHasher
from bridge.client.connection import settings_for
from bridge.contract import BlockHash
from bridge.runtime.nats_server import NatsServerProcess
from bridge.runtime.ports import free_port
from tests.busutil import make_settings, running_bridge, wait_until
from tests.observe.test_observe_api import _http

pytestmark = pytest.mark.anyio
BS = 16
WORKERS = ("pod-a", "pod-b")


def _events(rng: random.Random, chains: list[list[bytes]], tokens: list[list[int]]) -> list[Any]:
    """One batch: some prompts stored in the three groups, some blocks removed."""
    out: list[Any] = []
    for _ in range(rng.randrange(1, 4)):
        i = rng.randrange(len(chains))
        n = rng.randrange(1, len(chains[i]) + 1)
        chain = cast("list[BlockHash]", chains[i][:n])
        out.append(stored(chain, None, tokens[i][:n * BS], BS, group_idx=0, kind="full_attention"))
        out.append(stored(chain[max(0, n - 2):], None, tokens[i][:n * BS], BS, group_idx=1, kind="sliding_window",
                          sliding_window=32))
        out.append(stored([chain[-1]], None, [], BS, group_idx=2, kind="mamba"))
        if rng.random() < 0.3:
            out.append(stored(chain, None, tokens[i][:n * BS], BS, group_idx=0, kind="full_attention",
                              medium="CPU"))
    if rng.random() < 0.4:
        i = rng.randrange(len(chains))
        out.append(removed([chains[i][-1]], group_idx=0))
    return out


def _comparable_workers(answer: dict[str, Any]) -> list[dict[str, Any]]:
    # lag_s is the last message's delay: a bootstrapped view has none until a message comes
    return [{k: v for k, v in w.items() if k not in ("staleness_s", "lag_s")} for w in answer["workers"]]


def _comparable_prefix(answer: dict[str, Any]) -> dict[str, Any]:
    return {"chain_blocks": answer["chain_blocks"],
            "workers": [{k: v for k, v in w.items() if k != "staleness_s"} for w in answer["workers"]]}


async def test_a_late_observe_answers_like_the_always_on_one(nats_server: NatsServerProcess) -> None:
    rng = random.Random(26)
    hasher = ChainHasher(BS)
    tokens = [[rng.randrange(50_000) for _ in range(8 * BS)] for _ in range(12)]
    chains = [hasher.chain(t) for t in tokens]
    ports = {w: free_port() for w in WORKERS}
    publishers = {w: WirePublisher(f"tcp://*:{ports[w]}", None) for w in WORKERS}
    sent = dict.fromkeys(WORKERS, 0)

    def publish_all() -> None:
        for w, pub in publishers.items():
            pub.publish(encode_batch(time.time(), _events(rng, chains, tokens)))
            sent[w] += 1

    nats = settings_for(nats_server.url)
    opts = dict(http_host="127.0.0.1", http_port=0, hybrid_interval=3600.0)
    always = ObserveService(ObserveOptions(**opts))  # type: ignore[arg-type]
    late = ObserveService(ObserveOptions(**opts))  # type: ignore[arg-type]
    try:
        async with AsyncExitStack() as stack:
            for worker in WORKERS:
                await stack.enter_async_context(running_bridge(make_settings(
                    zmq_endpoint=[f"tcp://127.0.0.1:{ports[worker]}"], nats_url=[nats_server.url],
                    worker_id=worker)))
            async with anyio.create_task_group() as tg:
                await _compare(tg, always, late, nats, publish_all, sent, chains, tokens)
    finally:
        for pub in publishers.values():
            pub.close()


async def _compare(tg: Any, always: ObserveService, late: ObserveService, nats: Any,
                   publish_all: Callable[[], None], sent: dict[str, int], chains: list[list[bytes]],
                   tokens: list[list[int]]) -> None:
    a_port = await tg.start(always.run, nats)
    # The bridges' SUB sockets join late (ZMQ): a first batch until the always-on one sees each worker.
    with anyio.fail_after(20):
        while any(always.state.index.view(w) is None for w in WORKERS):
            publish_all()
            await anyio.sleep(0.1)
    for _ in range(40):
        publish_all()
        await anyio.sleep(0.005)
    last = {w: n - 1 for w, n in sent.items()}  # seqs start at 0
    await wait_until(lambda: all((v := always.state.index.view(w)) is not None and v.last_seq == last[w]
                                 for w in WORKERS), what="the always-on observe applied every batch")

    tg.start_soon(late.run, nats)
    await wait_until(lambda: late.http_port is not None, what="the late observe listening")
    assert late.http_port is not None
    with anyio.fail_after(30):
        while (await _http(late.http_port, "GET", "/readyz"))[0] != 200:
            await anyio.sleep(0.002)
    # the moment it is ready: every answer is the always-on one's
    status, body = await _http(late.http_port, "GET", "/v1/workers")
    _, ref = await _http(a_port, "GET", "/v1/workers")
    got, want = json.loads(body), json.loads(ref)
    assert status == 200 and [w["worker"] for w in got["workers"]] == list(WORKERS)
    assert _comparable_workers(got) == _comparable_workers(want)
    for g, w in zip(got["workers"], want["workers"]):
        # staleness counts from the snapshot's last batch, not from observe's start
        assert g["staleness_s"] is not None and abs(g["staleness_s"] - w["staleness_s"]) < 1.0
    hits = 0
    for i, chain in enumerate(chains):
        for query in ({"chain": [h.hex() for h in chain]},
                      {"token_ids": tokens[i], "block_size": BS, "include_dead": True},
                      {"chain": [h.hex() for h in chain], "media": ["CPU"]}):
            q = json.dumps(query).encode()
            status, body = await _http(late.http_port, "POST", "/v1/prefix", q)
            _, ref = await _http(a_port, "POST", "/v1/prefix", q)
            assert status == 200
            assert _comparable_prefix(json.loads(body)) == _comparable_prefix(json.loads(ref)), query
            hits += bool(json.loads(ref)["workers"])
    assert hits >= len(chains)  # the comparison is not between two empty answers
    _, metrics = await _http(late.http_port, "GET", "/metrics")
    for line in metrics.decode().splitlines():
        if line.startswith("kvobserve_staleness_seconds{"):
            assert float(line.rsplit(" ", 1)[1]) < 60.0  # not observe's own uptime counting
    tg.cancel_scope.cancel()
