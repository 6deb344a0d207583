"""Decide whether this vLLM is one the tracker patch was written against.

The patch reaches into private names of vLLM's offloading tracker, so it
only runs when the version is a verified one and every name and signature it
relies on is where it expects. Anything else raises `UnsupportedVllm`, and the
caller leaves vLLM alone.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import os
from dataclasses import dataclass
from typing import Any

# Release lines whose tracker this patch was read against and tested on.
VERIFIED_VERSION_PREFIXES: tuple[str, ...] = ("0.33.",)

# Set to a truthy value to try the patch on an unverified vLLM version; the
# layout checks below still have to pass.
ALLOW_UNVERIFIED_ENV = "KVB_PLUGIN_ALLOW_UNVERIFIED_VLLM"

EVENTS_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.events"
SCHEDULER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"

# Parameter names (after self) of the tracker methods the patch wraps. The
# scheduler passes them positionally, but a rename usually means the meaning
# changed too, so a mismatch is treated as an unknown layout.
PATCHED_METHODS: dict[str, tuple[str, ...]] = {
    "record_store": ("req", "group_config", "chunk_idx", "offload_key"),
    "record_lookup": ("req", "group_config", "chunk_idx", "offload_key"),
    "record_partial_store": ("req", "group_config", "boundary_tokens", "offload_key"),
    "record_partial_lookup": ("req", "group_config", "boundary_tokens", "offload_key"),
}

# The unpatched take_events/reset do the emitting and forgetting for us, so
# they must exist with the shape we rely on even though they are not wrapped.
RELIED_ON_METHODS: dict[str, tuple[str, ...]] = {
    "take_events": ("events",),
    "reset": (),
}

_METADATA_FIELDS = frozenset(
    {
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec",
        "active_residencies",
    }
)

_GROUP_CONFIG_FIELDS = frozenset(
    {
        "group_idx",
        "tokens_per_block",
        "tokens_per_chunk",
        "hashes_per_chunk",
        "kv_event_group_spec",
        "kv_cache_spec",
    }
)


class UnsupportedVllm(Exception):
    """This vLLM does not look like one the patch knows; the text says why."""


@dataclass(frozen=True)
class Layout:
    """The vLLM objects the patch needs, found and checked once."""

    vllm_version: str
    tracker_cls: type
    metadata_cls: type
    group_spec_cls: type
    primary_residency: Any
    mamba_spec_cls: type
    mamba_kind: str
    iter_layer_specs: Any
    get_offload_block_hash: Any


def vllm_version() -> str:
    """The installed vLLM version, from its distribution metadata when present."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        vllm = importlib.import_module("vllm")
        return str(getattr(vllm, "__version__", "unknown"))


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def _check_version(version: str) -> None:
    if version.startswith(VERIFIED_VERSION_PREFIXES):
        return
    if _truthy(os.environ.get(ALLOW_UNVERIFIED_ENV)):
        return
    verified = ", ".join(p + "x" for p in VERIFIED_VERSION_PREFIXES)
    raise UnsupportedVllm(
        f"vLLM {version} is not a verified version (verified: {verified}); "
        f"set {ALLOW_UNVERIFIED_ENV}=1 to try anyway"
    )


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except Exception as exc:  # any import failure means the layout moved
        raise UnsupportedVllm(f"cannot import {name} ({exc!r})") from exc


def _attr(module: Any, name: str) -> Any:
    try:
        return getattr(module, name)
    except AttributeError as exc:
        raise UnsupportedVllm(f"{module.__name__}.{name} is missing") from exc


def _check_method(cls: type, name: str, params: tuple[str, ...]) -> None:
    # Looked up in the class body, not via getattr: wrapping an inherited
    # method on the subclass would silently shadow a different implementation.
    func = cls.__dict__.get(name)
    if not inspect.isfunction(func):
        raise UnsupportedVllm(f"{cls.__name__}.{name} is missing or not a plain method")
    found = tuple(inspect.signature(func).parameters)
    if found != ("self", *params):
        raise UnsupportedVllm(
            f"{cls.__name__}.{name}{found} does not match the expected (self, {', '.join(params)})"
        )


def _check_tracker_instance(tracker_cls: type, base: Any) -> None:
    # The per-instance state is created in __init__, so only a real instance
    # proves the dict and the enable flag are still there.
    config_cls = _attr(base, "OffloadingKVEventsConfig")
    try:
        probe = tracker_cls(config_cls(enable_kv_cache_events=True, self_describing_kv_events=True))
    except Exception as exc:
        raise UnsupportedVllm(f"cannot build a probe {tracker_cls.__name__} ({exc!r})") from exc
    if not isinstance(getattr(probe, "_pending_event_metadata", None), dict):
        raise UnsupportedVllm(f"{tracker_cls.__name__} has no _pending_event_metadata dict")
    if getattr(probe, "self_describing_enabled", None) is not True:
        raise UnsupportedVllm(f"{tracker_cls.__name__}.self_describing_enabled is missing")


def detect() -> Layout:
    """Find and check everything the patch touches; raise `UnsupportedVllm` if not."""
    version = vllm_version()
    _check_version(version)

    events = _import(EVENTS_MODULE)
    tracker_cls = _attr(events, "OffloadingEventsTracker")
    for name, params in {**PATCHED_METHODS, **RELIED_ON_METHODS}.items():
        _check_method(tracker_cls, name, params)

    metadata_cls = _attr(events, "_OffloadEventMetadata")
    if not (isinstance(metadata_cls, type) and dataclasses.is_dataclass(metadata_cls)):
        raise UnsupportedVllm("_OffloadEventMetadata is no longer a dataclass")
    fields = {f.name for f in dataclasses.fields(metadata_cls)}
    if fields != _METADATA_FIELDS:
        raise UnsupportedVllm(
            f"_OffloadEventMetadata fields changed: {sorted(fields ^ _METADATA_FIELDS)}"
        )
    group_spec_cls = _attr(events, "OffloadingEventGroupSpec")
    spec_fields = tuple(getattr(group_spec_cls, "_fields", ()))
    if spec_fields != ("kv_cache_spec_kind", "kv_cache_spec_sliding_window"):
        raise UnsupportedVllm(f"OffloadingEventGroupSpec fields changed: {spec_fields}")
    primary_residency = _attr(events, "_PRIMARY_RESIDENCY")

    scheduler = _import(SCHEDULER_MODULE)
    group_config_cls = _attr(scheduler, "GroupOffloadConfig")
    missing = _GROUP_CONFIG_FIELDS - set(getattr(group_config_cls, "_fields", ()))
    if missing:
        raise UnsupportedVllm(f"GroupOffloadConfig lacks {sorted(missing)}")

    interface = _import("vllm.v1.kv_cache_interface")
    mamba_spec_cls = _attr(interface, "MambaSpec")
    mamba_kind = str(_attr(_attr(interface, "KVCacheSpecKind"), "MAMBA").value)
    iter_layer_specs = getattr(interface, "iter_layer_specs", None)

    base = _import("vllm.v1.kv_offload.base")
    get_offload_block_hash = _attr(base, "get_offload_block_hash")
    _check_tracker_instance(tracker_cls, base)

    return Layout(
        vllm_version=version,
        tracker_cls=tracker_cls,
        metadata_cls=metadata_cls,
        group_spec_cls=group_spec_cls,
        primary_residency=primary_residency,
        mamba_spec_cls=mamba_spec_cls,
        mamba_kind=mamba_kind,
        iter_layer_specs=iter_layer_specs,
        get_offload_block_hash=get_offload_block_hash,
    )
