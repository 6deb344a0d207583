"""What each pipeline is told: which publisher it reads (`StreamPlan`) and
what every pipeline of one bridge shares (`StreamSettings`), from Settings."""

from __future__ import annotations

import msgspec

from bridge.producer.config import PromptData, Settings


class StreamPlan(msgspec.Struct, frozen=True):
    """Which publisher one pipeline reads, and its place in the sink's queue."""

    index: int
    dp_rank: int
    endpoint: str
    replay_endpoint: str | None


class StreamSettings(msgspec.Struct, frozen=True):
    """What every pipeline of one bridge shares."""

    worker: str
    topic: str
    prefix: str
    pinned_kinds: dict[int, str]
    keep_placeholders: bool
    max_frame_bytes: int
    rcvhwm: int
    coalesce_s: float
    replay_timeout: float
    idle_probe_s: float
    replay_retries: int
    redact_prompts: bool = True

    @classmethod
    def of(cls, s: Settings) -> StreamSettings:
        return cls(s.worker_id, s.topic, s.subject_prefix, s.group_kind, s.keep_placeholders, s.max_frame_bytes,
                   s.zmq_rcvhwm, s.coalesce_ms / 1000, s.replay_timeout, s.idle_probe_interval, s.replay_retries,
                   s.prompt_data is PromptData.REDACT)


def stream_plans(s: Settings) -> list[StreamPlan]:
    """One plan per publisher (endpoint × rank), in the queue's stream order."""
    return [StreamPlan(i, rank, endpoint, replay) for i, (rank, endpoint, replay) in enumerate(s.stream_endpoints())]
