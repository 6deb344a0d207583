"""JetStream publishes awaiting their PubAck, by the reply token each went out with.

The bridge writes JetStream publishes as raw HPUB frames, a whole queue's worth
per socket write, each with the reply subject `<inbox>.<token>`; the server's
PubAck comes back on that subject and is matched here by token. No future,
task or JSON parse per message: that bookkeeping in nats-py's publish_async
cost more than everything else the bridge does per message.

A token is a message's place in the bridge's send order, and it stays the
message's token when it is sent again: a late ack of any copy settles it.

Order. One stream leader stores what one connection brings in the order it
came and acks in that order, so an ack that overtakes an older unacked
message, an error reply, or no ack at all for a while is the first sign that
a message was lost on its way (a leader lost or stepping down, a connection
gone). The window then raises `trouble`, and the publisher stops sending newer
messages until the oldest is stored again (bridge.producer.sink.publisher). What still
got stored out of order in the moment before anyone could know (messages in
flight when a new leader took over) is found here from the stream sequences
the acks carry, and handed out in `reordered` for a `gap` record.

Why that finds every case: a message stored after a newer one of the same
worker and rank can only have been stored by a copy sent again (an original
cannot overtake a message sent before it on the same connection: the leader
that stores the newer one has every older one it will ever store). So every
such pair has a re-sent message `a` (older) and a message `b` (newer, stored
first). Whichever of the two is acked second meets the other in the window's
records: `b`, acked while an older message was still unacked, is kept as an
*overtaker*; `a`, re-sent, is kept as *re-sent*. Both are kept only while an
older message (for a re-sent one: one sent before its last copy) is unacked,
which in normal operation, acks in order and nothing re-sent, is never: then
an ack costs no more than before (no stream sequence is read at all).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from enum import Enum

import anyio

from bridge.producer.sink.ack_errors import PublishRefusal
from bridge.producer.sink.encode import Outgoing
from bridge.producer.sink.queue import OutBatch

# A message and the batch it came from (None: not tied to one), which a
# publisher that gives up on the message names in a gap record.
Sent = tuple[Outgoing, OutBatch | None]

_SEQ_KEY = b'"seq":'

# Bound on the order records kept during one long trouble (each is small).
_MAX_RECORDS = 1 << 16

# Wire places: far more than the tokens one process ever issues between resends.
_WIRE_STEP = 1 << 48


class Trouble(Enum):
    """Why the window's oldest message may be lost, so publishing pauses."""

    NO_ACK = "no ack in time"
    REFUSED = "the stream did not store a message"
    OVERTAKEN = "an ack overtook an older unacked message"
    RECONNECTED = "reconnected"


class Settled(Enum):
    """How waiting for one message's ack ended."""

    STORED = "stored"
    REFUSED = "refused"
    TIMEOUT = "timeout"


def ack_seq(data: bytes) -> int:
    """The stream sequence a PubAck names (for a duplicate: the stored copy's); -1 if none."""
    at = data.find(_SEQ_KEY)
    if at < 0:
        return -1
    start = end = at + len(_SEQ_KEY)
    size = len(data)
    while end < size and 48 <= data[end] <= 57:
        end += 1
    return int(data[start:end]) if end > start else -1


def take_acks(data: bytes, prefix: bytes, on_ack: Callable[[bytes, bytes, bytes | None], None]) -> int:
    """Hands the whole `MSG <inbox>.<token> <sid> <size>` frames at the start
    of `data` (`prefix` is `MSG <inbox>.`) to `on_ack`; returns the bytes they
    took. Stops at anything else and at a frame the read cut off: nats-py's
    parser takes the rest. A PubAck has neither reply subject nor headers."""
    pos = 0
    end = len(data)
    find = data.find
    while data.startswith(prefix, pos):
        eol = find(b"\r\n", pos)
        if eol < 0:
            break
        parts = data[pos + 4 : eol].split(b" ")
        if len(parts) != 3 or not parts[2].isdigit():
            break
        start = eol + 2
        stop = start + int(parts[2])
        if stop + 2 > end:
            break
        on_ack(parts[0], data[start:stop], None)
        pos = stop + 2
    return pos


def _first(item: tuple[int, Pending]) -> int:
    return item[0]


def _by_stream_seq(item: tuple[int, Outgoing, bytes]) -> tuple[int, int]:
    return ack_seq(item[2]), item[0]


class _Doubt:
    """What only a message in doubt carries (sent again, or refused)."""

    __slots__ = ("error", "horizon", "refusals", "resends")

    def __init__(self) -> None:
        self.error: PublishRefusal | None = None
        self.refusals = 0
        self.resends = 0
        self.horizon = -1


class Pending:
    """One message in the window, under its token. The common case, sent
    once and acked, sets five fields; the rest live in `doubt`, made when
    first needed."""

    __slots__ = ("doubt", "generation", "msg", "origin", "sent", "wire")

    def __init__(self, msg: Outgoing, origin: OutBatch | None, generation: int, sent: float, wire: int) -> None:
        self.msg = msg
        self.origin = origin
        # Connection generation and time of the last copy sent, and its place
        # among every copy of every message ever put on the wire.
        self.generation = generation
        self.sent = sent
        self.wire = wire
        self.doubt: _Doubt | None = None

    def _doubt(self) -> _Doubt:
        if self.doubt is None:
            self.doubt = _Doubt()
        return self.doubt

    @property
    def error(self) -> PublishRefusal | None:
        """The server's reason for not storing the last copy (None: none came)."""
        return self.doubt.error if self.doubt is not None else None

    @error.setter
    def error(self, value: PublishRefusal | None) -> None:
        self._doubt().error = value

    @property
    def refusals(self) -> int:
        return self.doubt.refusals if self.doubt is not None else 0

    @refusals.setter
    def refusals(self, value: int) -> None:
        self._doubt().refusals = value

    @property
    def resends(self) -> int:
        return self.doubt.resends if self.doubt is not None else 0

    @property
    def horizon(self) -> int:
        """The newest token that had been sent when this one was last sent again."""
        return self.doubt.horizon if self.doubt is not None else -1

    def sent_again(self, horizon: int) -> None:
        doubt = self._doubt()
        doubt.error = None
        doubt.resends += 1
        doubt.horizon = horizon


class _Stored:
    """Where a message's copy landed: its token, its worker-rank key, its stream sequence."""

    __slots__ = ("horizon", "key", "order", "origin", "seq")

    def __init__(self, order: int, key: int, seq: int, origin: OutBatch | None, horizon: int) -> None:
        self.order = order
        self.key = key
        self.seq = seq
        self.origin = origin
        self.horizon = horizon


class AckWindow:
    """In send order: what was published and not yet stored."""

    def __init__(self, inbox: str = "", on_stored: Callable[[Outgoing, bytes], None] | None = None) -> None:
        self.inbox = inbox
        # Told of every message the stream stored, with its ack, in stream
        # order: at once while nothing is in doubt (acks come in stream order
        # then), else held in `_held` until nothing is (`_hand_over`).
        self._on_stored = on_stored
        self._held: list[tuple[int, Outgoing, bytes]] = []
        self._prefix_len = len(inbox) + 1
        # Token → message; tokens are send order (a copy sent again keeps its token).
        self._pending: dict[int, Pending] = {}
        self._next = 0
        # No unacked token is below this one (it may lag: head() catches up).
        self._head = 0
        # A copy's place on the wire: a new message's is `_wire_base + token`;
        # copies sent again get places above every earlier copy, and the base
        # moves above them (_WIRE_STEP apart: more tokens than one run issues).
        self._wire_base = 0
        # Error replies taken, ever: with the acks, what the publisher watches move.
        self._errors = 0
        # Why publishing must pause and the oldest go again (None: nothing wrong seen).
        self.trouble: Trouble | None = None
        self._low_water = 0
        self._low_bytes = 0
        self._room: anyio.Event | None = None
        self._watch = -1
        self._watched: anyio.Event | None = None
        # Encoded bytes in flight (payloads and headers): the window's memory.
        self.bytes = 0
        # Order records (see the module's docstring); kept only in trouble.
        self._ahead: deque[_Stored] = deque()
        self._ahead_min = 1 << 62
        self._resent: deque[_Stored] = deque()
        self._resent_max = -1
        # Batches a copy of which was stored after a newer batch of the same
        # worker and rank: the publisher names each by a gap record.
        self.reordered: list[OutBatch] = []
        self._reported: set[tuple[int, int, int]] = set()
        self.inversions = 0

    def __len__(self) -> int:
        return len(self._pending)

    # -- sending -----------------------------------------------------------

    def reply_to(self, msg: Outgoing, generation: int, now: float, origin: OutBatch | None = None) -> str:
        """Registers `msg` (of batch `origin`) as sent; the reply subject its ack will come back on."""
        token = self._next
        self._next = token + 1
        self._pending[token] = Pending(msg, origin, generation, now, self._wire_base + token)
        self.bytes += msg.nbytes
        return f"{self.inbox}.{token}"

    def resend(self, tokens: Iterable[int], generation: int, now: float) -> tuple[list[Outgoing], list[str]]:
        """Marks these unacked messages as sent again, in this order; their
        messages and reply subjects (the same tokens) for one write."""
        messages: list[Outgoing] = []
        replies: list[str] = []
        horizon = self._next - 1
        base = self._wire_base = self._wire_base + _WIRE_STEP
        for place, token in enumerate(tokens):
            entry = self._pending.get(token)
            if entry is None:
                continue
            entry.generation = generation
            entry.sent = now
            # Below base + any token still to come (tokens >= _next > place).
            entry.wire = base + place
            entry.sent_again(horizon)
            messages.append(entry.msg)
            replies.append(f"{self.inbox}.{token}")
        return messages, replies

    @property
    def wire(self) -> int:
        """A place above every copy put on the wire so far."""
        return self._wire_base + _WIRE_STEP

    @property
    def progress(self) -> int:
        """Acks and error replies taken so far (and messages forgotten or given up): it moves while acks come."""
        return self._next - len(self._pending) + self._errors

    def forget_since(self, reply: str) -> None:
        """A write of new messages that never reached the connection: its messages are not in flight."""
        first = int(reply[self._prefix_len:])
        for token in [t for t in self._pending if t >= first]:
            self._settle(self._pending.pop(token).msg)
        self._prune()
        self._hand_over()

    def _settle(self, msg: Outgoing) -> None:
        self.bytes -= msg.nbytes

    def give_up(self, token: int) -> Pending | None:
        """The message will never be stored (refused for good, or forbidden): out of the window."""
        entry = self._pending.pop(token, None)
        if entry is not None:
            self._settle(entry.msg)
            self._advance_head()
            self._prune()
            self._hand_over()
            self._wake(token)
        return entry

    # -- the oldest --------------------------------------------------------

    def _advance_head(self) -> None:
        pending = self._pending
        head = self._head
        while head < self._next and head not in pending:
            head += 1
        self._head = head

    def head(self) -> tuple[int, Pending] | None:
        """The oldest unacked message and its token."""
        if not self._pending:
            return None
        self._advance_head()
        return self._head, self._pending[self._head]

    def unsettled(self) -> list[tuple[int, Pending]]:
        """Every unacked message, oldest first."""
        return sorted(self._pending.items(), key=_first)

    def first_with_subject(self, subject: str) -> int | None:
        """The oldest unacked message on `subject`, whatever its case (nats-py
        hands the server's error lines over in lower case)."""
        subject = subject.lower()
        found = [token for token, entry in self._pending.items() if entry.msg.subject.lower() == subject]
        return min(found) if found else None

    # -- acks ---------------------------------------------------------------

    def on_ack(self, subject: bytes, data: bytes, headers: bytes | None) -> None:
        """From the connection's parser, for every message on `<inbox>.*`."""
        try:
            token = int(subject[self._prefix_len:])
        except ValueError:
            return
        entry = self._pending.pop(token, None)
        if entry is None:
            return  # settled already: another copy's ack came first
        error = PublishRefusal.from_ack(data, headers)
        if error is not None:
            # Not stored: back in the window (out of insertion order, which
            # unsettled() puts right), for the publisher to send again or give up.
            self._pending[token] = entry
            self._errors += 1
            entry.error = error
            if not self.trouble:
                self.trouble = Trouble.REFUSED
            self._wake(token)
            return
        self.bytes -= entry.msg.nbytes
        if token == self._head and entry.doubt is None and not self._ahead and not self._resent:
            # The oldest, acked first, nothing in doubt: nothing to compare.
            self._head = token + 1
            if self._on_stored is not None:
                if self._held:
                    self._held.append((token, entry.msg, data))
                    self._hand_over()
                else:
                    self._on_stored(entry.msg, data)
        else:
            self._out_of_line(token, entry, data)
            if self._on_stored is not None:
                self._held.append((token, entry.msg, data))
                self._hand_over()
        if self._room is not None or self._watched is not None:
            self._wake(token)

    def _wake(self, token: int) -> None:
        if self._watched is not None and token == self._watch:
            self._watched.set()
        if self._room is not None and (
            (len(self._pending) <= self._low_water and self.bytes <= self._low_bytes) or self.trouble
        ):
            self._room.set()

    def _out_of_line(self, token: int, entry: Pending, data: bytes) -> None:
        """An ack of a re-sent message, or one that overtook an older unacked
        one, or any while such records are kept: compare stream sequences."""
        self._advance_head()
        pending = self._pending
        older_unacked = bool(pending) and self._head < token
        if older_unacked and not self.trouble:
            oldest = pending[self._head]
            # The oldest's last copy went out before this one's and got no ack.
            if oldest.wire < entry.wire and oldest.generation == entry.generation:
                self.trouble = Trouble.OVERTAKEN
        seq = ack_seq(data)
        if seq >= 0:
            origin = entry.origin
            stored = _Stored(token, origin.stream if origin is not None else -1, seq, origin, entry.horizon)
            self._compare(stored)
            if older_unacked:
                self._ahead.append(stored)
                self._ahead_min = min(self._ahead_min, seq)
            if entry.resends:
                self._resent.append(stored)
                self._resent_max = max(self._resent_max, seq)
        self._prune()

    def _compare(self, new: _Stored) -> None:
        key, order, seq = new.key, new.order, new.seq
        if seq > self._ahead_min:
            # Stored after a newer message of its worker and rank?
            for other in self._ahead:
                if other.key == key and other.order > order and other.seq < seq:
                    self._inversion(new, other)
                    if new.origin is not None and new.origin.seq >= 0:
                        break
        if seq < self._resent_max:
            # A re-sent older one stored after this one?
            for other in self._resent:
                if other.key == key and other.order < order and other.seq > seq:
                    self._inversion(other, new)

    def _inversion(self, older: _Stored, newer: _Stored) -> None:
        """`older` was sent first and stored last. A batch's message stored
        late is that batch's loss for a reader that takes what comes at or
        before the last applied for a copy; a record stored late (rare) makes
        the batches that overtook it suspect instead."""
        self.inversions += 1
        for stored in (older, newer):
            batch = stored.origin
            if batch is not None and batch.seq >= 0:
                key = (batch.stream, batch.epoch, batch.seq)
                if key not in self._reported:
                    self._reported.add(key)
                    self.reordered.append(batch)
                return

    def _hand_over(self) -> None:
        """The held messages to `on_stored`, in stream order, once none can
        be followed by one stored before it: every older message settled, no
        overtaker or copy sent again left to compare (the records `_prune`
        keeps exactly while an older message is unacked). A reader of the
        stream meets them in that order, and so must the bridge's own
        residency (bridge.producer.snapshot.keeper): a lost ack's copy, acked after
        newer messages, was stored before them."""
        held = self._held
        if not held or self._ahead or self._resent:
            return
        self._advance_head()
        if any(token >= self._head for token, _, _ in held):
            return
        self._held = []
        assert self._on_stored is not None
        for _, msg, data in sorted(held, key=_by_stream_seq):
            self._on_stored(msg, data)

    def take_reordered(self) -> list[OutBatch]:
        out, self.reordered = self.reordered, []
        return out

    def _prune(self) -> None:
        if not self._pending:
            self._ahead.clear()
            self._resent.clear()
            self._ahead_min, self._resent_max = 1 << 62, -1
            self._reported.clear()
            return
        head = self._head
        # An overtaker matters while an older message is unacked; a re-sent
        # one while a message sent before its last copy is. Records left
        # behind out of turn can never match (a message acked later is never
        # older than the head), so popping from the left is enough.
        ahead, resent = self._ahead, self._resent
        while ahead and (ahead[0].order < head or len(ahead) > _MAX_RECORDS):
            ahead.popleft()
        while resent and (resent[0].horizon < head or len(resent) > _MAX_RECORDS):
            resent.popleft()
        if not ahead:
            self._ahead_min = 1 << 62
        if not resent:
            self._resent_max = -1

    # -- waiting ------------------------------------------------------------

    async def wait_settled(self, token: int, timeout: float) -> Settled:
        """Until message `token` is stored, refused, or `timeout` passes."""
        entry = self._pending.get(token)
        if entry is not None and entry.error is None:
            self._watch = token
            self._watched = anyio.Event()
            try:
                with anyio.move_on_after(timeout):
                    await self._watched.wait()
            finally:
                self._watch, self._watched = -1, None
            entry = self._pending.get(token)
        if entry is None:
            return Settled.STORED
        return Settled.REFUSED if entry.error is not None else Settled.TIMEOUT

    async def wait_below(self, low_water: int, timeout: float, low_bytes: int = 1 << 62) -> None:
        """Until at most `low_water` messages and `low_bytes` bytes are in
        flight, trouble shows, or `timeout`."""
        if (len(self._pending) <= low_water and self.bytes <= low_bytes) or self.trouble:
            return
        self._low_water = low_water
        self._low_bytes = low_bytes
        self._room = anyio.Event()
        try:
            with anyio.move_on_after(timeout):
                await self._room.wait()
        finally:
            self._room = None
