"""A hybrid (attention + Mamba [+ sliding window]) offloading setup from vLLM's real classes.

Everything the offloading tracker sees is built the way vLLM builds it: real
KV cache specs and `KVCacheConfig`, the `OffloadingConfig` from vLLM's own
`build_offloading_config`, a real `CPUOffloadingSpec`, the `GroupOffloadConfig`s
from `SchedulerOffloadConfig.from_spec`, and the tracker constructed exactly as
`OffloadingConnectorScheduler.__init__` does. The one stand-in is the
`VllmConfig` shell: a namespace carrying real sub-configs, because a real
`VllmConfig` needs a Hugging Face model and a device. Requests are real
`Request`s hashed by vLLM's own block hasher (SHA-256).

Reused by the end-to-end test (patched tracker -> ZmqEventPublisher -> bridge
-> NATS) through `patched_events`, and by `scenario.py` on every vLLM release
the plugin is checked against (0.27.1 on), so it sticks to what they share.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from vllm.config import CacheConfig, KVEventsConfig, KVTransferConfig, ParallelConfig
from vllm.distributed.kv_events import BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    build_offloading_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventsTracker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    GroupOffloadConfig,
    SchedulerOffloadConfig,
)
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_offload.base import (
    Medium,
    OffloadingEvent,
    OffloadKey,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.request import Request

ATTENTION = 0
MAMBA = 1
WINDOW = 2


@dataclass
class Hybrid:
    """The scheduler-side offloading objects for one hybrid model."""

    spec: CPUOffloadingSpec
    config: SchedulerOffloadConfig
    groups: dict[int, GroupOffloadConfig]

    @property
    def tokens_per_hash(self) -> int:
        # Every group hashes at the same granularity; not every release names it.
        group = self.groups[ATTENTION]
        return group.tokens_per_chunk // group.hashes_per_chunk

    def new_tracker(self) -> OffloadingEventsTracker:
        """A tracker built as OffloadingConnectorScheduler.__init__ builds it."""
        # Before 0.33 the scheduler hands the tracker its config alone.
        if "group_specs" not in inspect.signature(OffloadingEventsTracker).parameters:
            return OffloadingEventsTracker(self.spec.kv_events_config)
        return OffloadingEventsTracker(
            self.spec.kv_events_config,
            {group.group_idx: group.kv_event_group_spec for group in self.config.kv_group_configs},
        )


def build_hybrid(
    *,
    block_size: int = 32,
    prefix_match_unit: int = 16,
    blocks_per_chunk: int = 2,
    with_window: bool = True,
    self_describing: bool = True,
    enable_kv_cache_events: bool = True,
) -> Hybrid:
    """Groups: 0 full attention, 1 Mamba ("align" mode), 2 sliding window (optional).

    `prefix_match_unit` is the hash granularity (tokens_per_hash), so the
    default geometry has 2 hashes per block and 2 blocks per chunk: the
    attention events are block-granular and differ from the raw hash chain,
    which is the case where the checkpoint's parent needs care.
    """
    attention = FullAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=8, dtype=torch.float16
    )
    mamba = MambaSpec(
        block_size=block_size,
        shapes=((4, 8), (2, 8)),
        dtypes=(torch.float16, torch.float16),
        mamba_cache_mode="align",
    )
    groups = [
        KVCacheGroupSpec(["model.layers.0.self_attn"], attention),
        KVCacheGroupSpec(["model.layers.1.mixer"], mamba),
    ]
    if with_window:
        window = SlidingWindowSpec(
            block_size=block_size,
            num_kv_heads=2,
            head_size=8,
            dtype=torch.float16,
            sliding_window=2 * block_size,
        )
        groups.append(KVCacheGroupSpec(["model.layers.2.self_attn"], window))
    kv_cache_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)

    cache_config = CacheConfig(
        block_size=block_size, enable_prefix_caching=True, prefix_match_unit=prefix_match_unit
    )
    # What MambaModelConfig.verify_and_update_config sets when prefix caching is on.
    cache_config.mamba_cache_mode = "align"
    extra: dict[str, Any] = {
        "cpu_bytes_to_use": 1 << 24,
        "blocks_per_chunk": blocks_per_chunk,
        "self_describing_kv_events": self_describing,
    }
    # A stand-in for VllmConfig with only the fields the offloading config reads.
    vllm_config = types.SimpleNamespace(
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=enable_kv_cache_events, publisher="zmq"
        ),
        cache_config=cache_config,
        parallel_config=ParallelConfig(),
        speculative_config=None,
        use_v2_model_runner=False,
        model_config=types.SimpleNamespace(
            model="test/hybrid-mamba",
            dtype=torch.float16,
            max_model_len=4096,
            use_mla=False,
            get_total_num_kv_heads=lambda: 2,
        ),
    )
    offloading_config = build_offloading_config(vllm_config, kv_cache_config)  # type: ignore[arg-type]
    spec = CPUOffloadingSpec(offloading_config)
    config = SchedulerOffloadConfig.from_spec(spec, vllm_config, kv_cache_config)  # type: ignore[arg-type]
    return Hybrid(
        spec=spec,
        config=config,
        groups={group.group_idx: group for group in config.kv_group_configs},
    )


def make_request(
    request_id: str,
    num_tokens: int,
    tokens_per_hash: int,
    *,
    first_token: int = 1000,
    lora: LoRARequest | None = None,
) -> Request:
    """A real Request whose block hashes come from vLLM's SHA-256 hasher."""
    init_none_hash(sha256)
    return Request(
        request_id,
        list(range(first_token, first_token + num_tokens)),
        SamplingParams(max_tokens=1),
        None,
        lora_request=lora,
        block_hasher=get_request_block_hasher(tokens_per_hash, sha256),
    )


def chunk_key(req: Request, group: GroupOffloadConfig, chunk_idx: int) -> OffloadKey:
    """The OffloadKey the scheduler gives chunk `chunk_idx` (update_offload_keys)."""
    return make_offload_key(
        req.block_hashes[(chunk_idx + 1) * group.hashes_per_chunk - 1], group.group_idx
    )


def tail_key(
    req: Request, group: GroupOffloadConfig, boundary_tokens: int, tokens_per_hash: int
) -> OffloadKey:
    """The OffloadKey of a boundary (_make_boundary_key)."""
    return make_offload_key(
        req.block_hashes[boundary_tokens // tokens_per_hash - 1], group.group_idx
    )


def record_chunks(
    tracker: OffloadingEventsTracker,
    hybrid: Hybrid,
    req: Request,
    chunks: Iterable[int],
    group_ids: Sequence[int] | None = None,
) -> list[OffloadKey]:
    """record_store every listed chunk in every group, in the scheduler's order."""
    keys: list[OffloadKey] = []
    chunk_list = list(chunks)
    for group_idx in group_ids if group_ids is not None else sorted(hybrid.groups):
        group = hybrid.groups[group_idx]
        for chunk_idx in chunk_list:
            key = chunk_key(req, group, chunk_idx)
            tracker.record_store(req, group, chunk_idx, key)
            keys.append(key)
    return keys


def stored(keys: list[OffloadKey], medium: Medium = Medium.CPU, **kwargs: Any) -> OffloadingEvent:
    return OffloadingEvent(keys=list(keys), medium=medium, removed=False, **kwargs)


def removed(keys: list[OffloadKey], medium: Medium = Medium.CPU, **kwargs: Any) -> OffloadingEvent:
    return OffloadingEvent(keys=list(keys), medium=medium, removed=True, **kwargs)


def store_events(events: Iterable[KVCacheEvent]) -> list[BlockStored]:
    """The tracker's events for a `stored` event, as a list: BlockStored only."""
    return cast("list[BlockStored]", list(events))


@dataclass
class HybridRun:
    """What `patched_events` produced, with what a test needs to check it."""

    events: list[BlockStored]
    request: Request
    hybrid: Hybrid
    num_chunks: int


def patched_events(num_chunks: int = 3, *, num_tokens: int | None = None) -> HybridRun:
    """Events of the patched tracker after storing `num_chunks` chunks to CPU.

    One BlockStored per chunk and group (attention, Mamba, sliding window),
    in group order. Hash form follows VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES as
    vLLM reads it when the events are built (here, before returning).
    """
    from bridge.plugin import patch

    hybrid = build_hybrid()
    tokens_per_chunk = hybrid.groups[ATTENTION].tokens_per_chunk
    req = make_request(
        "e2e",
        num_tokens if num_tokens is not None else num_chunks * tokens_per_chunk + 5,
        hybrid.tokens_per_hash,
    )
    with patch.patched():
        tracker = hybrid.new_tracker()
        keys = record_chunks(tracker, hybrid, req, range(num_chunks))
        events = store_events(tracker.take_events([stored(keys)]))
    return HybridRun(events=events, request=req, hybrid=hybrid, num_chunks=num_chunks)
