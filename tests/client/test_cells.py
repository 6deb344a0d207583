"""The native tier (`bridge.residency._cells`) against the Python one (dicts):
whatever a history of stores, removals and gaps, both hold the same copies
and list them in the same order, so a snapshot is the same with either; and
the native one is what this install runs (a package built without it would
silently keep twice the memory)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from bridge.contract import BlockHash
from bridge.residency import cells
from bridge.residency.cells import PLACEHOLDER, SUSPECT, TRUSTED, CellLike, PyCell

NATIVE = cells.NATIVE_CELL
ROOT = Path(__file__).resolve().parents[2]

# Hashes as vLLM releases send them (32-byte digests, 64-bit ints), and the
# edges of the native key: empty and long bytes, ints at and past 64 bits.
_hashes = st.one_of(
    st.binary(min_size=32, max_size=32).map(lambda b: b[:1] * 31 + b[1:2]),  # few distinct: copies pile up
    st.binary(max_size=40),
    st.integers(-3, 3),
    st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 2**200, -(2**200)]),
    st.integers(-(2**70), 2**70),
)
_ops = st.lists(
    st.tuples(st.sampled_from(["store", "mark", "remove", "remove", "demote"]),
              st.lists(_hashes, min_size=1, max_size=8)),
    max_size=60,
)


def _state(c: CellLike, step: int) -> object:
    """Everything a reader can ask of a tier, walked `step` entries at a time."""
    layers = []
    for layer in (TRUSTED, SUSPECT, PLACEHOLDER):
        keys: list[BlockHash] = []
        copies: list[int] = []
        at = 0
        while at >= 0:
            k, n, at = c.chunk(layer, at, step)
            keys += k
            copies += n
        layers.append((keys, copies))
    only: list[BlockHash] = []
    at = 0
    while at >= 0:
        k, _, at = c.suspect_only(at, step)
        only += k
    held = layers[0][0] + layers[1][0]
    return (layers, only, c.counts(), c.entries(), c.has_suspect(),
            [c.held(h) for h in held], [c.copies(h, SUSPECT) for h in held],
            c.counts_of(TRUSTED, held), c.holds_all(held), c.holds_all(held + [b"not held"]))


@pytest.mark.skipif(NATIVE is None, reason="built without the native module")
@settings(max_examples=400, deadline=None)
@given(_ops, st.integers(1, 5))
def test_the_native_tier_holds_and_lists_what_dicts_do(ops: list[tuple[str, list[BlockHash]]], step: int) -> None:
    assert NATIVE is not None
    native, python = NATIVE(), PyCell()
    for op, hashes in ops:
        if op == "remove":
            assert native.remove(hashes) == python.remove(hashes)
        for c in (native, python):
            if op == "store" or op == "mark":
                c.store(hashes, op == "mark")
            elif op == "demote":
                c.demote()
        assert _state(native, step) == _state(python, step)


@pytest.mark.skipif(NATIVE is None, reason="built without the native module")
def test_a_tier_that_churns_keeps_its_order_and_gives_back_memory() -> None:
    """Many hashes stored and removed (the keeper's steady state): removed
    entries are dropped as they pile up, what stays keeps its order, and a
    hash that comes back goes to the end, as in a dict."""
    assert NATIVE is not None
    native, python = NATIVE(), PyCell()
    for c in (native, python):
        c.store([i.to_bytes(32, "big") for i in range(20_000)], False)
    full = native.__sizeof__()
    for c in (native, python):
        assert c.remove([i.to_bytes(32, "big") for i in range(0, 20_000, 2)]) == 10_000
        assert c.remove([i.to_bytes(32, "big") for i in range(1, 19_000, 2)]) == 9_500
        c.store([(4).to_bytes(32, "big"), (19_999).to_bytes(32, "big")], False)
    assert _state(native, 1000) == _state(python, 1000)
    keys, copies, _ = native.chunk(TRUSTED, 0, 10**6)
    assert keys[0] == (19_001).to_bytes(32, "big") and keys[-1] == (4).to_bytes(32, "big")
    assert copies[-2:] == [2, 1]  # 19,999 kept its place
    assert native.__sizeof__() < full / 4


@pytest.mark.skipif(NATIVE is None, reason="built without the native module")
def test_a_tier_that_only_loses_hashes_gives_back_memory_as_it_goes() -> None:
    """A window's evictions, or a worker draining its cache: removals with
    no store after them still drop the removed entries, and what stays
    reads the same as in a dict at every step."""
    assert NATIVE is not None
    native, python = NATIVE(), PyCell()
    hashes = [i.to_bytes(32, "big") for i in range(20_000)]
    for c in (native, python):
        c.store(hashes, False)
    full = native.__sizeof__()
    for start in range(0, 19_000, 1_000):
        part = hashes[start:start + 1_000]
        assert native.remove(part) == python.remove(part) == 1_000
        assert _state(native, 500) == _state(python, 500)
    assert native.__sizeof__() < full / 4


@pytest.mark.skipif(NATIVE is None, reason="built without the native module")
# Per hash at most: its key (none for an int: it is the entry's), a 16-byte
# entry and a quarter of that room for growth, and an 8-byte index slot of
# which a third is in use just after the index doubled.
@pytest.mark.parametrize(("key", "most"), [(lambda i: i.to_bytes(32, "big"), 85), (lambda i: i, 45)],
                         ids=["32-byte", "int"])
def test_a_resident_hash_costs_the_native_tier_a_few_dozen_bytes(key: Callable[[int], BlockHash], most: int) -> None:
    """What the snapshot keeper's memory is made of, whatever the number of
    hashes a tier holds."""
    assert NATIVE is not None
    for n in (60_000, 100_000, 130_000):
        c = NATIVE()
        c.store([key(i) for i in range(n)], False)
        assert c.counts() == (n, 0, 0)
        assert c.__sizeof__() / n <= most, n


@pytest.mark.skipif(NATIVE is None, reason="built without the native module")
def test_the_native_tier_refuses_what_is_not_a_hash() -> None:
    assert NATIVE is not None
    c = NATIVE()
    c.store([b"a"], False)
    for bad in (["a"], [1.5], [None], [b"b", object()]):
        with pytest.raises(TypeError):
            c.store(bad, False)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        c.copies(b"a", 3)
    # what came before the bad item stays stored, as with a dict
    assert c.chunk(TRUSTED, 0, 10) == ([b"a", b"b"], [1, 1], -1)


def test_this_install_runs_the_native_module_built_from_its_source() -> None:
    """The install the tests run (`pip install -e .`) built `_cells.c`, and
    built it after its last change (rebuild: `make venv` or `pip install -e .`)."""
    assert NATIVE is not None, "bridge.residency._cells was not built (no C compiler?)"
    import bridge.residency._cells as module

    built = Path(module.__file__ or "")
    source = ROOT / "bridge" / "residency" / "_cells.c"
    assert built.stat().st_mtime >= source.stat().st_mtime, f"{built.name} is older than {source.name}"
