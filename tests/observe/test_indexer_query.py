"""The rules behind observe's scoping and the indexer API's requests, without
a bus: which workers a (model, tenant, instance) scope keeps, when a query
without a model is refused, and what the indexer API's decoding refuses
(the bounds are /v1/prefix's)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bridge.apps.fleet import ObserveOptions, ObserveService
from bridge.apps.fleet.indexer import decode_by_hash, decode_by_tokens
from bridge.apps.fleet.query import MAX_CHAIN, MAX_TOKENS, QueryError, query_chain
from bridge.apps.fleet.scope import ModelMissing, Scope, out_of_scope
from bridge.client.chain import ChainHasher
from bridge.contract import WorkerEntry

pytestmark = pytest.mark.anyio
WORKERS = ["a", "b", "c", "d"]


def _entry(worker: str, model: str = "", tenant: str = "default") -> WorkerEntry:
    return WorkerEntry(worker=worker, model=model, tenant=tenant, ranks=[], groups=[], started_at=0.0,
                       heartbeat_interval=5.0)


def test_a_fleet_without_models_answers_every_query_with_every_worker() -> None:
    entries = {w: _entry(w) for w in WORKERS[:2]}  # c and d have no entry at all
    assert out_of_scope(Scope(), WORKERS, entries) == set()
    assert out_of_scope(Scope(model="anything"), WORKERS, entries) == set()


def test_a_one_model_fleet_needs_no_model_but_a_named_one_filters() -> None:
    entries = {"a": _entry("a", "m1"), "b": _entry("b", "m1"), "c": _entry("c")}
    assert out_of_scope(Scope(), WORKERS, entries) == set()
    assert out_of_scope(Scope(model="m1"), WORKERS, entries) == {"c", "d"}  # unknown models are not m1
    assert out_of_scope(Scope(model="m2"), WORKERS, entries) == set(WORKERS)


def test_a_two_model_fleet_refuses_a_query_without_a_model_listing_them() -> None:
    entries = {"a": _entry("a", "m2"), "b": _entry("b", "m1"), "c": _entry("c", "m1")}
    with pytest.raises(ModelMissing) as refused:
        out_of_scope(Scope(tenant="default"), WORKERS, entries)
    assert refused.value.models == ["m1", "m2"] and "m1, m2" in str(refused.value)
    assert isinstance(refused.value, QueryError)  # a 400, like every bad query
    # a dead worker's model does not count: the query could not see it anyway
    assert out_of_scope(Scope(), WORKERS, entries, hidden={"a"}) == set()


def test_tenant_and_instance() -> None:
    entries = {"a": _entry("a", "m", "t1"), "b": _entry("b", "m", "t2"), "c": _entry("c", "m")}
    assert out_of_scope(Scope(model="m", tenant="t1"), WORKERS, entries) == {"b", "c", "d"}
    # no entry, or an entry without a tenant: tenant default (but d has no model m)
    assert out_of_scope(Scope(tenant="default"), WORKERS, entries) == {"a", "b"}
    assert out_of_scope(Scope(model="m", instance="b"), WORKERS, entries) == {"a", "c", "d"}


async def _nothing() -> None:
    return None


def _body(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "block_size": 4, **fields}).encode()


@pytest.mark.parametrize("body, why", [
    (_body(token_ids=[1, 2, 3, 4], block_size=None), "block_size"),
    (json.dumps({"token_ids": [1, 2, 3, 4]}).encode(), "block_size"),
    (_body(), "token_ids"),
    (_body(token_ids=[1] * 8, lora_name="sql"), "lora_path"),
    (_body(token_ids=[1] * 8, lora_id=3), "lora_id"),
    (_body(token_ids=[1] * 8, seq_hashes=[1]), "unknown field"),
    (_body(token_ids=[-1] * 8), "bad query"),
    (_body(token_ids=[1] * (MAX_CHAIN + 1), block_size=1), "over its bound"),
    (_body(token_ids=[1] * (MAX_TOKENS + 1), block_size=64), "over its bound"),
])
async def test_query_by_tokens_refuses(body: bytes, why: str) -> None:
    with pytest.raises(QueryError, match=why):
        iq, tokens = await decode_by_tokens(body, _nothing)
        await query_chain(iq.prefix, tokens=tokens)


@pytest.mark.parametrize("body, why", [
    (_body(), "seq_hashes"),
    (_body(seq_hashes=[1], block_hash=[1]), "not both"),
    (_body(seq_hashes=[1 << 64]), "unsigned 64-bit"),
    (_body(seq_hashes=list(range(MAX_CHAIN + 1))), "over its bound"),
    (_body(seq_hashes=[1], lora_name="a", lora_id=1), "not both"),
    (_body(seq_hashes=[1], block_size=0), "bad query"),
])
async def test_query_by_hash_refuses(body: bytes, why: str) -> None:
    with pytest.raises(QueryError, match=why):
        iq = await decode_by_hash(body, _nothing)
        await query_chain(iq.prefix)


async def test_the_doc_defaults_and_names() -> None:
    iq = await decode_by_hash(json.dumps({"model": "m", "block_hash": [7, 8], "block_size": 64}).encode(), _nothing)
    assert iq.scope == Scope(model="m", tenant="default") and iq.block_size == 64
    assert await query_chain(iq.prefix) == [7, 8]
    iq = await decode_by_hash(_body(seq_hashes=[9], tenant_id="t", instance_id="pod-a", lora_name="sql"), _nothing)
    assert iq.scope == Scope(model="m", tenant="t", instance="pod-a")
    iq = await decode_by_hash(_body(seq_hashes=[9], tenant_id="", instance_id="", lora_name=""), _nothing)
    assert iq.scope == Scope(model="m", tenant="default")  # empty: the defaults


async def test_token_ids_hash_as_vllm_with_lora_and_salt_and_only_whole_blocks() -> None:
    tokens = list(range(10))
    iq, packed = await decode_by_tokens(_body(token_ids=tokens, lora_name="sql", lora_path="/a/sql",
                                              cache_salt="s"), _nothing)
    assert await query_chain(iq.prefix, tokens=packed) == ChainHasher(4).chain(
        tokens, lora=("sql", "/a/sql"), cache_salt="s")  # 2 blocks: the last 2 tokens make none


async def test_not_ready_answers_503_and_registration_is_on_nats() -> None:
    service = ObserveService(ObserveOptions(http_host="127.0.0.1", http_port=0))
    for path in ("/query", "/query_by_hash"):
        status, _, body = await service.route("POST", path, _body(seq_hashes=[1]))
        assert status == 503 and json.loads(body)["error"].startswith("not ready")
    for path in ("/register", "/unregister"):
        status, _, body = await service.route("POST", path, b'{"instance_id": "pod-a"}')
        assert status == 501 and "NATS" in json.loads(body)["error"]
