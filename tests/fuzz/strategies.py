"""Hypothesis strategies for vLLM's KV-event wire format, good and hostile.

Events are generated as plain maps (what msgpack carries), each tagged with
whether the bridge must keep it: a good event may carry unknown keys with any
junk under them (newer vLLM releases add fields) and extreme but legal values;
a bad one has a field of the wrong type, an unknown `type`, no `type`, or is no
map at all.
"""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import strategies as st

U64_MAX = 2**64 - 1
I64_MIN = -(2**63)

ints = st.integers(I64_MIN, U64_MAX)  # what msgpack can encode

# Everything msgpack can carry, nested. Ext values and non-string map keys are
# legal msgpack although vLLM never sends them.
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(I64_MIN, U64_MAX),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.binary(max_size=40),
)
# code -1 is msgpack's timestamp: a malformed one is malformed msgpack, not junk
ext = st.builds(msgspec.msgpack.Ext, st.integers(-128, 127).filter(lambda c: c != -1), st.binary(max_size=8))
map_keys = st.one_of(st.text(max_size=10), st.integers(I64_MIN, U64_MAX), st.binary(max_size=8))


def junk(with_ext: bool = True, str_keys_only: bool = False) -> st.SearchStrategy[Any]:
    base = st.one_of(scalars, ext) if with_ext else scalars
    keys = st.text(max_size=10) if str_keys_only else map_keys
    return st.recursive(
        base,
        lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(keys, children, max_size=4)),
        max_leaves=8,
    )


# JSON (--format json) can show any of this: strings as keys, no Ext.
json_junk = junk(with_ext=False, str_keys_only=True)
any_junk = junk()

hashes = st.one_of(st.binary(min_size=0, max_size=40), st.integers(I64_MIN, U64_MAX))
kinds = st.one_of(
    st.sampled_from([
        "full_attention", "mla_attention", "sliding_window", "sliding_window_mla", "mamba",
        "chunked_local_attention", "sink_full_attention", "encoder_only_attention", "cross_attention", "unknown",
    ]),
    st.text(max_size=60),  # anything: the bridge must make it safe
)
opt_int = st.one_of(st.none(), st.integers(I64_MIN, U64_MAX))
# mostly real group ids (so slices form and kinds are learned), sometimes absurd ones
group_ids = st.one_of(st.none(), st.integers(0, 4), st.integers(I64_MIN, U64_MAX))
opt_text = st.one_of(st.none(), st.text(max_size=20))

STORED_FIELDS = {
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
    "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality", "ownership",
    "session_id", "lookahead_token_ids", "placeholder",
}
REMOVED_FIELDS = {"block_hashes", "medium", "group_idx", "locality", "ownership"}


@st.composite
def good_stored(draw: st.DrawFn, extra: st.SearchStrategy[Any] = any_junk) -> dict[str, Any]:
    ev: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": draw(st.lists(hashes, max_size=6)),
        "parent_block_hash": draw(st.one_of(st.none(), hashes)),
        "token_ids": draw(st.lists(st.integers(I64_MIN, U64_MAX), max_size=8)),
        "block_size": draw(st.integers(I64_MIN, U64_MAX)),
        "lora_id": draw(opt_int),
        "medium": draw(st.one_of(st.none(), st.sampled_from(["GPU", "CPU", "STORAGE"]), st.text(max_size=10))),
        "lora_name": draw(opt_text),
    }
    optional = {
        "extra_keys": st.one_of(st.none(), st.lists(extra, max_size=3)),
        "group_idx": group_ids,
        "kv_cache_spec_kind": st.one_of(st.none(), kinds),
        "kv_cache_spec_sliding_window": opt_int,
        "locality": st.one_of(st.none(), st.sampled_from(["LOCAL", "REMOTE"]), st.text(max_size=8)),
        "ownership": opt_text,
        "session_id": opt_text,
        "lookahead_token_ids": st.one_of(st.none(), st.lists(st.lists(st.integers(0, 2**31), max_size=3), max_size=3)),
    }
    for key in draw(st.lists(st.sampled_from(sorted(optional)), unique=True)):
        ev[key] = draw(optional[key])
    return _with_unknown_keys(draw, ev, STORED_FIELDS, extra)


@st.composite
def good_removed(draw: st.DrawFn, extra: st.SearchStrategy[Any] = any_junk) -> dict[str, Any]:
    ev: dict[str, Any] = {
        "type": "BlockRemoved",
        "block_hashes": draw(st.lists(hashes, max_size=6)),
        "medium": draw(opt_text),
    }
    if draw(st.booleans()):
        ev["group_idx"] = draw(group_ids)
    return _with_unknown_keys(draw, ev, REMOVED_FIELDS, extra)


def _with_unknown_keys(draw: st.DrawFn, ev: dict[str, Any], fields: set[str],
                       extra: st.SearchStrategy[Any]) -> dict[str, Any]:
    """Fields a future vLLM might add: any name that is not a known field."""
    names = st.text(min_size=1, max_size=12).filter(lambda k: k not in fields and k != "type")
    for key, value in draw(st.dictionaries(names, extra, max_size=2)).items():
        ev[key] = value
    return ev


def good_events(extra: st.SearchStrategy[Any] = any_junk) -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(good_stored(extra), good_removed(extra), st.just({"type": "AllBlocksCleared"}))


# Values of the wrong type for each typed field (for a *required* or non-None
# field; None is legal for the optional ones, so it is not offered there).
_not_a_list = st.one_of(ints, st.text(max_size=5), st.floats(), st.binary(max_size=3),
                        st.dictionaries(st.text(max_size=3), ints, min_size=1, max_size=2))
_not_an_int = st.one_of(st.text(max_size=5), st.floats(), st.lists(ints, max_size=2),
                        st.binary(max_size=3), st.booleans())
_not_a_str = st.one_of(ints, st.lists(ints, max_size=2), st.floats(), st.binary(min_size=1, max_size=3))
WRONG = {
    "block_hashes": st.one_of(_not_a_list, st.none(), st.lists(st.text(max_size=3), min_size=1, max_size=2)),
    "token_ids": st.one_of(_not_a_list, st.lists(st.text(max_size=3), min_size=1, max_size=2)),
    "block_size": st.one_of(_not_an_int, st.none()),
    "group_idx": _not_an_int,
    "medium": _not_a_str,
    "kv_cache_spec_kind": _not_a_str,
    "parent_block_hash": st.one_of(st.text(min_size=0, max_size=3), st.floats(), st.lists(ints, max_size=1)),
}


@st.composite
def bad_event(draw: st.DrawFn) -> tuple[Any, str]:
    """(event, the reason the bridge must give)."""
    choice = draw(st.sampled_from(["wrong_type", "unknown_type", "no_type", "not_a_map", "tag_not_str"]))
    if choice == "wrong_type":
        ev = dict(draw(good_stored()))
        field = draw(st.sampled_from(sorted(WRONG)))
        ev[field] = draw(WRONG[field])
        return ev, "bad_event"
    if choice == "unknown_type":
        name = draw(st.text(max_size=30).filter(lambda t: t not in ("BlockStored", "BlockRemoved", "AllBlocksCleared")))
        return {"type": name, "block_hashes": draw(st.lists(hashes, max_size=2))}, "unknown_event_type"
    if choice == "no_type":
        return {"block_hashes": draw(st.lists(hashes, max_size=2))}, "bad_event"
    if choice == "tag_not_str":
        return {"type": draw(st.one_of(ints, st.none(), st.binary(max_size=4))), "block_hashes": []}, "bad_event"
    # an array is an event of vLLM 0.9-0.23 (`[tag, field, ...]`): one whose
    # tag is a string no release uses is an unknown type
    known = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
    value = draw(st.one_of(scalars, st.lists(scalars, max_size=3).filter(lambda v: not v or v[0] not in known)))
    if isinstance(value, list) and value and isinstance(value[0], str):
        return value, "unknown_event_type"
    return value, "bad_event"


@st.composite
def mixed_batch(draw: st.DrawFn, extra: st.SearchStrategy[Any] = any_junk) -> tuple[bytes, list[dict[str, Any]], list[str]]:
    """A batch of good and bad events: (payload, the good ones in order, the reasons of the bad)."""
    items: list[tuple[bool, Any, str]] = []
    for _ in range(draw(st.integers(0, 6))):
        if draw(st.booleans()):
            items.append((True, draw(good_events(extra)), ""))
        else:
            ev, reason = draw(bad_event())
            items.append((False, ev, reason))
    # finite: a NaN or infinite ts is refused as bad_batch (test_non_finite_ts_...)
    ts = draw(st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.integers(I64_MIN, U64_MAX)))
    tail = draw(st.lists(any_junk, max_size=2))  # extra trailing array elements: a newer vLLM
    dp = draw(st.one_of(st.none(), st.integers(0, 1024)))
    events = [ev for _, ev, _ in items]
    payload = msgspec.msgpack.encode([ts, events, dp, *tail] if tail else [ts, events, dp])
    return payload, [ev for good, ev, _ in items if good], [r for good, _, r in items if not good]
