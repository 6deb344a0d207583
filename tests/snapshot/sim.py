"""A bus in memory, for the snapshot property test (test_property.py).

Only the transport is simulated: a JetStream stream with limits, a key-value
bucket, and the few calls of a NATS client that a consumer's bootstrap makes
(`$SRV.INFO` discovery, snapshot requests). What runs on it is the product:
the bridge's framing (Nats-Msg-Ids, encoding), ack window, residency keeper,
snapshot service and bucket writer, and the consumers' bootstrap functions.
Nothing here waits: every coroutine completes on its first step, so a test
drives them on a plain event loop, in the order it chooses.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, Final, cast

import nats.errors
import nats.js.errors
import structlog
from nats.aio.msg import Msg
from nats.js.api import RawStreamMsg
from nats.js.kv import KeyValue
from nats.micro.request import Request

from bridge.client.bucket import SnapshotBucket
from bridge.contract import HDR_MSG_ID, RecordType
from bridge.contract.snapshot import PART_OVERHEAD, SNAPSHOT_SERVICE, snapshot_subject
from bridge.producer.normalize.normalizer import StreamIdentity
from bridge.producer.sink.acks import AckWindow
from bridge.producer.sink.encode import MessageEncoder, Outgoing
from bridge.producer.sink.framing import Framing
from bridge.producer.sink.queue import OutBatch
from bridge.producer.sink.rank_reader import StoredMessage
from bridge.producer.sink.subjects import SubjectBook
from bridge.producer.snapshot.bucket import SnapshotWriter
from bridge.producer.snapshot.keeper import ResidencyKeeper
from bridge.producer.snapshot.service import SnapshotService
from bridge.producer.telemetry.metrics import Metrics

WORKER: Final = "w"
PREFIX: Final = "kv"
STREAM: Final = "KV_EVENTS"
TOPIC: Final = "kv@w"
RANKS: Final = (0, 1)
# The smallest part the service and the writer cut (they never go below 1024
# bytes of data): snapshots of a few dozen hashes come in several parts.
MAX_PAYLOAD: Final = PART_OVERHEAD + 1024

_METRICS = Metrics()
_LOG = structlog.get_logger("tests.snapshot.sim")
_REPLY: Final = "_INBOX.reply"


def subject_base(rank: int) -> str:
    return SubjectBook(PREFIX, WORKER, rank).base


class Stream:
    """A JetStream stream with a message limit (discard old) and a duplicate
    window longer than any test: a Nats-Msg-Id it stored once is not stored
    again, whatever rolled off since."""

    def __init__(self, max_msgs: int) -> None:
        self.max_msgs = max_msgs
        self.held: deque[tuple[int, Outgoing]] = deque()
        self.last_seq = 0
        self._ids: dict[str, int] = {}
        self._reading: deque[tuple[int, Outgoing]] = deque()

    @property
    def first_seq(self) -> int:
        return self.held[0][0] if self.held else self.last_seq + 1

    def store(self, msg: Outgoing) -> tuple[int, bool]:
        """The message's stream sequence, and whether it was a duplicate (not stored again)."""
        msg_id = msg.headers[HDR_MSG_ID]
        if msg_id in self._ids:
            return self._ids[msg_id], True
        self.last_seq += 1
        self._ids[msg_id] = self.last_seq
        self.held.append((self.last_seq, msg))
        while len(self.held) > self.max_msgs:
            self.held.popleft()
        return self.last_seq, False

    def expire(self, n: int) -> None:
        """The oldest `n` messages go (an age or bytes limit)."""
        for _ in range(min(n, len(self.held))):
            self.held.popleft()

    def since(self, seq: int) -> list[tuple[int, Outgoing]]:
        return [(s, m) for s, m in self.held if s >= seq]

    @staticmethod
    def ack(seq: int, duplicate: bool) -> bytes:
        """The PubAck the server sends for a publish."""
        dup = ',"duplicate":true' if duplicate else ""
        return f'{{"stream":"{STREAM}","seq":{seq}{dup}}}'.encode()

    # -- what bridge.producer.sink.jetstream.last_point asks of a JetStreamContext ---

    async def get_last_msg(self, stream_name: str, subject: str, direct: bool = False) -> RawStreamMsg:
        assert stream_name == STREAM and subject.endswith(".>")
        base = subject[:-1]
        for seq, msg in reversed(self.held):
            if msg.subject.startswith(base):
                return RawStreamMsg(subject=msg.subject, seq=seq, data=msg.payload, headers=dict(msg.headers))
        raise nats.js.errors.NotFoundError()

    # -- and the rank's consumer it reads the stored headers with (rank_reader) --

    async def add_consumer(self, stream: str, config: Any) -> SimpleNamespace:
        assert stream == STREAM and config.filter_subject.endswith(".>")
        base = config.filter_subject[:-1]
        self._reading = deque((s, m) for s, m in self.held if s >= config.opt_start_seq and m.subject.startswith(base))
        return SimpleNamespace(num_pending=len(self._reading))

    async def pull_subscribe_bind(self, consumer: str, stream: str) -> Stream:
        return self

    async def fetch(self, batch: int, timeout: float) -> list[SimpleNamespace]:
        out: list[SimpleNamespace] = []
        while self._reading and len(out) < batch:
            seq, msg = self._reading.popleft()
            meta = SimpleNamespace(sequence=SimpleNamespace(stream=seq), num_pending=len(self._reading))
            out.append(SimpleNamespace(subject=msg.subject, headers=dict(msg.headers), data=msg.payload,
                                       metadata=meta))
        return out

    async def unsubscribe(self) -> None:
        return None

    async def delete_consumer(self, stream: str, name: str) -> bool:
        return True


class MemoryBucket:
    """A key-value bucket (history 1): the calls of nats' KeyValue that the
    bucket writer and the readers make."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self._revision = 0

    async def put(self, key: str, value: bytes) -> int:
        self._revision += 1
        self.values[key] = value
        return self._revision

    async def get(self, key: str) -> KeyValue.Entry:
        if key not in self.values:
            raise nats.js.errors.KeyNotFoundError()
        return KeyValue.Entry(bucket="kv_snapshots", key=key, value=self.values[key], revision=self._revision,
                              delta=None, created=None, operation=None)

    async def purge(self, key: str) -> bool:
        self.values.pop(key, None)
        return True

    async def keys(self) -> list[str]:
        if not self.values:
            raise nats.js.errors.NoKeysError()
        return sorted(self.values)

    async def value(self, key: str) -> bytes | None:
        """`read_bucket`'s get."""
        return self.values.get(key)

    def stored(self) -> dict[str, StoredMessage]:
        """What the rebuild reads with its consumer (rebuild.own_bucket_keys): each key as stored."""
        return {k: StoredMessage(n, f"$KV.kv_snapshots.{k}", {}, v) for n, (k, v) in enumerate(self.values.items())}

    def as_kv(self) -> KeyValue:
        return cast(KeyValue, self)

    name = "kv_snapshots"

    def as_bucket(self) -> SnapshotBucket:
        """What a consumer's bootstrap reads (`value`, `name`)."""
        return cast(SnapshotBucket, self)


class SimBridge:
    """One bridge process for both ranks of worker `w`: per rank the
    product's framing, and one keeper, snapshot service and (JetStream mode)
    ack window and bucket writer. The test plays its pipeline and publisher:
    it decides what is framed and where the framed messages go."""

    def __init__(self, *, jetstream: bool, fmt: str, max_payload: int, log_bytes: int, epochs: dict[int, int],
                 bucket: MemoryBucket | None, clock: Callable[[], float]) -> None:
        self.keeper = ResidencyKeeper(WORKER, max_log_bytes=log_bytes)
        self.service = SnapshotService(self.keeper, PREFIX, list(RANKS), _METRICS, lambda: MAX_PAYLOAD)
        encoder = MessageEncoder(fmt)
        self.idents = {r: StreamIdentity(WORKER, r, TOPIC, epochs[r]) for r in RANKS}
        self.framing = {
            r: Framing(r, self.idents[r], SubjectBook(PREFIX, WORKER, r), encoder, lambda: max_payload, _METRICS,
                       _LOG, clock)
            for r in RANKS
        }
        # Whether its snapshot service answers (it may fail to register).
        self.service_up = True
        # The seq of the last batch each rank's pipeline took (-1: none yet).
        self.last_emitted = dict.fromkeys(RANKS, -1)
        self.window = AckWindow("_INBOX.acks", self.keeper.stored) if jetstream else None
        self.writer = None
        if jetstream:
            assert bucket is not None
            self.writer = SnapshotWriter(self.keeper, bucket.as_kv(), _METRICS, interval=60.0, every_messages=1 << 30,
                                         max_payload=MAX_PAYLOAD, rewrite_after=1e9)

    def record(self, rank: int, type_: RecordType, **kwargs: Any) -> OutBatch:
        return self.framing[rank].record(type_, **kwargs)


class ServiceBus:
    """What a consumer's bootstrap asks of its NATS connection: `$SRV.INFO`
    answered by the running bridge's snapshot service, and requests routed
    to its endpoints as `nats.micro` would (the real `Request`, whose answers
    come back here); no bridge, no responders."""

    def __init__(self, bridge: Callable[[], SimBridge | None], bucket: MemoryBucket | None = None) -> None:
        self._bridge = bridge
        self._bucket = bucket
        self._inbox: list[Msg] = []
        self._reply: Msg | None = None
        self.requests = 0  # snapshot requests answered: one per part

    def _answering(self) -> SimBridge | None:
        bridge = self._bridge()
        return bridge if bridge is not None and bridge.service_up else None

    def as_client(self) -> Any:
        return self

    def jetstream(self) -> ServiceBus:
        return self

    async def stream_info(self, name: str, subjects_filter: str | None = None) -> Any:
        """The bucket stream's subjects, as the bootstrap lists a bucket's heads."""
        if self._bucket is None:
            raise nats.js.errors.NotFoundError()
        heads = {f"$KV.kv_snapshots.{key}": 1 for key in self._bucket.values if "." not in key}
        return SimpleNamespace(state=SimpleNamespace(subjects=heads))

    def new_inbox(self) -> str:
        return "_INBOX.discover"

    async def subscribe(self, subject: str) -> ServiceBus:
        self._inbox = []
        return self

    async def next_msg(self, timeout: float | None = None) -> Msg:
        if not self._inbox:
            raise nats.errors.TimeoutError
        return self._inbox.pop(0)

    async def unsubscribe(self) -> None:
        self._inbox = []

    async def publish(self, subject: str, payload: bytes = b"", reply: str = "",
                      headers: dict[str, str] | None = None) -> None:
        if subject == _REPLY:
            self._reply = Msg(_client=self, subject=subject, data=payload, headers=headers)  # type: ignore[arg-type]
        elif subject == f"$SRV.INFO.{SNAPSHOT_SERVICE}" and self._answering() is not None:
            info = {"name": SNAPSHOT_SERVICE, "metadata": {"worker": WORKER, "prefix": PREFIX},
                    "endpoints": [{"subject": snapshot_subject(PREFIX, WORKER, r),
                                   "metadata": {"worker": WORKER, "dp_rank": str(r)}} for r in RANKS]}
            self._inbox.append(Msg(_client=self, subject=reply, data=json.dumps(info).encode()))  # type: ignore[arg-type]

    async def request(self, subject: str, payload: bytes = b"", timeout: float = 0.5) -> Msg:
        bridge = self._answering()
        ranks = [r for r in RANKS if snapshot_subject(PREFIX, WORKER, r) == subject]
        if bridge is None or not ranks:
            raise nats.errors.NoRespondersError
        self._reply = None
        self.requests += 1
        asked = Msg(_client=self, subject=subject, reply=_REPLY, data=payload)  # type: ignore[arg-type]
        await bridge.service.answer(ranks[0], Request(asked))
        assert self._reply is not None, "the service answered nothing"
        return self._reply
