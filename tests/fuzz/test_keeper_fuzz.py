"""Hypothesis over what the snapshot keeper reads: a group message or record
as the contract's schema admits it, with extreme values and unknown keys; one
whose events the contract forbids (a clear among a group's events); bytes that
are no message at all. Read back from the rank's own subjects (a rebuild) or
handed over unchecked, none of it raises: what the keeper cannot read is
counted and leaves its rank's snapshot partial, and every snapshot it then
serves encodes, decodes and restores."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from bridge.contract import HDR_FORMAT, HDR_RECORD
from bridge.contract.identity import Origin
from bridge.contract.snapshot import decode_snapshot, encode_snapshot
from bridge.producer.snapshot.keeper import ResidencyKeeper
from bridge.residency import ResidencyIndex
from bridge.residency.rank_tables import RankTables
from tests.fuzz.strategies import any_junk, good_events, group_ids, kinds

WORKER = "pod-fuzz"
RANKS = (0, 1)

small_or_extreme = st.one_of(st.integers(-2, 5), st.integers(-(2**63), 2**64 - 1))
head = {
    "v": st.sampled_from([1, 0, 99]),
    "worker": st.just(WORKER),
    "dp_rank": st.sampled_from(RANKS),
    "epoch": st.sampled_from([0, 1, 2, -1]),
    "seq": small_or_extreme,
    "ts": st.floats(allow_nan=True, allow_infinity=True),
}
group_message = st.fixed_dictionaries(
    head | {
        "group": group_ids.filter(lambda g: g is not None),
        "kind": kinds,
        "family": st.sampled_from(["attention", "state", "window", "other", "", "bogus"]),
        "kind_source": st.sampled_from(["event", "learned", "pinned", "legacy", "unknown"]),
        "events": st.lists(good_events(), max_size=8),
    },
    optional={"part": small_or_extreme, "chunk": small_or_extreme, "chunks": small_or_extreme,
              "topic": st.text(max_size=5), "bridge_ts": st.floats()},
)
worker_record = st.fixed_dictionaries(
    head | {"type": st.sampled_from(["start", "stop", "cleared", "restart", "gap"])},
    optional={"reason": st.sampled_from(["fresh", "resumed", "other"]), "first": small_or_extreme,
              "last": small_or_extreme},
)
# (is a record, payload as built, payload bytes)
items = st.one_of(
    group_message.map(lambda d: (False, d)),
    worker_record.map(lambda d: (True, d)),
    any_junk.map(lambda d: (False, d)),
)


def _rank(body: Any) -> int:
    return body["dp_rank"] if isinstance(body, dict) and body.get("dp_rank") in RANKS else 0


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(items, min_size=1, max_size=20), st.booleans())
@example([(False, {"v": 1, "worker": WORKER, "dp_rank": 0, "epoch": 0, "seq": 0, "ts": float("nan"), "group": 0,
                   "kind": "full_attention", "family": "attention", "kind_source": "event", "events": []})], False)
def test_the_keeper_takes_any_payload_and_serves_snapshots_that_restore(
        messages: list[tuple[bool, Any]], read_back: bool) -> None:
    keeper = ResidencyKeeper(WORKER, ranks=RANKS)
    flagged: set[int] = set()
    for is_record, body in messages:
        headers = {HDR_FORMAT: "msgpack"}
        if is_record:
            headers[HDR_RECORD] = "1"
        rank = _rank(body)
        group = None if is_record or not isinstance(body, dict) else body.get("group")
        origin = Origin(WORKER, rank, group if isinstance(group, int) else 0) if read_back else None
        before = keeper.undecodable
        keeper.apply_payload(headers, msgspec.msgpack.encode(body), origin=origin)
        if keeper.undecodable > before:
            flagged.update((rank,) if read_back else RANKS)
        elif is_record and body["type"] in ("start", "restart"):
            flagged.discard(rank)  # a record that resets the view may end its partial state
    for rank in RANKS:
        snap = keeper.snapshot(rank)
        if rank in flagged:
            assert snap is not None and not snap.complete
        if snap is None:
            continue
        data = encode_snapshot(snap)
        again = decode_snapshot(data)
        assert encode_snapshot(again) == data  # bytes, not fields: a NaN timestamp is not equal to itself
        ResidencyIndex(store=RankTables()).restore(again)
