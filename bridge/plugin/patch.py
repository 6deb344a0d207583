"""Wrap the offloading tracker's record_* methods for Mamba groups.

Only the four record_* methods are wrapped. For a Mamba group they store a
metadata snapshot in the tracker's own table, in the shape the tracker uses
for full attention, describing the single checkpoint hash (see
`checkpoint.py`). The unpatched `take_events` then emits it and fans its
removals out exactly as it does for attention, and the unpatched `reset`
forgets it. Every other group goes straight to the original method, so
full-attention and sliding-window paths run vLLM's own code.

The originals are kept on the class under a marker attribute: the marker makes
a second application a no-op, and `unpatch` puts them back.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from . import compat
from .checkpoint import Checkpoint, GeometryError, chunk_checkpoint, tail_checkpoint
from .log import get_logger

MARKER = "_kv_bridge_mamba_events"


@dataclass(frozen=True)
class PatchState:
    """What one application changed, so it can be undone."""

    layout: compat.Layout
    originals: dict[str, Callable[..., Any]]


_fallback_warned = False


def _warn_fallback(reason: str) -> None:
    # One line per process: a geometry we cannot place repeats on every step.
    global _fallback_warned
    if _fallback_warned:
        return
    _fallback_warned = True
    get_logger().warning(
        "kv-bridge plugin: cannot describe a Mamba offload chunk (%s); "
        "vLLM's placeholder event is kept for it and any like it",
        reason,
    )


def _is_mamba_group(layout: compat.Layout, group_config: Any) -> bool:
    # By spec type, not by window: every windowed group, Mamba included, has
    # sliding_window_size_in_chunks set, so the window says nothing.
    spec = getattr(group_config, "kv_cache_spec", None)
    if spec is None:
        kind = getattr(
            getattr(group_config, "kv_event_group_spec", None), "kv_cache_spec_kind", None
        )
        return kind == layout.mamba_kind
    layer_specs = layout.iter_layer_specs(spec) if layout.iter_layer_specs else (spec,)
    return len(layer_specs) > 0 and all(
        isinstance(layer_spec, layout.mamba_spec_cls) for layer_spec in layer_specs
    )


def _handles(layout: compat.Layout, tracker: Any, group_config: Any) -> bool:
    # Disabled trackers must stay inert: nobody drains them.
    return bool(getattr(tracker, "self_describing_enabled", False)) and _is_mamba_group(
        layout, group_config
    )


def _describe(
    layout: compat.Layout,
    locate: Callable[[], Checkpoint],
    req: Any,
    group_config: Any,
    offload_key: bytes,
) -> Any | None:
    """Build the tracker's metadata for one checkpoint, or None to fall back."""
    try:
        checkpoint = locate()
        if layout.get_offload_block_hash(offload_key) != checkpoint.block_hash:
            # Removals fan out to the metadata's hash; it must be the key's own
            # or a consumer would see a store and a removal that never pair.
            raise GeometryError("offload key does not end at the checkpoint hash")
        lora = getattr(req, "lora_request", None)
        return layout.metadata_cls(
            block_hashes=(checkpoint.block_hash,),
            parent_block_hash=checkpoint.parent_block_hash,
            token_ids=(),
            block_size=checkpoint.block_size,
            lora_id=lora.adapter_id if lora is not None else None,
            lora_name=lora.name if lora is not None else None,
            extra_keys=None,
            group_idx=group_config.group_idx,
            kv_cache_spec=layout.group_spec_cls(
                kv_cache_spec_kind=layout.mamba_kind,
                kv_cache_spec_sliding_window=None,
            ),
            active_residencies={layout.primary_residency},
        )
    except Exception as exc:  # never let event bookkeeping break scheduling
        _warn_fallback(repr(exc))
        return None


def _chunk_locator(req: Any, group_config: Any, chunk_idx: int) -> Callable[[], Checkpoint]:
    return lambda: chunk_checkpoint(
        req.block_hashes,
        chunk_idx=chunk_idx,
        tokens_per_block=group_config.tokens_per_block,
        tokens_per_chunk=group_config.tokens_per_chunk,
        hashes_per_chunk=group_config.hashes_per_chunk,
    )


def _tail_locator(req: Any, group_config: Any, boundary_tokens: int) -> Callable[[], Checkpoint]:
    return lambda: tail_checkpoint(
        req.block_hashes,
        boundary_tokens=boundary_tokens,
        tokens_per_chunk=group_config.tokens_per_chunk,
        hashes_per_chunk=group_config.hashes_per_chunk,
    )


def _store(tracker: Any, offload_key: bytes, meta: Any) -> None:
    # Same merge as the tracker's own store: a re-store keeps residencies a
    # secondary tier already announced, so later removals stay paired.
    pending = tracker._pending_event_metadata
    existing = pending.get(offload_key)
    if existing is not None:
        meta.active_residencies.update(existing.active_residencies)
    pending[offload_key] = meta


def _wrap_record_store(layout: compat.Layout, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def record_store(
        self: Any, req: Any, group_config: Any, chunk_idx: int, offload_key: bytes
    ) -> None:
        if _handles(layout, self, group_config):
            meta = _describe(
                layout, _chunk_locator(req, group_config, chunk_idx), req, group_config, offload_key
            )
            if meta is not None:
                _store(self, offload_key, meta)
                return None
        return original(self, req, group_config, chunk_idx, offload_key)

    return record_store


def _wrap_record_lookup(layout: compat.Layout, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def record_lookup(
        self: Any, req: Any, group_config: Any, chunk_idx: int, offload_key: bytes
    ) -> None:
        if _handles(layout, self, group_config):
            pending = self._pending_event_metadata
            meta = pending.get(offload_key)
            if meta is None:
                meta = _describe(
                    layout,
                    _chunk_locator(req, group_config, chunk_idx),
                    req,
                    group_config,
                    offload_key,
                )
                if meta is None:
                    return original(self, req, group_config, chunk_idx, offload_key)
                pending[offload_key] = meta
            # As the tracker does for attention: a primary-tier hit is a
            # residency the manager will later evict.
            meta.active_residencies.add(layout.primary_residency)
            return None
        return original(self, req, group_config, chunk_idx, offload_key)

    return record_lookup


def _wrap_record_partial_store(
    layout: compat.Layout, original: Callable[..., Any]
) -> Callable[..., Any]:
    @functools.wraps(original)
    def record_partial_store(
        self: Any, req: Any, group_config: Any, boundary_tokens: int, offload_key: bytes
    ) -> None:
        if _handles(layout, self, group_config):
            meta = _describe(
                layout,
                _tail_locator(req, group_config, boundary_tokens),
                req,
                group_config,
                offload_key,
            )
            if meta is not None:
                _store(self, offload_key, meta)
                return None
        return original(self, req, group_config, boundary_tokens, offload_key)

    return record_partial_store


def _wrap_record_partial_lookup(
    layout: compat.Layout, original: Callable[..., Any]
) -> Callable[..., Any]:
    @functools.wraps(original)
    def record_partial_lookup(
        self: Any, req: Any, group_config: Any, boundary_tokens: int, offload_key: bytes
    ) -> None:
        if _handles(layout, self, group_config):
            pending = self._pending_event_metadata
            if offload_key in pending:
                return None
            meta = _describe(
                layout,
                _tail_locator(req, group_config, boundary_tokens),
                req,
                group_config,
                offload_key,
            )
            if meta is not None:
                pending[offload_key] = meta
                return None
        return original(self, req, group_config, boundary_tokens, offload_key)

    return record_partial_lookup


_WRAPPERS: dict[str, Callable[[compat.Layout, Callable[..., Any]], Callable[..., Any]]] = {
    "record_store": _wrap_record_store,
    "record_lookup": _wrap_record_lookup,
    "record_partial_store": _wrap_record_partial_store,
    "record_partial_lookup": _wrap_record_partial_lookup,
}

PATCHED_METHODS: tuple[str, ...] = tuple(_WRAPPERS)


def is_patched(tracker_cls: type | None = None) -> bool:
    """Whether the tracker class currently carries this patch."""
    cls = tracker_cls if tracker_cls is not None else _loaded_tracker_cls()
    return cls is not None and MARKER in cls.__dict__


def apply(layout: compat.Layout) -> bool:
    """Patch the tracker class; False if it was already patched."""
    cls = layout.tracker_cls
    if MARKER in cls.__dict__:
        return False
    originals = {name: cls.__dict__[name] for name in _WRAPPERS}
    wrapped = {name: wrap(layout, originals[name]) for name, wrap in _WRAPPERS.items()}
    # Marker (with the originals) first: should a setattr below fail, the
    # class still says it is patched and unpatch() can put every method back.
    setattr(cls, MARKER, PatchState(layout=layout, originals=originals))
    for name, func in wrapped.items():
        setattr(cls, name, func)
    return True


def _loaded_tracker_cls() -> type | None:
    module = sys.modules.get(compat.EVENTS_MODULE)
    return getattr(module, "OffloadingEventsTracker", None) if module else None


def unpatch() -> bool:
    """Restore vLLM's own methods; False if nothing was patched."""
    cls = _loaded_tracker_cls()
    if cls is None or MARKER not in cls.__dict__:
        return False
    state: PatchState = cls.__dict__[MARKER]
    for name, func in state.originals.items():
        setattr(cls, name, func)
    delattr(cls, MARKER)
    return True


@contextmanager
def patched() -> Iterator[compat.Layout]:
    """Patch for the duration of a block, then undo it if this block did it."""
    importlib.import_module(compat.EVENTS_MODULE)
    layout = compat.detect()
    applied = apply(layout)
    try:
        yield layout
    finally:
        if applied:
            unpatch()
