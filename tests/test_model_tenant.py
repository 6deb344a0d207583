"""`kv-bridge run --model` / `--tenant`, and the model vLLM's `/v1/models`
names when `--vllm-url` is given without `--model`: both reach the worker's
registry entry, which is how consumers scope queries (docs/observe.md,
"Models and tenants"). An entry written before tenants existed decodes as
tenant `default`."""

from __future__ import annotations

import argparse
import json
import signal
import time

import anyio
import nats
import pytest

from bridge.contract import DEFAULT_TENANT, decode_entry, encode_entry, registry_key
from bridge.producer.config import ConfigError, add_run_arguments, load_settings
from bridge.producer.follow_vllm import parse_models
from bridge.producer.service import Bridge
from bridge.producer.source.discovery import DiscoveryError
from bridge.runtime.nats_server import NatsServerProcess
from bridge.runtime.ports import free_port
from tests.busutil import make_settings
from tests.test_vllm_url import StandIn, _publisher, _spawn, _vllm_config

pytestmark = pytest.mark.anyio

# vLLM's /v1/models with a LoRA adapter served beside the base model (its `parent`).
VLLM_MODELS = {"object": "list", "data": [
    {"id": "sql-lora", "object": "model", "owned_by": "vllm", "root": "/adapters/sql", "parent": "org/base-7b"},
    {"id": "org/base-7b", "object": "model", "owned_by": "vllm", "root": "org/base-7b", "parent": None,
     "max_model_len": 4096},
]}


@pytest.fixture
def stand_in_port() -> int:
    return free_port()


def _parse(argv: list[str], environ: dict[str, str] | None = None) -> object:
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    return load_settings(parser.parse_args(argv), environ or {})


def test_model_and_tenant_reach_the_registry_entry() -> None:
    entry = Bridge(make_settings(model="org/base-7b", tenant="acme")).registry_entry()
    assert (entry.model, entry.tenant) == ("org/base-7b", "acme")
    assert decode_entry(encode_entry(entry)).tenant == "acme"
    plain = Bridge(make_settings()).registry_entry()
    assert (plain.model, plain.tenant) == ("", DEFAULT_TENANT)
    assert b"tenant" not in encode_entry(plain)  # the default stays off the wire, as before tenants


def test_an_entry_from_before_tenants_is_tenant_default() -> None:
    old = (b'{"v":1,"worker":"w","model":"m","ranks":[{"dp_rank":0}],"groups":[],"started_at":1.0,'
           b'"heartbeat_interval":5.0}')
    entry = decode_entry(old)
    assert (entry.worker, entry.model, entry.tenant) == ("w", "m", "default")


def test_flags_and_variables() -> None:
    s = _parse(["--model", "m", "--tenant", "t"])
    assert (s.model, s.tenant) == ("m", "t")  # type: ignore[attr-defined]
    s = _parse([], {"KVB_MODEL": "m2", "KVB_TENANT": "t2"})
    assert (s.model, s.tenant) == ("m2", "t2")  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="--tenant"):
        _parse(["--tenant", ""])


def test_the_model_is_vllms_first_base_model() -> None:
    assert parse_models(json.dumps(VLLM_MODELS).encode()) == "org/base-7b"
    assert parse_models(b'{"data": [{"id": "only"}]}') == "only"
    assert parse_models(b'{"object": "list", "data": []}') == ""
    with pytest.raises(DiscoveryError):
        parse_models(b"<html>")


async def _entry(url: str, worker: str, timeout: float = 30.0) -> tuple[str, str]:
    """(model, tenant) of the worker's registry entry, once written."""
    nc = await nats.connect(url)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                kv = await nc.jetstream().key_value("kv_workers")
                entry = decode_entry((await kv.get(registry_key(worker))).value or b"")
                return entry.model, entry.tenant
            except Exception:
                assert time.monotonic() < deadline, "no registry entry"
                await anyio.sleep(0.2)
    finally:
        await nc.close()


@pytest.mark.parametrize("flags, model", [([], "org/base-7b"), (["--model", "mine"], "mine")])
async def test_vllm_url_reads_the_model_unless_given(nats_server: NatsServerProcess, stand_in_port: int,
                                                     flags: list[str], model: str) -> None:
    stand_in = StandIn(stand_in_port)
    pub, ep, rp = _publisher()
    stand_in.answer = {"0": _vllm_config(ep, rp)}
    stand_in.models = VLLM_MODELS
    proc = _spawn("--vllm-url", f"http://127.0.0.1:{stand_in_port}", "--nats-url", nats_server.url,
                  "--tenant", "acme", *flags)
    try:
        assert await _entry(nats_server.url, "w") == (model, "acme")
        proc.send_signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(lambda: proc.wait(timeout=30)) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        pub.close()
        stand_in.close()
