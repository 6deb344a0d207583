"""Which of one publisher's batches come next, and what is missing.

Live ZMQ messages come in arrival order; the next stage gets batches in seq
order, each once (`emit`), what neither the live stream nor replay could give
named (`gap`), and a new vLLM process announced before its first batch
(`restart`). Replay heals what the live stream skipped, a quiet stream's lost
tail, and checks a JetStream resume.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import structlog

from bridge.producer.source.frames import Frame, FrameError, parse_pub
from bridge.producer.source.recovery import Outcome, Recovery, ReplayPolicy
from bridge.producer.source.replay import ReplayClient, ReplayResult
from bridge.producer.source.sequencer import SeqTracker, Verdict
from bridge.producer.telemetry.metrics import Metrics

# A live frame that needs replay, and its verdict (None: the first one after
# an unverified resume).
Pending = tuple[Frame, Verdict | None]


class Continuity:
    """`restart(seq, previous)`: the live `seq` (None: found by a resume
    check) starts a new process, after `previous`, the last seq emitted.
    `timestamp(frame)`: the batch's vLLM timestamp, None if it cannot be read.
    `idle_probe_s` <= 0 or no `replay`: no idle probing. `policy`: how often
    and how long replay is asked before what it cannot return is named."""

    def __init__(
        self,
        *,
        topic: bytes,
        max_frame_bytes: int,
        replay: ReplayClient | None,
        policy: ReplayPolicy,
        idle_probe_s: float,
        metrics: Metrics,
        log: structlog.typing.FilteringBoundLogger,
        emit: Callable[[Frame], None],
        gap: Callable[[int, int, str], None],
        restart: Callable[[int | None, int], None],
        bad_frame: Callable[[FrameError], None],
        timestamp: Callable[[Frame], float | None],
    ) -> None:
        self._topic = topic
        self._max_frame_bytes = max_frame_bytes
        self._replay = replay
        self._idle_probe_s = idle_probe_s
        self._metrics = metrics
        self._log = log
        self._on_emit = emit
        self._on_gap = gap
        self._on_restart = restart
        self._bad_frame = bad_frame
        self._timestamp = timestamp
        self.tracker = SeqTracker()
        self._recovery = Recovery(policy, self.tracker, self._fetch, self._emit_replayed, self._gap)
        # Set by resume(): where the stream left off, until replay or the first
        # live batch shows whether vLLM is still the same process.
        self.resumed_through: int | None = None
        self._resumed_epoch = -1
        self._check: tuple[int, float] | None = None
        self._unverified = False
        # Healing and idle probes both read replay and emit; one at a time.
        self._replay_lock = anyio.Lock()
        self._probe_scope: anyio.CancelScope | None = None
        self._last_live = time.monotonic()

    @property
    def probes(self) -> bool:
        return self._replay is not None and self._idle_probe_s > 0

    def heard(self) -> None:
        """Live messages arrived: the stream is not idle."""
        self._last_live = time.monotonic()

    # -- resume (JetStream) ----------------------------------------------

    def resume(self, epoch: int, done_through: int, check_seq: int | None, check_ts: float | None) -> None:
        """Continue `epoch` after `done_through`; `check_seq`'s timestamp was `check_ts`."""
        self.tracker.last_emitted = done_through
        self.resumed_through = done_through
        self._resumed_epoch = epoch
        self._check = (check_seq, check_ts) if check_seq is not None and check_ts is not None else None

    async def verify_resume(self) -> None:
        """Same vLLM process as before the bridge stopped? Replay from the batch
        whose timestamp the stream knows: the same seq with the same timestamp
        (or, if it is no longer buffered, a later batch with a later one) means
        yes; anything else is a new process. Without such a batch there is no
        evidence, and what replay holds after `done_through` is taken as ours."""
        if self.resumed_through is None:
            return
        if self._replay is None:
            self._unverified = True
            return
        check = self._check
        start = check[0] if check is not None else self.resumed_through + 1
        result = await self._fetch(max(start, 0))
        frames = sorted(result.frames, key=lambda f: f.seq)
        if not frames:
            if not result.complete:
                self._unverified = True
            elif check is not None:
                await self._restart_and_replay()
            return
        if check is not None:
            first_ts = self._timestamp(frames[0])
            if frames[0].seq == check[0]:
                continued = first_ts == check[1]
            else:
                continued = first_ts is not None and first_ts >= check[1]
            if not continued:
                await self._restart_and_replay()
                return
        self._log.info("resume_verified", epoch=self._resumed_epoch, done_through=self.resumed_through,
                       replayed=len(frames))
        self._emit_replayed(frames, until=None)

    async def _restart_and_replay(self) -> None:
        self._restart(None)
        await self._recovery.run(None)

    # -- live ------------------------------------------------------------

    def take_live(self, parts: list[bytes]) -> Pending | None:
        """Handles a live message that needs no replay; otherwise returns it
        for `settle`."""
        try:
            frame = parse_pub(parts, self._max_frame_bytes)
        except FrameError as exc:
            self._bad_frame(exc)
            return None
        if self._topic and frame.topic != self._topic:
            self._metrics.dropped_by["foreign_topic"].inc()
            return None
        if self._unverified:
            return frame, None
        verdict = self.tracker.classify_live(frame.seq)
        if self._in_order(frame, verdict):
            return None
        return frame, verdict

    def _in_order(self, frame: Frame, verdict: Verdict) -> bool:
        """Handles the verdicts that need no replay: the next batch, or one already had."""
        if verdict is Verdict.ACCEPT:
            self._emit(frame)
            return True
        if verdict is Verdict.DUPLICATE:
            self._metrics.dropped_by["duplicate"].inc()
            return True
        return False

    async def settle(self, frame: Frame, verdict: Verdict | None) -> None:
        """A live frame out of order: a gap to heal, or a new process. An idle
        probe under way is cancelled first: its answer is of the stream before
        this frame, and the live stream waits for one recovery at most."""
        self._cancel_probe()
        if verdict is None:
            # Resumed without a replay answer: a continuing process is already
            # past the stream's last seq, a new one is not.
            self._unverified = False
            if frame.seq <= self.tracker.last_emitted:
                self._restart(frame.seq)
                await self._heal(frame)
                return
            verdict = self.tracker.classify_live(frame.seq)
            if self._in_order(frame, verdict):
                return
        if verdict is Verdict.GAP:
            await self._heal(frame)
            return
        self._restart(frame.seq)
        if frame.seq == self.tracker.next_wanted():
            self._emit(frame)
        else:
            await self._heal(frame)

    async def probe_when_idle(self) -> None:
        """A PUB stream cannot show that its last batches were lost until
        another batch comes. While the stream is quiet, ask replay now and then
        for anything after the last seq: it heals a lost tail (and batches sent
        before the SUB connected) without waiting for the next batch."""
        while True:
            await anyio.sleep(self._idle_probe_s)
            if time.monotonic() - self._last_live < self._idle_probe_s:
                continue
            async with self._replay_lock:
                with anyio.CancelScope() as scope:
                    self._probe_scope = scope
                    await self._recovery.run(None, done="probe")
                self._probe_scope = None

    # -- healing ---------------------------------------------------------

    def _restart(self, seq: int | None) -> None:
        previous = self.tracker.last_emitted
        self.tracker.restart()
        self._on_restart(seq, previous)

    def _cancel_probe(self) -> None:
        if self._probe_scope is not None:
            self._probe_scope.cancel()

    async def _heal(self, live: Frame) -> None:
        async with self._replay_lock:
            if self.tracker.wants(live.seq):
                await self._heal_locked(live)
            else:
                self._metrics.dropped_by["duplicate"].inc()

    async def _heal_locked(self, live: Frame) -> None:
        """Fetch what the live stream skipped; announce what replay cannot give,
        within the policy's bound."""
        if self._replay is None:
            self._gap(self.tracker.next_wanted(), live.seq - 1, "no_replay_endpoint")
        else:
            outcome = await self._recovery.run(live.seq)
            reason = "replay_incomplete" if outcome is Outcome.SETTLED else "replay_timeout"
            self._gap(self.tracker.next_wanted(), live.seq - 1, reason)
        self._emit(live)

    async def _fetch(self, start: int, stop_after: int | None = None, timeout_s: float | None = None,
                     done: str = "complete") -> ReplayResult:
        """A replay request, counted by result (`done` if it completed)."""
        assert self._replay is not None
        result = await self._replay.fetch(start, stop_after=stop_after, timeout_s=timeout_s)
        self._metrics.replays_by[done if result.complete else "timeout"].inc()
        return result

    def _emit_replayed(self, frames: list[Frame], until: int | None) -> None:
        """Replayed batches in seq order, each once; holes among them are gaps."""
        for frame in frames:
            if until is not None and frame.seq >= until:
                break
            if not self.tracker.wants(frame.seq):
                continue
            if self._topic and frame.topic not in (self._topic, b""):
                continue
            if frame.seq > self.tracker.next_wanted():
                self._gap(self.tracker.next_wanted(), frame.seq - 1, "replay_incomplete")
            self._metrics.replayed_batches.inc()
            self._emit(frame)

    def _emit(self, frame: Frame) -> None:
        self.tracker.emitted(frame.seq)
        self._on_emit(frame)

    def _gap(self, first: int, last: int, reason: str) -> None:
        if last >= first:
            self._on_gap(first, last, reason)
