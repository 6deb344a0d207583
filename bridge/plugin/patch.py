"""Wrap the offloading tracker's record_* methods for Mamba groups.

For a Mamba group the wrapper asks vLLM's own method to record the chunk as
it records a full-attention chunk of the same geometry (it hands over a copy
of the group config with the window cleared, the one thing that makes vLLM
skip the group), then cuts the payload vLLM stored down to the chunk's one
checkpoint hash (see `checkpoint.py`). Everything else about the entry
(residencies, LoRA, medium handling, when it is forgotten) is then exactly
what that vLLM release does for attention, so a Mamba chunk's lifecycle
mirrors its attention chunk's on every release. The unpatched `take_events`
emits it and fans its removals out, and the unpatched `reset` forgets it.
Every other group goes straight to the original method.

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
from .checkpoint import GeometryError, checkpoint_of
from .log import get_logger

MARKER = compat.PATCH_MARKER

# Every method the patch can wrap; a release wraps those it has (Layout.methods).
PATCHABLE_METHODS: tuple[str, ...] = (*compat.REQUIRED_METHODS, *compat.OPTIONAL_METHODS)


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
    # sliding_window_size_in_chunks set, so the window says nothing. Releases
    # whose group config carries no spec classify it in kv_event_group_spec.
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


def _as_attention(group_config: Any) -> Any:
    # vLLM's record_* skip any group with a window, and a Mamba group has a
    # window of one chunk; without it they build the attention payload.
    return group_config._replace(sliding_window_size_in_chunks=None)


def _cut_to_checkpoint(layout: compat.Layout, meta: Any, offload_key: bytes) -> None:
    """Reduce vLLM's attention-shaped payload, in place, to the chunk's checkpoint."""
    if meta is None:
        raise GeometryError("vLLM recorded no payload for the chunk")
    checkpoint = checkpoint_of(tuple(meta.block_hashes), meta.parent_block_hash)
    if checkpoint.block_hash != layout.get_offload_block_hash(offload_key):
        # Removals fan out to the payload's hash; it must be the key's own or
        # a consumer would see a store and a removal that never pair.
        raise GeometryError("the payload does not end at the offload key's hash")
    meta.block_hashes = (checkpoint.block_hash,)
    meta.parent_block_hash = checkpoint.parent_block_hash
    meta.token_ids = ()


def _restore(pending: dict[Any, Any], offload_key: bytes, before: Any) -> None:
    if before is None:
        pending.pop(offload_key, None)
    else:
        pending[offload_key] = before


def _record_checkpoint(
    layout: compat.Layout,
    original: Callable[..., Any],
    tracker: Any,
    args: tuple[Any, Any, int, bytes],
) -> bool:
    """Record a Mamba chunk through vLLM's attention path; False to fall back."""
    req, group_config, position, offload_key = args
    pending = tracker._pending_event_metadata
    before = pending.get(offload_key)
    try:
        original(tracker, req, _as_attention(group_config), position, offload_key)
        _cut_to_checkpoint(layout, pending.get(offload_key), offload_key)
        return True
    except Exception as exc:  # never let event bookkeeping break scheduling
        _restore(pending, offload_key, before)
        _warn_fallback(repr(exc))
        return False


def _wrap_chunk_method(layout: compat.Layout, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def record(self: Any, req: Any, group_config: Any, chunk_idx: int, offload_key: bytes) -> None:
        args = (req, group_config, chunk_idx, offload_key)
        if _handles(layout, self, group_config) and _record_checkpoint(
            layout, original, self, args
        ):
            return None
        return original(self, *args)

    return record


def _wrap_tail_method(layout: compat.Layout, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def record(
        self: Any, req: Any, group_config: Any, boundary_tokens: int, offload_key: bytes
    ) -> None:
        args = (req, group_config, boundary_tokens, offload_key)
        if _handles(layout, self, group_config) and _record_checkpoint(
            layout, original, self, args
        ):
            return None
        return original(self, *args)

    return record


def _wrapper_for(name: str) -> Callable[[compat.Layout, Callable[..., Any]], Callable[..., Any]]:
    # Same parameter names as vLLM's, so a keyword call still binds.
    return _wrap_chunk_method if name in compat.REQUIRED_METHODS else _wrap_tail_method


def is_patched(tracker_cls: type | None = None) -> bool:
    """Whether the tracker class currently carries this patch."""
    cls = tracker_cls if tracker_cls is not None else _loaded_tracker_cls()
    return cls is not None and MARKER in cls.__dict__


def apply(layout: compat.Layout) -> bool:
    """Patch the tracker class; False if it was already patched."""
    cls = layout.tracker_cls
    if MARKER in cls.__dict__:
        return False
    originals = {name: cls.__dict__[name] for name in layout.methods}
    wrapped = {name: _wrapper_for(name)(layout, func) for name, func in originals.items()}
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
