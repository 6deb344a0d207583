"""One fixed offloading scenario, run on whichever vLLM this process imports.

`python -m tests.plugin.scenario OUT.json [--register]` drives vLLM's real
tracker (built from vLLM's real classes, see `hybrid.py`) through the same
steps on every release and writes what it announced to OUT.json: first with
vLLM alone, then, with --register, after calling the plugin's `register()`
twice the way vLLM's plugin loader may. The test that runs it puts one
release's install first on PYTHONPATH, so each release is its own process.

Steps a release cannot express (its OffloadingEvent has no ownership, or no
metadata-only removals; its tracker has no partial tails) are left out and
listed under "skipped", so the same step name means the same thing on every
release that has it. Hashes are written as "x:<hex>" (bytes) or plain ints,
and `names` maps each to its position in a request's hash chain ("r1.h7"),
so a difference reads as positions, not as numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
import vllm.envs as vllm_envs
from vllm.distributed.kv_transfer.kv_connector.v1.offloading import events as vllm_events
from vllm.lora.request import LoRARequest
from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent, OffloadKey

from bridge.plugin import compat
from tests.plugin.hybrid import (
    ATTENTION,
    MAMBA,
    WINDOW,
    Hybrid,
    build_hybrid,
    chunk_key,
    make_request,
    tail_key,
)
from tests.plugin.load import method_ids, register_twice

INT_HASHES_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"
_EVENT_FIELDS = {f.name for f in dataclasses.fields(OffloadingEvent)}
STORAGE_TIER: dict[str, Any] = dict(
    medium=Medium.STORAGE, locality=Locality.LOCAL, ownership="kvcr", removal_expected=True
)


def _event(keys: Sequence[OffloadKey], removed: bool, **kwargs: Any) -> OffloadingEvent:
    kwargs.setdefault("medium", Medium.CPU)
    return OffloadingEvent(keys=list(keys), removed=removed, **kwargs)


class Driver:
    """Records what the tracker announces, step by step."""

    def __init__(self, hybrid: Hybrid, names: dict[str, str]) -> None:
        self.hybrid = hybrid
        self.tracker = hybrid.new_tracker()
        self.names = names
        self.steps: list[dict[str, Any]] = []

    def groups(self) -> list[int]:
        return [g for g in (ATTENTION, MAMBA, WINDOW) if g in self.hybrid.groups]

    def keys(self, req: Any, chunks: Iterable[int]) -> list[OffloadKey]:
        # Group-major, chunk-minor: the attention events of a step come first,
        # then the Mamba ones in the same chunk order, then the window's.
        chunk_list = list(chunks)
        return [chunk_key(req, self.hybrid.groups[g], c) for g in self.groups() for c in chunk_list]

    def record(self, method: str, req: Any, chunks: Iterable[int]) -> None:
        chunk_list = list(chunks)
        for g in self.groups():
            group = self.hybrid.groups[g]
            for c in chunk_list:
                getattr(self.tracker, method)(req, group, c, chunk_key(req, group, c))

    def record_tail(self, method: str, req: Any, boundary: int) -> list[OffloadKey]:
        keys = []
        for g in self.groups():
            group = self.hybrid.groups[g]
            key = tail_key(req, group, boundary, self.hybrid.tokens_per_hash)
            getattr(self.tracker, method)(req, group, boundary, key)
            keys.append(key)
        return keys

    def take(self, name: str, *events: OffloadingEvent) -> None:
        out = [_event_dict(e) for e in self.tracker.take_events(list(events))]
        self.steps.append({"step": name, "events": out})


def _hash_repr(value: Any) -> Any:
    return "x:" + value.hex() if isinstance(value, bytes | bytearray) else value


def _event_dict(event: Any) -> dict[str, Any]:
    fields = msgspec.structs.asdict(event)
    fields["block_hashes"] = [_hash_repr(h) for h in fields["block_hashes"]]
    if "parent_block_hash" in fields:
        fields["parent_block_hash"] = _hash_repr(fields["parent_block_hash"])
    return {"type": type(event).__name__, **msgspec.to_builtins(fields)}


def _name_hashes(names: dict[str, str], label: str, req: Any) -> None:
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    for idx, block_hash in enumerate(req.block_hashes):
        names[str(_hash_repr(maybe_convert_block_hash(block_hash)))] = f"{label}.h{idx}"


def _hybrid_steps(d: Driver, features: dict[str, bool]) -> None:
    """Full attention + Mamba + sliding window, 2 blocks per chunk, 2 hashes per block."""
    tph = d.hybrid.tokens_per_hash
    chunk = d.hybrid.groups[ATTENTION].tokens_per_chunk
    r1 = make_request("r1", 3 * chunk + 5, tph)
    lora = LoRARequest("adapter-a", 7, "/nonexistent")
    r2 = make_request("r2", chunk + 3, tph, first_token=5000, lora=lora)
    _name_hashes(d.names, "r1", r1)
    _name_hashes(d.names, "r2", r2)
    tier = features["ownership"]

    d.record("record_store", r1, range(3))
    d.record("record_store", r2, [0])
    d.take("store-cpu", _event(d.keys(r1, range(3)), False), _event(d.keys(r2, [0]), False))
    if tier:
        d.take("store-storage", _event(d.keys(r1, [0, 1]), False, **STORAGE_TIER))
    d.take("evict-cpu", _event(d.keys(r1, range(3)), True))
    d.record("record_lookup", r1, [0, 2])
    d.take("lookup-promote", _event(d.keys(r1, [0, 2]), False))
    if tier:
        storage = {k: v for k, v in STORAGE_TIER.items() if k != "removal_expected"}
        d.take("evict-storage", _event(d.keys(r1, [0, 1]), True, **storage))
        # Whether chunk 0 is still described here depends on whether this
        # release counts a lookup hit as a CPU residency; Mamba must follow.
        d.take("store-after-storage-eviction", _event(d.keys(r1, [0]), False))
    d.take("evict-cpu-again", _event(d.keys(r1, [0, 2]), True))
    d.take("store-after-evictions", _event(d.keys(r1, [0, 1]), False))
    d.take("evict-lora", _event(d.keys(r2, [0]), True))
    if features["metadata_only"]:
        d.record("record_store", r1, [1])
        d.take("failed-allocation", _event(d.keys(r1, [1]), True, metadata_only=True))
        d.take("store-after-failed-allocation", _event(d.keys(r1, [1]), False))
    d.record("record_store", r1, [0, 1])
    d.tracker.reset()
    d.take("store-after-reset", _event(d.keys(r1, [0, 1]), False))
    d.record("record_lookup", r1, [2])
    d.take("lookup-alone", _event(d.keys(r1, [2]), False))
    d.take("evict-lookup-alone", _event(d.keys(r1, [2]), True))


def _one_block_steps(d: Driver, features: dict[str, bool]) -> None:
    """Full attention + Mamba, one 64-token block per chunk: single-block chunks and tails."""
    tph = d.hybrid.tokens_per_hash
    r3 = make_request("r3", 170, tph, first_token=9000)
    _name_hashes(d.names, "r3", r3)
    d.record("record_store", r3, [0, 1])
    d.take("one-block-store", _event(d.keys(r3, [0, 1]), False))
    if features["partial_tails"]:
        for boundary in (160, 144):  # 2 hashes, then 1 hash, into chunk 2
            keys = d.record_tail("record_partial_store", r3, boundary)
            d.take(f"tail-{boundary}-store", _event(keys, False))
            d.take(f"tail-{boundary}-evict", _event(keys, True))
            keys = d.record_tail("record_partial_lookup", r3, boundary)
            d.take(f"tail-{boundary}-lookup", _event(keys, False))
            d.take(f"tail-{boundary}-lookup-evict", _event(keys, True))
    d.take("one-block-evict", _event(d.keys(r3, [0, 1]), True))


def _features() -> dict[str, bool]:
    tracker = vllm_events.OffloadingEventsTracker
    return {
        "ownership": {"ownership", "removal_expected"} <= _EVENT_FIELDS,
        "metadata_only": "metadata_only" in _EVENT_FIELDS,
        "partial_tails": "record_partial_store" in tracker.__dict__,
    }


SKIPPABLE = {
    "ownership": ["evict-storage", "store-after-storage-eviction", "store-storage"],
    "metadata_only": ["failed-allocation", "store-after-failed-allocation"],
    "partial_tails": ["tail-*"],
}


def _set_hash_form(form: str) -> None:
    os.environ[INT_HASHES_ENV] = "1" if form == "int" else "0"
    if vllm_envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES is not (form == "int"):
        raise RuntimeError(f"vLLM does not read {INT_HASHES_ENV} live in this process")


def run(form: str) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Every step of the scenario in one hash form; also the hash names."""
    _set_hash_form(form)
    features = _features()
    names: dict[str, str] = {}
    steps: list[dict[str, Any]] = []
    for build, drive in (
        (lambda: build_hybrid(), _hybrid_steps),
        (lambda: build_hybrid(block_size=64, blocks_per_chunk=1, with_window=False), _one_block_steps),
    ):
        driver = Driver(build(), names)
        drive(driver, features)
        steps.extend(driver.steps)
    return steps, names


def _both_forms() -> tuple[dict[str, Any], dict[str, str]]:
    out: dict[str, Any] = {}
    names: dict[str, str] = {}
    for form in ("bytes", "int"):
        out[form], form_names = run(form)
        names.update(form_names)
    return out, names


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--register", action="store_true")
    args = parser.parse_args(argv)

    features = _features()
    result: dict[str, Any] = {
        "vllm_version": compat.vllm_version(),
        "vllm_file": vllm_events.__file__,
        "features": features,
        "skipped": sorted(s for f, steps in SKIPPABLE.items() if not features[f] for s in steps),
        "methods_before": method_ids(),
    }
    result["plain"], names = _both_forms()
    if args.register:
        result["log"] = register_twice()
        result["methods_after"] = method_ids()
        result["plugin"], plugin_names = _both_forms()
        names.update(plugin_names)
    result["names"] = names
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    print(f"scenario: vLLM {result['vllm_version']} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
