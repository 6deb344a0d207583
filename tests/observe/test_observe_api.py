"""`kv-bridge observe` against a real bridge: /v1/workers, POST /v1/prefix
(hex chain, token ids), the NATS micro service ($SRV.PING, kvobserve.prefix),
/readyz and the hybrid figures on /metrics."""

from __future__ import annotations

import json
import time
from typing import cast

import anyio
import nats
import pytest

from bridge.apps.demo.publisher import WirePublisher
from bridge.apps.demo.wire_writer import encode_batch, stored
from bridge.apps.fleet import ObserveOptions, ObserveService
from bridge.client.chain import ChainHasher
from bridge.client.connection import settings_for
from bridge.contract import BlockHash, Event
from bridge.runtime.nats_server import NatsServerProcess
from bridge.runtime.ports import free_port
from tests.busutil import make_settings, running_bridge

pytestmark = pytest.mark.anyio
BS = 16


async def _http(port: int, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
    stream = await anyio.connect_tcp("127.0.0.1", port)
    async with stream:
        await stream.send(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                          + body)
        data = b""
        try:
            while True:
                data += await stream.receive()
        except anyio.EndOfStream:
            pass
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), payload


async def test_prefix_over_http_and_nats(nats_server: NatsServerProcess) -> None:
    tokens = list(range(5 * BS))
    chain = ChainHasher(BS).chain(tokens)  # 5 blocks, vLLM's sha256 digests
    zmq_port = free_port()
    publisher = WirePublisher(f"tcp://*:{zmq_port}", None)
    settings = make_settings(zmq_endpoint=[f"tcp://127.0.0.1:{zmq_port}"], nats_url=[nats_server.url],
                             worker_id="pod-a")
    service = ObserveService(ObserveOptions(http_host="127.0.0.1", http_port=0, hybrid_interval=0.2))
    try:
        async with running_bridge(settings), anyio.create_task_group() as tg:
            port = await tg.start(service.run, settings_for(nats_server.url))
            assert (await _http(port, "GET", "/readyz"))[0] == 200
            # attention holds 5 blocks, the window (2 blocks wide) blocks 2-5, the state group a checkpoint at block 3 only
            events: list[Event] = [
                stored(cast("list[BlockHash]", chain), None, tokens, BS, group_idx=0, kind="full_attention"),
                stored(cast("list[BlockHash]", chain[1:]), None, tokens, BS, group_idx=1, kind="sliding_window",
                       sliding_window=32),
                stored([chain[2]], None, [], BS, group_idx=2, kind="mamba"),
            ]
            with anyio.fail_after(15):
                while not service.state.index.views or not any(
                        g.resident("GPU") for v in service.state.index for g in v.groups.values()):
                    publisher.publish(encode_batch(time.time(), events))
                    await anyio.sleep(0.2)
            status, body = await _http(port, "GET", "/v1/workers")
            workers = json.loads(body)["workers"]
            assert status == 200 and [w["worker"] for w in workers] == ["pod-a"]
            assert {g["family"] for g in workers[0]["groups"]} == {"attention", "window", "state"}

            q = json.dumps({"chain": [h.hex() for h in chain]}).encode()
            status, body = await _http(port, "POST", "/v1/prefix", q)
            answer = json.loads(body)
            assert status == 200 and answer["chain_blocks"] == 5
            # the state group's one checkpoint (block 3) allows p = 3, not 5
            assert [(w["worker"], w["blocks"], w["stale"]) for w in answer["workers"]] == [("pod-a", 3, False)]
            status, body = await _http(port, "POST", "/v1/prefix",
                                       json.dumps({"token_ids": tokens, "block_size": BS}).encode())
            assert status == 200 and json.loads(body)["workers"][0]["blocks"] == 3
            assert (await _http(port, "POST", "/v1/prefix", b'{"chain": ["zz"]}'))[0] == 400
            assert (await _http(port, "GET", "/v1/prefix"))[0] == 405

            nc = await nats.connect(nats_server.url)
            try:
                ping = json.loads((await nc.request("$SRV.PING.kv-observe", b"", timeout=5)).data)
                assert ping["name"] == "kv-observe"
                reply = await nc.request("kvobserve.prefix", q, timeout=5)
                assert json.loads(reply.data)["workers"][0]["blocks"] == 3
                bad = await nc.request("kvobserve.prefix", b"{", timeout=5)
                assert bad.headers and bad.headers.get("Nats-Service-Error-Code") == "400"
            finally:
                await nc.close()

            await anyio.sleep(0.8)  # a hybrid refresh
            service.refresh_hybrid()
            _, metrics = await _http(port, "GET", "/metrics")
            text = metrics.decode()
            assert 'kvobserve_hybrid_attention_blocks{dp_rank="0",model="",worker="pod-a"} 5.0' in text
            # of 5 attention blocks only block 3 is held by the window and checkpointed by the state group
            assert 'kvobserve_hybrid_resumable_ratio{dp_rank="0",model="",worker="pod-a"} 0.2' in text
            assert 'kvobserve_prefix_queries_total{result="hit",transport="http"} 2.0' in text
            assert 'kvobserve_prefix_queries_total{result="hit",transport="nats"} 1.0' in text
            assert 'kvobserve_prefix_blocks_total{model="",rule="attention",worker="pod-a"} 15.0' in text
            assert 'kvobserve_prefix_blocks_total{model="",rule="hybrid",worker="pod-a"} 9.0' in text
            tg.cancel_scope.cancel()
    finally:
        publisher.close()
