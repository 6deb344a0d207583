"""The `Nats-Msg-Id` scheme (docs/contract.md, Headers): one id per message, the
same every time the message is published again, so a JetStream stream keeps
one copy and a consumer can tell a copy from a new message.

Group messages: `<worker-token>:<dp_rank>:<epoch>:<seq>:<group>`, then `.p<part>`
for parts > 0 and `.c<chunk>` for a slice sent in chunks. Worker records:
`<worker-token>:<dp_rank>:<epoch>:<at>:worker:<what>`, where `at` is the seq,
the gap's range, or the record's time (always for a start or a stop: each
bridge process announces its own, even at the seq its predecessor's named),
and `what` the record type (`cleared<n>` for the n-th clear of a batch). The
epoch keeps two vLLM processes apart.
"""

from __future__ import annotations

import time

from bridge.contract.subjects import WORKER_TOKEN


def stream_base(token: str, dp_rank: int, epoch: int) -> str:
    """What every id of one (worker, rank, epoch) starts with; `token` is the
    worker's subject token. Built once per epoch: the ids are on the hot path."""
    return f"{token}:{dp_rank}:{epoch}"


def group_id(base: str, seq: str, group: int, part: int, chunk: int, chunks: int) -> str:
    """A group message's id; `seq` as text, the form its header carries too."""
    msg_id = f"{base}:{seq}:{group}"
    if part:
        msg_id = f"{msg_id}.p{part}"
    if chunks > 1:
        msg_id = f"{msg_id}.c{chunk}"
    return msg_id


def record_at(seq: int | None, ts: float, gap: tuple[int, int] | None = None) -> str:
    """Where a record stands: its gap's range, else its seq, else its time in ms
    (a start or stop with no seq yet)."""
    if gap:
        return f"{gap[0]}-{gap[1]}"
    return f"{seq}" if seq is not None else f"t{int(ts * 1000)}"


def record_id(base: str, at: str, what: str) -> str:
    """A worker record's id."""
    return f"{base}:{at}:{WORKER_TOKEN}:{what}"


def new_epoch(previous: int = 0) -> int:
    """Epochs are wall-clock milliseconds, so they also differ across bridge
    restarts; strictly rising even if the clock does not. A consumer takes a
    newer epoch for a new vLLM process."""
    return max(int(time.time() * 1000), previous + 1)
