"""`kv-bridge observe` under hostile queries (issue 26): every one answered
with the documented status and, when an error, a JSON body (HTTP and NATS),
while /healthz keeps answering within the chart's probe timeout.

The loop's worst pause under this load is a benchmark figure, not asserted
here: `python -m bench.observe_load` (docs/observe.md, "Bounds")."""

from __future__ import annotations

import json
import re
from pathlib import Path

import anyio
import nats
import nats.aio.msg
import pytest

from bench.observe_load import _fill, hostile_requests, run_clients
from bridge.apps.fleet import ObserveOptions, ObserveService
from bridge.client.connection import settings_for
from bridge.runtime.nats_barrier import flushed
from bridge.runtime.nats_server import NatsServerProcess

pytestmark = pytest.mark.anyio
CLIENTS = 6
CHART = Path(__file__).resolve().parents[2] / "helm" / "kv-bridge" / "templates" / "observe.yaml"
K8S_DEFAULT_PROBE_TIMEOUT_S = 1.0


def probe_timeout(probe: str) -> float:
    """The chart's timeoutSeconds for observe's `probe` (Kubernetes' default when unset)."""
    text = CHART.read_text()
    block = text.split(f"{probe}:", 1)[1]
    block = re.split(r"\n\s*\w+Probe:|\n\s*\{\{-", block, maxsplit=1)[0]
    found = re.search(r"timeoutSeconds:\s*(\d+)", block)
    return float(found.group(1)) if found else K8S_DEFAULT_PROBE_TIMEOUT_S


async def test_hostile_queries_leave_healthz_answering(nats_server: NatsServerProcess) -> None:
    timeout = min(probe_timeout("livenessProbe"), probe_timeout("readinessProbe"))
    service = ObserveService(ObserveOptions(http_host="127.0.0.1", http_port=0, bucket="", bootstrap=None))
    _fill(service.state.index)  # three worker ranks over a 65,536-block chain: the longest lookups
    requests = hostile_requests()
    async with anyio.create_task_group() as tg:
        port = await tg.start(service.run, settings_for(nats_server.url))
        # clients and the /healthz prober in a child process, like routers and the kubelet
        report = await run_clients(port, CLIENTS, rounds=1)

        # the same over NATS (bodies under max_payload): errors carry the code header and a JSON body
        nc = await nats.connect(nats_server.url)
        try:
            for name, method, path, body, want in requests:
                if path != "/v1/prefix" or method != "POST" or len(body) > 900_000:
                    continue
                reply = await nc.request("kvobserve.prefix", body, timeout=30)
                code = (reply.headers or {}).get("Nats-Service-Error-Code")
                if want == 200:
                    assert code is None and "workers" in json.loads(reply.data), name
                else:
                    assert code == str(want) and "error" in json.loads(reply.data), (name, code, reply.data[:200])
        finally:
            await nc.close()
        tg.cancel_scope.cancel()
    assert not report["wrong"], report["wrong"]
    assert report["answered"] == CLIENTS * len(requests)
    assert report["healthz_n"] >= 5 and report["healthz_max_s"] < timeout, (report, timeout)
    assert service.state.queries[("http", "error")] >= CLIENTS * 12


async def test_requests_whose_reply_is_no_inbox_get_no_answer(nats_server: NatsServerProcess) -> None:
    """A request (or service discovery) with a stream subject as its reply
    would have the answer written there: observe leaves it unanswered and
    counts it, and keeps answering inbox requests."""
    service = ObserveService(ObserveOptions(http_host="127.0.0.1", http_port=0, bucket="", bootstrap=None))
    body = json.dumps({"chain": [1, 2, 3]}).encode()
    async with anyio.create_task_group() as tg:
        await tg.start(service.run, settings_for(nats_server.url))
        nc = await nats.connect(nats_server.url)
        try:
            landed: list[bytes] = []

            async def on_stream_subject(msg: nats.aio.msg.Msg) -> None:
                landed.append(msg.data)

            await nc.subscribe("kv.b.0", cb=on_stream_subject)
            for subject in ("kvobserve.prefix", "kvobserve.workers", "$SRV.INFO.kv-observe", "$SRV.PING"):
                await nc.publish(subject, body, reply="kv.b.0")
            await flushed(nc)
            answered = await nc.request("kvobserve.prefix", body, timeout=10)  # an inbox request, after them
            assert "workers" in json.loads(answered.data)
            await nc.flush()
            await anyio.sleep(0.2)  # a stray answer would have come with the inbox one
        finally:
            await nc.close()
        tg.cancel_scope.cancel()
    assert landed == []
    assert service.state.requests_refused == 2
