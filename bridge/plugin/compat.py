"""Decide what the plugin may do with the vLLM it finds.

Three answers:

- vLLM's tracker already describes Mamba groups itself (`native_support`
  says how it knows): the plugin stands down.
- The version is a verified one and every name, signature and behaviour the
  patch relies on is where it expects (`detect`): the plugin patches.
- Anything else raises `UnsupportedVllm`, and the caller leaves vLLM alone.

The patch reaches into private names of vLLM's offloading tracker, so the
checks include a probe: a throwaway tracker is asked to record a chunk the
way the patch will ask it, and must store the payload the patch expects.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import os
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Release lines whose tracker this patch was read against and tested on, each
# against that release's real classes (tests/plugin/test_releases.py).
VERIFIED_VERSION_PREFIXES: tuple[str, ...] = (
    "0.27.",
    "0.28.",
    "0.29.",
    "0.30.",
    "0.31.",
    "0.32.",
    "0.33.",
)

# Set to a truthy value to try the patch on an unverified vLLM version; the
# layout checks below still have to pass.
ALLOW_UNVERIFIED_ENV = "KVB_PLUGIN_ALLOW_UNVERIFIED_VLLM"

EVENTS_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.events"
SCHEDULER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"

# The upstream function that says which groups the tracker describes itself.
NATIVE_PREDICATE = "describes_group"

# Class attribute the patch leaves on the tracker, holding vLLM's own methods.
PATCH_MARKER = "_kv_bridge_mamba_events"

# Parameter names (after self) of the tracker methods the patch wraps. The
# scheduler passes them positionally, but a rename usually means the meaning
# changed too, so a mismatch is treated as an unknown layout.
REQUIRED_METHODS: dict[str, tuple[str, ...]] = {
    "record_store": ("req", "group_config", "chunk_idx", "offload_key"),
    "record_lookup": ("req", "group_config", "chunk_idx", "offload_key"),
}
# Partial recurrent tails came later than the tracker; wrapped when present.
OPTIONAL_METHODS: dict[str, tuple[str, ...]] = {
    "record_partial_store": ("req", "group_config", "boundary_tokens", "offload_key"),
    "record_partial_lookup": ("req", "group_config", "boundary_tokens", "offload_key"),
}

# The unpatched take_events/reset do the emitting and forgetting for us, so
# they must exist with the shape we rely on even though they are not wrapped.
RELIED_ON_METHODS: dict[str, tuple[str, ...]] = {
    "take_events": ("events",),
    "reset": (),
}

# The payload fields the patch rewrites or reads; releases add others.
METADATA_FIELDS = frozenset(
    {"block_hashes", "parent_block_hash", "token_ids", "group_idx", "kv_cache_spec"}
)

GROUP_CONFIG_FIELDS = frozenset(
    {
        "group_idx",
        "tokens_per_block",
        "tokens_per_chunk",
        "hashes_per_chunk",
        "kv_event_group_spec",
        "sliding_window_size_in_chunks",
    }
)


class UnsupportedVllm(Exception):
    """This vLLM does not look like one the patch knows; the text says why."""


@dataclass(frozen=True)
class Layout:
    """The vLLM objects the patch needs, found and checked once."""

    vllm_version: str
    tracker_cls: type
    # The record_* methods this release has, all to be wrapped.
    methods: tuple[str, ...]
    mamba_spec_cls: type
    mamba_kind: str
    iter_layer_specs: Callable[[Any], Any] | None
    get_offload_block_hash: Callable[[Any], bytes]


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


def _wrapped_methods(tracker_cls: type) -> tuple[str, ...]:
    for name, params in {**REQUIRED_METHODS, **RELIED_ON_METHODS}.items():
        _check_method(tracker_cls, name, params)
    # The partial-tail pair came together; half of it is a layout we do not know.
    if not any(name in tracker_cls.__dict__ for name in OPTIONAL_METHODS):
        return tuple(REQUIRED_METHODS)
    for name, params in OPTIONAL_METHODS.items():
        _check_method(tracker_cls, name, params)
    return (*REQUIRED_METHODS, *OPTIONAL_METHODS)


def _check_metadata(events: Any) -> None:
    metadata_cls = _attr(events, "_OffloadEventMetadata")
    if not (isinstance(metadata_cls, type) and dataclasses.is_dataclass(metadata_cls)):
        raise UnsupportedVllm("_OffloadEventMetadata is no longer a dataclass")
    if metadata_cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise UnsupportedVllm("_OffloadEventMetadata is frozen")
    missing = METADATA_FIELDS - {f.name for f in dataclasses.fields(metadata_cls)}
    if missing:
        raise UnsupportedVllm(f"_OffloadEventMetadata lacks {sorted(missing)}")


def _check_group_config() -> None:
    scheduler = _import(SCHEDULER_MODULE)
    group_config_cls = _attr(scheduler, "GroupOffloadConfig")
    # The patch hands vLLM a copy of the group config with the window cleared.
    if not callable(getattr(group_config_cls, "_replace", None)):
        raise UnsupportedVllm("GroupOffloadConfig is no longer a NamedTuple")
    missing = GROUP_CONFIG_FIELDS - set(getattr(group_config_cls, "_fields", ()))
    if missing:
        raise UnsupportedVllm(f"GroupOffloadConfig lacks {sorted(missing)}")


def _new_probe_tracker(tracker_cls: type, base: Any) -> Any:
    config_cls = _attr(base, "OffloadingKVEventsConfig")
    try:
        return tracker_cls(
            config_cls(enable_kv_cache_events=True, self_describing_kv_events=True)
        )
    except Exception as exc:
        raise UnsupportedVllm(f"cannot build a probe {tracker_cls.__name__} ({exc!r})") from exc


# Probe geometry: 2 tokens per hash, 4 per block, 8 per chunk.
_PROBE_HASHES = tuple(bytes([i]) * 32 for i in range(1, 5))


def _probe_request() -> Any:
    return types.SimpleNamespace(
        block_hashes=list(_PROBE_HASHES), all_token_ids=list(range(8)), lora_request=None
    )


def _probe_group(kind: str, window_in_chunks: int | None, spec: Any) -> Any:
    # Duck-typed: the real GroupOffloadConfig's required fields vary by release.
    return types.SimpleNamespace(
        group_idx=0,
        tokens_per_block=4,
        tokens_per_chunk=8,
        hashes_per_chunk=4,
        kv_event_group_spec=types.SimpleNamespace(
            kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=None
        ),
        sliding_window_size_in_chunks=window_in_chunks,
        kv_cache_spec=spec,
    )


def _probe_key(base: Any) -> Any:
    return _attr(base, "make_offload_key")(_PROBE_HASHES[-1], 0)


def _probe_mamba_spec(mamba_spec_cls: type) -> Any:
    # Only its type is looked at; its fields (which vary by release) are not.
    return object.__new__(mamba_spec_cls)


def _check_attention_path(tracker_cls: type, base: Any, attention_kind: str) -> None:
    """The attention path must store a payload that ends at the chunk's key hash."""
    probe = _new_probe_tracker(tracker_cls, base)
    pending = getattr(probe, "_pending_event_metadata", None)
    if not isinstance(pending, dict):
        raise UnsupportedVllm(f"{tracker_cls.__name__} has no _pending_event_metadata dict")
    if getattr(probe, "self_describing_enabled", None) is not True:
        raise UnsupportedVllm(f"{tracker_cls.__name__}.self_describing_enabled is missing")
    key = _probe_key(base)
    try:
        # An attention group, so a patched class hands it straight to vLLM too.
        probe.record_store(_probe_request(), _probe_group(attention_kind, None, None), 0, key)
    except Exception as exc:
        raise UnsupportedVllm(f"the probe chunk failed to record ({exc!r})") from exc
    meta = pending.get(key)
    hashes = tuple(getattr(meta, "block_hashes", ()))
    if not hashes or hashes[-1] != _PROBE_HASHES[-1]:
        raise UnsupportedVllm("the attention payload of a probe chunk does not end at its key")


def _mamba_names(interface: Any) -> tuple[type, str]:
    mamba_spec_cls = _attr(interface, "MambaSpec")
    mamba_kind = str(_attr(_attr(interface, "KVCacheSpecKind"), "MAMBA").value)
    return mamba_spec_cls, mamba_kind


def _native_by_predicate(events: Any, mamba_group: Any) -> bool:
    predicate = getattr(events, NATIVE_PREDICATE, None)
    return callable(predicate) and predicate(mamba_group) is True


def _own_method(tracker_cls: type, name: str) -> Any:
    # vLLM's method even when the patch is on: asking ours would prove nothing.
    state = tracker_cls.__dict__.get(PATCH_MARKER)
    return state.originals[name] if state is not None else tracker_cls.__dict__[name]


def _native_by_behaviour(tracker_cls: type, base: Any, mamba_group: Any) -> bool:
    probe = _new_probe_tracker(tracker_cls, base)
    key = _probe_key(base)
    _own_method(tracker_cls, "record_store")(probe, _probe_request(), mamba_group, 0, key)
    return key in getattr(probe, "_pending_event_metadata", {})


def native_support(tracker_cls: type | None = None) -> str | None:
    """How this vLLM's tracker shows it describes Mamba groups itself, or None.

    Decided by capability, not by version: the upstream predicate says so for
    a Mamba group, or an unpatched tracker stores a payload for a Mamba chunk.
    Never raises: a vLLM this cannot probe is left to `detect`.
    """
    try:
        events = importlib.import_module(EVENTS_MODULE)
        interface = importlib.import_module("vllm.v1.kv_cache_interface")
        base = importlib.import_module("vllm.v1.kv_offload.base")
        cls = tracker_cls if tracker_cls is not None else events.OffloadingEventsTracker
        mamba_spec_cls, mamba_kind = _mamba_names(interface)
        mamba_group = _probe_group(mamba_kind, 1, _probe_mamba_spec(mamba_spec_cls))
        if _native_by_predicate(events, mamba_group):
            return f"{NATIVE_PREDICATE}() is true for MambaSpec groups"
        if _native_by_behaviour(cls, base, mamba_group):
            return f"{cls.__name__}.record_store keeps a payload for a MambaSpec chunk"
    except Exception:  # a probe that cannot run proves nothing either way
        return None
    return None


def detect() -> Layout:
    """Find and check everything the patch touches; raise `UnsupportedVllm` if not."""
    version = vllm_version()
    _check_version(version)

    events = _import(EVENTS_MODULE)
    tracker_cls = _attr(events, "OffloadingEventsTracker")
    methods = _wrapped_methods(tracker_cls)
    _check_metadata(events)
    _check_group_config()

    interface = _import("vllm.v1.kv_cache_interface")
    mamba_spec_cls, mamba_kind = _mamba_names(interface)
    iter_layer_specs = getattr(interface, "iter_layer_specs", None)

    base = _import("vllm.v1.kv_offload.base")
    get_offload_block_hash = _attr(base, "get_offload_block_hash")
    attention_kind = str(_attr(_attr(interface, "KVCacheSpecKind"), "FULL_ATTENTION").value)
    _check_attention_path(tracker_cls, base, attention_kind)

    return Layout(
        vllm_version=version,
        tracker_cls=tracker_cls,
        methods=methods,
        mamba_spec_cls=mamba_spec_cls,
        mamba_kind=mamba_kind,
        iter_layer_specs=iter_layer_specs,
        get_offload_block_hash=get_offload_block_hash,
    )
