"""Batches JetStream stored behind a later batch of their worker and rank,
coalesced into the runs a `reordered` gap record names.

A lost ack's copy, sent again, can land behind messages a new stream leader
had already taken: a reader that takes a message at or before its last
applied one for a copy drops it, so each run of such batches is named.
"""

from __future__ import annotations

import msgspec

from bridge.producer.sink.queue import OutBatch


class ReorderedRun(msgspec.Struct, frozen=True):
    """Seqs `first`..`last` of pipeline `stream`'s epoch `epoch`."""

    stream: int
    epoch: int
    first: int
    last: int


def reordered_runs(batches: list[OutBatch]) -> list[ReorderedRun]:
    """Adjacent or repeated seqs of one stream and epoch become one run."""
    by_rank: dict[tuple[int, int], list[int]] = {}
    for batch in batches:
        by_rank.setdefault((batch.stream, batch.epoch), []).append(batch.seq)
    runs: list[ReorderedRun] = []
    for (stream, epoch), seqs in by_rank.items():
        seqs.sort()
        first = last = seqs[0]
        for seq in seqs[1:]:
            if seq <= last + 1:
                last = max(last, seq)
                continue
            runs.append(ReorderedRun(stream, epoch, first, last))
            first = last = seq
        runs.append(ReorderedRun(stream, epoch, first, last))
    return runs
