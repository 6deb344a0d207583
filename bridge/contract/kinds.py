"""vLLM's kv_cache_spec_kind values, the family a consumer needs
(docs/contract.md, Families), and the residency rules bridge and consumers share."""

from __future__ import annotations

import re
from typing import Final

from bridge.contract.events import BlockHash

ATTENTION: Final = "attention"
WINDOW: Final = "window"
STATE: Final = "state"
OTHER: Final = "other"

FAMILY_OF_KIND: Final[dict[str, str]] = {
    "full_attention": ATTENTION,
    "mla_attention": ATTENTION,
    "sink_full_attention": ATTENTION,
    "sliding_window": WINDOW,
    "sliding_window_mla": WINDOW,
    "chunked_local_attention": WINDOW,
    "mamba": STATE,
    "encoder_only_attention": OTHER,
    "cross_attention": OTHER,
    "unknown": OTHER,
}

FAMILIES: Final = (ATTENTION, WINDOW, STATE, OTHER)

# Legacy vLLM sends neither kind nor group: one full-attention group.
LEGACY_KIND: Final = "full_attention"
UNKNOWN_KIND: Final = "unknown"

# vLLM numbers a worker's kv_cache_groups 0..n-1, and n is a handful. A larger
# (or negative) id names no real group: it is malformed, so that tables keyed
# by group (kinds, subjects, the registry's catalog) stay bounded.
MAX_GROUP_ID: Final = 1023

_SAFE_KIND = re.compile(r"[a-z0-9_]{1,48}")


def family_of(kind: str) -> str:
    return FAMILY_OF_KIND.get(kind, OTHER)


def clean_kind(raw: str) -> str:
    """A kind from the wire lands in headers and metrics labels; anything that
    is not a plain identifier becomes `unknown` so it cannot inject either."""
    return raw if _SAFE_KIND.fullmatch(raw) else UNKNOWN_KIND


def parse_group_kind(spec: str) -> tuple[int, str]:
    """`IDX=KIND` from --group-kind; raises ValueError naming what is wrong."""
    idx_text, sep, kind = spec.partition("=")
    if not sep or not idx_text.strip().isdigit():
        raise ValueError(f"expected IDX=KIND, got {spec!r}")
    if int(idx_text) > MAX_GROUP_ID:
        raise ValueError(f"group index {idx_text.strip()} above {MAX_GROUP_ID}")
    kind = kind.strip()
    if kind not in FAMILY_OF_KIND:
        raise ValueError(f"unknown kind {kind!r}; one of {', '.join(sorted(FAMILY_OF_KIND))}")
    return int(idx_text), kind


# vLLM's GPU tier lists only blocks that hold state, so every hash of a state
# store there is a checkpoint; offload tiers keep one state per chunk. Events
# with no medium come from releases before media existed: GPU.
GPU_MEDIUM: Final = "GPU"


def state_checkpoints(medium: str | None, hashes: list[BlockHash]) -> list[BlockHash]:
    """The hashes of a state (recurrent) store at which it holds a checkpoint."""
    if medium is None or medium == GPU_MEDIUM or len(hashes) < 2:
        return hashes
    return hashes[-1:]
