"""Bounded recovery through replay: what the live stream skipped, asked for
again a bounded number of times within a bounded time, then named.

A replay attempt can fail whatever the publisher holds: it does not answer in
time, its answer carries a frame past the socket limit (libzmq cuts the
connection), or the answer is malformed. An attempt that returns something
moves the start on; one that returns nothing is tried again `retries` times,
then the first seq still missing is skipped: the next attempt asks from one
past it. An answer from there proves that the skipped seqs exist but cannot
be returned, so a `gap` names them (`replay_timeout`) and the stream goes on.
The whole recovery of one gap takes at most `bound_s`. Two failures end it at
once: an attempt that never connected (nobody listens), and, for an idle probe,
one that only timed out (nothing shows that a batch is missing).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Awaitable, Callable

import msgspec

from bridge.producer.source.frames import Frame
from bridge.producer.source.replay import ReplayResult
from bridge.producer.source.sequencer import SeqTracker

UNREPLAYABLE = "replay_timeout"


class ReplayPolicy(msgspec.Struct, frozen=True):
    """`timeout_s`: one attempt's limit; `retries`: attempts again at the same
    seq before it is skipped."""

    timeout_s: float
    retries: int

    @property
    def bound_s(self) -> float:
        """The longest one recovery takes: every attempt at one seq, and one
        past it."""
        return (self.retries + 2) * self.timeout_s


class Outcome(enum.Enum):
    # Replay answered whole, or up to the seq asked to stop at.
    SETTLED = "settled"
    # The bound passed, or the range left holds nothing replay could return.
    GAVE_UP = "gave_up"
    # Nothing answered (a probe of a quiet or absent publisher): nothing to recover now.
    UNANSWERED = "unanswered"


class Recovery:
    """`fetch(start, stop_after, timeout_s, done)`: one replay attempt, counted
    as `done` if it completes; `emit(frames,
    until)`: replayed batches in seq order; `gap(first, last, reason)`: a range
    named lost."""

    def __init__(
        self,
        policy: ReplayPolicy,
        tracker: SeqTracker,
        fetch: Callable[[int, int | None, float, str], Awaitable[ReplayResult]],
        emit: Callable[[list[Frame], int | None], None],
        gap: Callable[[int, int, str], None],
    ) -> None:
        self.policy = policy
        self._tracker = tracker
        self._fetch = fetch
        self._emit = emit
        self._gap = gap

    async def run(self, until: int | None, done: str = "complete") -> Outcome:
        """Replay from the first seq still wanted, up to `until` (exclusive) if
        given. The caller names what remains below `until` when this gives up."""
        tracker = self._tracker
        policy = self.policy
        deadline = time.monotonic() + policy.bound_s
        start = tracker.next_wanted()
        failures = 0
        skip = 0
        while until is None or tracker.next_wanted() < until:
            ask = start + skip
            left = deadline - time.monotonic()
            if left <= 0 or (until is not None and ask >= until):
                return Outcome.GAVE_UP
            result = await self._fetch(ask, until, min(policy.timeout_s, left), done)
            if tracker.next_wanted() != start:
                # The live stream moved on meanwhile (a probe runs beside it):
                # this answer is stale, and nothing it skipped is known lost.
                start, failures, skip = tracker.next_wanted(), 0, 0
                continue
            frames = sorted((f for f in result.frames if tracker.wants(f.seq)), key=lambda f: f.seq)
            if not (result.connected or frames or result.complete):
                # Nobody listens on the replay socket: no attempt can do better now.
                return Outcome.UNANSWERED if until is None else Outcome.GAVE_UP
            if skip:
                if not (frames or result.complete):
                    skip += 1
                    continue
                self._gap(start, ask - 1, UNREPLAYABLE)
                tracker.emitted(ask - 1)
            self._emit(frames, until)
            if result.complete:
                return Outcome.SETTLED
            if tracker.next_wanted() > start:
                start, failures, skip = tracker.next_wanted(), 0, 0
                continue
            if until is None and not (result.cut_off or result.rejected):
                # A probe that only timed out proves nothing lost (a quiet or
                # hung publisher): skipping would name seqs that may not exist.
                # One whose answer broke shows that `start` is there.
                return Outcome.UNANSWERED
            failures += 1
            if failures > policy.retries:
                skip = 1
        return Outcome.SETTLED
