"""A live bridge for the hostile-input tests: a good batch is recognisable on the
bus by its first block hash, whatever junk went between."""

from __future__ import annotations

import hashlib
import time

import anyio

from bridge.apps.demo.wire_writer import encode_batch, stored
from bridge.contract import GroupMessage
from tests.busutil import BusCollector


def good_hash(k: int) -> bytes:
    return hashlib.sha256(f"good:{k}".encode()).digest()


def good_batch(k: int) -> bytes:
    h = good_hash(k)
    return encode_batch(time.time(), [
        stored([h], None, list(range(16)), 16, group_idx=0, kind="full_attention"),
        stored([h], None, [], 16, group_idx=2, kind="mamba"),
    ])


def template_batch(j: int) -> bytes:
    """The raw material of mutated junk: never one of the good batches."""
    h = hashlib.sha256(f"template:{j}".encode()).digest()
    return encode_batch(time.time(), [
        stored([h, h[::-1]], h, list(range(32)), 16, group_idx=1, kind="sliding_window", sliding_window=64),
        stored([h], None, [], 16, group_idx=2, kind="mamba"),
    ])


def good_arrivals(bus: BusCollector) -> dict[int, list[GroupMessage]]:
    """k → the group messages that carried good batch k."""
    want: dict[bytes, int] = {}
    out: dict[int, list[GroupMessage]] = {}
    for g in bus.groups():
        for ev in g.events:
            hashes = getattr(ev, "block_hashes", None)
            if hashes and isinstance(hashes[0], bytes) and len(hashes[0]) == 32:
                if not want:
                    want.update({good_hash(k): k for k in range(4096)})
                k = want.get(hashes[0])
                if k is not None:
                    out.setdefault(k, []).append(g)
                    break
    return out


async def wait_good(bus: BusCollector, ks: list[int], timeout: float) -> float:
    """Seconds until every good batch in `ks` arrived with both groups."""
    t0 = time.monotonic()
    with anyio.fail_after(timeout):
        while True:
            got = good_arrivals(bus)
            if all(len({g.group for g in got.get(k, [])}) == 2 for k in ks):
                return time.monotonic() - t0
            await anyio.sleep(0.05)
