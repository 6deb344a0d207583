"""`kv-bridge observe`'s state without a bus: the prefix query's decoding and
bounds, the per-worker metric families' cap and pruning, expiry of stopped
workers, `include_dead`, and per-tier counts that count a block once."""

from __future__ import annotations

import json
import random
import re
import time

import pytest

from bridge.apps.fleet import ObserveOptions, ObserveService
from bridge.apps.fleet.metrics import HybridCache, make_registry, render
from bridge.apps.fleet.query import (
    MAX_CHAIN,
    SLICE_BYTES,
    PrefixQuery,
    QueryError,
    decode_query,
    query_chain,
    usable_algos,
)
from bridge.apps.fleet.state import ObserveState, hybrid_effect
from bridge.client.chain import ALGOS, ChainHasher
from bridge.client.subscribe import BusMessage
from tests.client.builders import ATTN, hb, msg, record, stored

pytestmark = pytest.mark.anyio


class _Checkpoints:
    def __init__(self) -> None:
        self.n = 0

    async def __call__(self) -> None:
        self.n += 1


async def _chain(body: dict[str, object], algos: tuple[str, ...] = ALGOS) -> list[object]:
    cp = _Checkpoints()
    q, tokens = await decode_query(json.dumps(body).encode(), cp)
    return list(await query_chain(q, cp, algos, tokens))


async def test_long_arrays_decode_in_slices_to_the_same_chain() -> None:
    rng = random.Random(3)
    tokens = [rng.randrange(0, 1 << 40) for _ in range(3 * SLICE_BYTES // 8)]  # over several slices
    cp = _Checkpoints()
    q, packed = await decode_query(json.dumps({"token_ids": tokens, "block_size": 16, "cache_salt": "s"}).encode(),
                                   cp)
    assert packed is not None and list(packed) == tokens and cp.n >= 2  # the loop got its turns
    chain = await query_chain(q, cp, ALGOS, packed)
    assert chain == ChainHasher(16).chain(tokens, cache_salt="s")
    hexes = [h.hex() for h in chain]  # type: ignore[union-attr]
    assert await _chain({"chain": hexes}) == chain
    assert await _chain({"chain": []}) == []


@pytest.mark.parametrize("body, why", [
    ({"chain": [1 << 64]}, "64"),
    ({"chain": [-1]}, ">= 0"),
    ({"chain": ["zz"]}, "hex"),
    ({"chain": [[1]]}, "Expected"),
    ({"chain": 5}, "list"),
    ({"token_ids": [1, 1 << 64], "block_size": 1}, "64 bits"),
    ({"token_ids": [1, 2], "block_size": 1 << 64}, "64-bit"),
    ({"token_ids": [1, 2], "block_size": 0}, ">= 1"),
    ({"token_ids": [1, 2], "block_size": 1, "limit": 1 << 70}, "64-bit"),
    ({"token_ids": [1, 2]}, "block_size"),
    ({"chain": [1], "token_ids": [1], "block_size": 1}, "exactly one"),
    ({"chain": [1] * (MAX_CHAIN + 1)}, str(MAX_CHAIN)),
    ({"token_ids": [7] * (MAX_CHAIN + 1), "block_size": 1}, str(MAX_CHAIN)),
    ({"token_ids": [1], "block_size": 1, "algo": "md5"}, "unknown"),
    ({"token_ids": [1], "block_size": 1, "algo": "xxhash"}, "PYTHONHASHSEED"),
    ({"nonsense": 1}, "unknown field"),
])
async def test_bad_queries_are_the_callers_fault(body: dict[str, object], why: str) -> None:
    with pytest.raises(QueryError, match=re.escape(why)):
        await _chain(body)


async def test_the_token_path_is_bounded_like_chain() -> None:
    """4,194,304 token ids at block size 1 would be 4M blocks: refused while
    decoding, before most of them are even read."""
    body = json.dumps({"block_size": 1, "token_ids": list(range(4_194_304))}).encode()
    cp = _Checkpoints()
    with pytest.raises(QueryError, match="65536"):
        await decode_query(body, cp)
    assert cp.n < 8  # stopped after the slice that crossed the bound
    # the most blocks a query may make, at block size 64
    q, tokens = await decode_query(json.dumps({"block_size": 64, "token_ids": [5] * (MAX_CHAIN * 64)}).encode(), cp)
    assert tokens is not None and len(tokens) == MAX_CHAIN * 64 and q.block_size == 64


async def test_every_advertised_algo_works_or_is_refused_with_the_list() -> None:
    assert usable_algos() == ALGOS  # xxhash is a dependency
    tokens = list(range(48))
    for algo in ALGOS:
        assert await _chain({"token_ids": tokens, "block_size": 16, "algo": algo, "seed": "1"}) == \
            ChainHasher(16, algo=algo, seed="1").chain(tokens)
    # where a package is missing, the query is refused naming what works
    with pytest.raises(QueryError, match="not available in this process; one of sha256, sha256_cbor"):
        await _chain({"token_ids": tokens, "block_size": 16, "algo": "xxhash", "seed": "1"},
                     algos=("sha256", "sha256_cbor"))


def _series(text: str, family: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(family + "{")]


def _worker_label(series: str) -> str:
    m = re.search(r'worker="([^"]+)"', series)
    assert m is not None, series
    return m.group(1)


async def test_per_worker_families_obey_the_cap_and_go_with_the_worker() -> None:
    state = ObserveState()
    index = state.index
    for i in range(300):
        index.apply(msg([stored([hb(0), hb(1)])], worker=f"w{i:03}"))
    answer = state.prefix(PrefixQuery(chain=[hb(0).hex(), hb(1).hex()]), [hb(0), hb(1)], "http")
    assert answer["chain_blocks"] == 2 and len(answer["workers"]) == 16
    assert len(state.prefix_blocks) == 600
    registry = make_registry(state, HybridCache(), max_workers=20)
    text = render(registry).decode()
    for family in ("kvobserve_prefix_blocks_total", "kvobserve_staleness_seconds", "kvobserve_gaps_total"):
        series = _series(text, family)
        assert series and {_worker_label(s) for s in series} <= {f"w{i:03}" for i in range(20)}, family
    assert len(_series(text, "kvobserve_prefix_blocks_total")) == 40
    assert "kvobserve_unlisted_worker_ranks 280.0" in text

    # every worker stops; after --expire-after they are gone from answers and metrics
    for i in range(300):
        index.apply(record("stop", worker=f"w{i:03}"))
    assert state.expire(1000.0, after=60.0) == []
    assert len(state.expire(1059.0, after=60.0)) == 0
    assert len(state.expire(1060.0, after=60.0)) == 300
    assert not list(index) and not state.prefix_blocks and not state.gone_since
    text = render(registry).decode()
    assert not _series(text, "kvobserve_prefix_blocks_total") and not _series(text, "kvobserve_resident_blocks")
    assert state.workers()["workers"] == []


async def test_a_worker_that_speaks_again_is_kept() -> None:
    state = ObserveState()
    state.index.apply(msg([stored([hb(0)])], worker="a"))
    state.index.apply(record("stop", worker="a"))
    state.expire(0.0, after=10.0)
    state.index.apply(record("start", worker="a", epoch=2, reason="fresh"))
    assert state.expire(20.0, after=10.0) == [] and not state.gone_since


async def test_an_expired_rank_back_without_a_reset_is_partial() -> None:
    service = ObserveService(ObserveOptions(http_port=0))
    state = service.state
    state.index.apply(msg([stored([hb(0)])], worker="a"))
    state.index.apply(record("stop", worker="a"))
    state.expire(0.0, after=1.0)
    assert state.expire(1.0, after=1.0) == ["a"]

    body = msg([stored([hb(1)])], worker="a", seq=99)
    item = BusMessage("kv.a.0", {}, body, 0.0)
    service._back_from_expiry(item)
    state.index.apply(item)
    view = state.index.view("a")
    assert view is not None and view.partial and view.stale


async def test_include_dead_brings_back_a_stopped_worker() -> None:
    state = ObserveState()
    state.index.apply(msg([stored([hb(0), hb(1)])], worker="a"))
    state.index.apply(msg([stored([hb(0)])], worker="b"))
    state.index.apply(record("stop", worker="a"))
    q = PrefixQuery(chain=[hb(0).hex(), hb(1).hex()])
    assert [w["worker"] for w in state.prefix(q, [hb(0), hb(1)], "http")["workers"]] == ["b"]
    q = PrefixQuery(chain=[hb(0).hex(), hb(1).hex()], include_dead=True)
    got = state.prefix(q, [hb(0), hb(1)], "http")["workers"]
    assert [(w["worker"], w["blocks"], w["liveness"]) for w in got] == [("a", 2, "stopped"), ("b", 1, "watching")]


async def test_a_block_in_two_tiers_counts_once() -> None:
    state = ObserveState()
    state.index.apply(msg([stored([hb(i) for i in range(10)], medium="GPU"),
                           stored([hb(i) for i in range(5, 15)], medium="CPU")], group=ATTN))
    view = state.index.view("w")
    assert view is not None
    held, taken, ok = hybrid_effect(view, 4096)
    assert held == 15 and taken == 15 and ok == 15
    hybrid = HybridCache()
    hybrid.values = {("w", 0): (held, taken, ok)}
    text = render(make_registry(state, hybrid, 10)).decode()
    assert 'kvobserve_hybrid_attention_blocks{dp_rank="0",model="",worker="w"} 15.0' in text


async def test_a_digest_chain_is_asked_in_int_form_when_no_digest_is_held() -> None:
    """The service asks an index that holds only ints with the chain's int
    form (bridge.residency's fast path): the same answer as the digests."""
    from bridge.apps.fleet.query import int_form
    from bridge.residency.hashes import as_int

    state = ObserveState()
    chain = [hb(i) for i in range(40)]
    state.index.apply(msg([stored([as_int(h) for h in chain[:30]])], worker="ints"))
    assert not state.index.fleet.holds_digests
    ints = await int_form(chain)
    assert ints == [as_int(h) for h in chain] and await int_form(ints) is None
    q = PrefixQuery(chain=[h.hex() for h in chain])
    now = time.time()  # both asked at one instant, so their staleness agrees too
    assert state.prefix(q, ints, "http", now)["workers"] == state.prefix(q, list(chain), "http", now)["workers"]
    assert state.prefix(q, ints, "http", now)["workers"][0]["blocks"] == 30
    state.index.apply(msg([stored(chain[:35])], worker="digests"))
    assert state.index.fleet.holds_digests  # the service then asks with the digests


async def test_the_hybrid_sample_reads_only_held_trusted_blocks() -> None:
    """GroupResidency.sample: the first n trusted hashes, what the hybrid
    figures sample, without listing the whole tier."""
    from tests.client.builders import removed

    state = ObserveState()
    state.index.apply(msg([stored([hb(i) for i in range(20)])]))
    state.index.apply(msg([removed([hb(i) for i in range(0, 20, 2)])]))
    view = state.index.view("w")
    assert view is not None
    g = view.groups[ATTN]
    assert set(g.sample("GPU", 100)) == set(g.trusted["GPU"]) == {hb(i) for i in range(1, 20, 2)}
    assert len(g.sample("GPU", 3)) == 3 and set(g.sample("GPU", 3)) <= set(g.trusted["GPU"])
    assert g.sample("CPU", 5) == [] and g.sample("GPU", 0) == []
    state.index.apply(record("gap", gap=(1, 2)))  # every entry suspect now
    assert g.sample("GPU", 100) == [] and hybrid_effect(view, 4096) == (0, 0, 0)
