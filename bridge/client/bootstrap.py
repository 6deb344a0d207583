"""Bootstrap: a consumer that starts late reaches the view of one that watched
from the start (docs/consumers.md, "Starting late").

1. Find the worker ranks: the bridges' `kv-bridge-snapshot` services answer
   `$SRV.INFO`, the snapshot bucket lists the ranks it keeps, and whatever
   the subscription already brought names its ranks too.
2. Per rank, a snapshot: from its bridge (the latest), else from the bucket
   (JetStream mode; as of its last write), else none.
3. Splice: the snapshot first, then only the rank's messages after the one the
   snapshot names: on a core subscription, those after that message's
   Nats-Msg-Id in what was buffered meanwhile (NATS delivers one publisher's
   messages in the order it sent them); on a stream, those after its stream
   sequence.

A rank whose snapshot cannot be had gets a `SnapshotMissing` item instead: the
index marks its view stale until a record empties it, never silently partial.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Collection, Iterable, Mapping, Sequence

import anyio
import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient

from bridge.client.bucket import SnapshotBucket, open_snapshot_bucket
from bridge.client.identity import IdentityGuard
from bridge.client.log import get_logger
from bridge.contract import HDR_MSG_ID, GroupMessage, WorkerRecord
from bridge.contract.holdings import StreamHoldings
from bridge.contract.identity import Refusal, key_origin
from bridge.contract.snapshot import (
    DEFAULT_SNAPSHOT_BUCKET,
    SNAPSHOT_SERVICE,
    CopiedValue,
    RankSnapshot,
    SnapshotMissing,
    SnapshotUnavailable,
    decode_head,
    fetch_parts,
    read_bucket,
    snapshot_key,
    snapshot_subject,
)

log = get_logger("bridge.client.bootstrap")

RankKey = tuple[str, int]
Found = RankSnapshot | SnapshotMissing


class BootstrapOptions(msgspec.Struct, frozen=True):
    """`prefix`: the bridges' subject prefix; `bucket`: the snapshot bucket
    ("" for none); `discover_s`: how long to collect `$SRV.INFO` answers;
    `timeout_s`: per request."""

    prefix: str = "kv"
    bucket: str = DEFAULT_SNAPSHOT_BUCKET
    discover_s: float = 0.5
    timeout_s: float = 5.0


class SnapshotSource(msgspec.Struct, frozen=True):
    """Where one rank's bootstrap came from, for reports and logs."""

    worker: str
    dp_rank: int
    source: str  # "service", "bucket" or "none"
    detail: str = ""
    seconds: float = 0.0


async def discover(nc: NatsClient, opts: BootstrapOptions, kv: SnapshotBucket | None) -> set[RankKey]:
    """The ranks whose bridges answer `$SRV.INFO`, and those the bucket keeps."""
    found: set[RankKey] = set()
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        await nc.publish(f"$SRV.INFO.{SNAPSHOT_SERVICE}", b"", reply=inbox)
        with anyio.move_on_after(opts.discover_s):
            while True:
                msg = await sub.next_msg(timeout=opts.discover_s)
                found |= _service_ranks(msg.data, opts.prefix)
    except nats.errors.TimeoutError:
        pass
    finally:
        await sub.unsubscribe()
    if kv is not None:
        found |= await _bucket_ranks(nc, opts.bucket, kv)
    return found


def _service_ranks(data: bytes, prefix: str) -> set[RankKey]:
    try:
        info = json.loads(data)
        if info.get("metadata", {}).get("prefix") != prefix:
            return set()
        return {(str(ep["metadata"]["worker"]), int(ep["metadata"]["dp_rank"])) for ep in info.get("endpoints", [])}
    except (ValueError, KeyError, TypeError, AttributeError):
        return set()


async def _bucket_ranks(nc: NatsClient, bucket: str, kv: SnapshotBucket) -> set[RankKey]:
    """The ranks with a head in the bucket (heads are the keys without a dot).

    Listed from the bucket stream's subjects (one STREAM.INFO with a subject
    filter), not with `KeyValue.keys()`: that one's watcher may decide the
    bucket is empty when the server has handed its entries over but they have
    not reached the client yet (seen under load: the bucket's ranks missed)."""
    found: set[RankKey] = set()
    prefix = f"$KV.{bucket}."
    try:
        info = await nc.jetstream().stream_info(f"KV_{bucket}", subjects_filter=f"{prefix}*")
    except (nats.errors.Error, TimeoutError):
        return found
    for subject in info.state.subjects or {}:
        key = subject[len(prefix):]
        ident = key_origin(key)  # the rank is the key's, whatever the head says (fetch checks it)
        if ident is None:
            continue
        try:
            decode_head(await kv.value(key) or b"")
        except (msgspec.DecodeError, msgspec.ValidationError, nats.errors.Error, SnapshotUnavailable, TimeoutError):
            continue
        found.add(ident)
    return found


async def fetch(nc: NatsClient, opts: BootstrapOptions, kv: SnapshotBucket | None, worker: str,
                dp_rank: int, guard: IdentityGuard | None = None) -> tuple[Found, SnapshotSource]:
    """The rank's snapshot from its bridge, else from the bucket, else a
    SnapshotMissing. A snapshot that names another rank than the one its
    subject (service) or key (bucket) is for is refused (`guard` counts it)."""
    guard = guard if guard is not None else IdentityGuard()
    began = time.perf_counter()
    subject = snapshot_subject(opts.prefix, worker, dp_rank)

    async def request(data: bytes) -> bytes:
        msg = await nc.request(subject, data, timeout=opts.timeout_s)
        code = (msg.headers or {}).get("Nats-Service-Error-Code")
        if code:
            raise SnapshotUnavailable(f"{code} {(msg.headers or {}).get('Nats-Service-Error', '')}")
        return msg.data

    why = ""
    try:
        snap = await fetch_parts(request)
        refused = _refusal(snap.worker, snap.dp_rank, worker, dp_rank)
        if refused is None:
            return snap, SnapshotSource(worker, dp_rank, "service", seconds=time.perf_counter() - began)
        guard.refuse(refused, subject, snap.worker, snap.dp_rank)
        why = "the bridge's answer is a snapshot of another rank (refused)"
    except nats.errors.NoRespondersError:
        why = "no bridge answers"
    except (nats.errors.TimeoutError, TimeoutError):
        why = "the bridge did not answer in time"
    except SnapshotUnavailable as exc:
        why = f"the bridge's answer: {exc}"
    if kv is not None:
        try:
            found = await read_bucket(kv.value, worker, dp_rank)
        except CopiedValue as exc:
            found = None
            guard.refuse(Refusal.REPLY_COPY, f"snapshot bucket {kv.name}", None, None)
            why = f"{why}; bucket: {exc}"
        except (SnapshotUnavailable, nats.errors.Error, TimeoutError) as exc:
            found = None
            why = f"{why}; bucket: {exc}"
        key = snapshot_key(worker, dp_rank)
        if found is not None and not (guard.keyed(key, found[0].worker, found[0].dp_rank, "snapshot head")
                                      and guard.keyed(key, found[1].worker, found[1].dp_rank, "snapshot")):
            found = None
            why = f"{why}; bucket: the snapshot under {key} is of another rank (refused)"
        if found is not None:
            return found[1], SnapshotSource(worker, dp_rank, "bucket", detail=why,
                                            seconds=time.perf_counter() - began)
        why = f"{why}; the bucket has none" if "bucket" not in why else why
    log.warning("snapshot_missing", worker=worker, dp_rank=dp_rank, reason=why)
    return SnapshotMissing(worker, dp_rank, why), SnapshotSource(worker, dp_rank, "none", detail=why,
                                                                 seconds=time.perf_counter() - began)


def _refusal(says_worker: str, says_rank: int, worker: str, dp_rank: int) -> Refusal | None:
    if says_worker != worker:
        return Refusal.WORKER
    return Refusal.RANK if says_rank != dp_rank else None


async def fetch_all(nc: NatsClient, opts: BootstrapOptions, kv: SnapshotBucket | None, ranks: Iterable[RankKey],
                    guard: IdentityGuard | None = None) -> tuple[dict[RankKey, Found], list[SnapshotSource]]:
    """Every rank's snapshot, fetched side by side."""
    found: dict[RankKey, Found] = {}
    sources: list[SnapshotSource] = []

    async def one(key: RankKey) -> None:
        got, source = await fetch(nc, opts, kv, *key, guard=guard)
        found[key] = got
        sources.append(source)

    async with anyio.create_task_group() as tg:
        for key in sorted(set(ranks)):
            tg.start_soon(one, key)
    return found, sources


def rank_of(body: object) -> RankKey | None:
    if type(body) is GroupMessage or type(body) is WorkerRecord:
        return (body.worker, body.dp_rank)
    return None


def resets(body: object) -> bool:
    """A record after which a view holds nothing of the past: nothing to fetch."""
    return type(body) is WorkerRecord and (body.type == "restart" or (body.type == "start" and body.reason != "resumed"))


def splice_buffer(buffered: Sequence[object], found: dict[RankKey, Found],
                  older: Collection[RankKey] = (), *, gate: LiveGate | None = None) -> list[object]:
    """The items a late consumer applies: each rank's snapshot (or its
    SnapshotMissing) first, then what was buffered, less each rank's messages
    up to and including the one its snapshot names. `buffered` holds the
    subscription's items in arrival order (BusMessage-like items with `body`
    and `headers`, and Interruptions).

    `older`: ranks whose snapshot may predate the subscription with messages
    in between (a bucket's, while its bridge may have gone on publishing): the
    buffer holds the message such a snapshot names, or the snapshot is of a
    bridge that stopped (nothing came after it), or the rank gets a
    SnapshotMissing after it: what came between is not known.

    A rank the buffer shows that `found` does not (its first message came
    after the last fetch) meets the live rules already (`gate`, which then
    knows it): a SnapshotMissing before its first item, unless that item
    resets the view."""
    gate = gate if gate is not None else LiveGate(found)
    cut: dict[RankKey, int] = {}
    for i, item in enumerate(buffered):
        key = rank_of(getattr(item, "body", None))
        snap = found.get(key) if key is not None else None
        if type(snap) is RankSnapshot and snap.through and \
                getattr(item, "headers", {}).get(HDR_MSG_ID) == snap.through:
            cut[key] = i  # type: ignore[index]
    out: list[object] = []
    for key, snap in found.items():
        out.append(snap)
        if key in older and type(snap) is RankSnapshot and key not in cut and snap.watching:
            out.append(SnapshotMissing(key[0], key[1], "the bucket's snapshot is older than the subscription: "
                                                       "what came between is not known"))
    for i, item in enumerate(buffered):
        body = getattr(item, "body", None)
        key = rank_of(body)
        if key is not None and i <= cut.get(key, -1):
            continue
        if key is not None and key not in found:
            missing, _ = gate.admit(body, None)
            if missing is not None:
                out.append(missing)
        out.append(item)
    return out


class StreamOpening(msgspec.Struct, frozen=True):
    """A stream bootstrap's plan (`stream_opening`): the items it begins with,
    per rank the stream sequence its snapshot covers, and where the replay
    starts (None: the whole stream)."""

    items: list[Found]
    skip_seq: dict[RankKey, int]
    start_seq: int | None


def stream_opening(found: Mapping[RankKey, Found], first_seq: StreamHoldings | int) -> StreamOpening:
    """Each rank's snapshot (or SnapshotMissing) first, and a SnapshotMissing
    after a snapshot whose following messages the stream no longer holds
    wholly (`first_seq`: the stream's state, StreamHoldings; an int is its
    first sequence alone, for a stream that deleted nothing in its middle);
    the replay from the oldest stream sequence the snapshots need, each rank
    skipping up to its own."""
    holdings = first_seq if isinstance(first_seq, StreamHoldings) else StreamHoldings(first_seq, 1 << 62)
    items: list[Found] = []
    skip: dict[RankKey, int] = {}
    for key, snap in sorted(found.items()):
        items.append(snap)
        if type(snap) is RankSnapshot:
            skip[key] = snap.stream_seq
            if holdings.first_seq > snap.stream_seq + 1:
                items.append(SnapshotMissing(key[0], key[1], "the stream no longer holds what followed the snapshot"))
            elif not holdings.holds_after(snap.stream_seq):
                items.append(SnapshotMissing(key[0], key[1], holdings.missing_after(snap.stream_seq)))
    starts = [seq + 1 for seq in skip.values()]
    return StreamOpening(items, skip, max(holdings.first_seq, min(starts)) if starts else None)


class LiveGate:
    """After a bootstrap, what a late consumer does with each live item:
    a rank's stream messages at or below its snapshot's stream sequence are
    in the snapshot already (skipped); a rank first seen now gets a
    SnapshotMissing before its first item, unless that item resets the view.
    On a stream (`holdings`: its state when the replay began), a record that
    resets a view gets a SnapshotMissing after it when the stream no longer
    holds every message after it (`after`)."""

    __slots__ = ("holdings", "known", "skip_seq")

    def __init__(self, known: Iterable[RankKey], skip_seq: dict[RankKey, int] | None = None,
                 holdings: StreamHoldings | None = None) -> None:
        self.known = set(known)
        self.skip_seq = dict(skip_seq or {})
        self.holdings = holdings

    def after(self, body: object, stream_seq: int | None) -> SnapshotMissing | None:
        """What goes after an admitted item: a SnapshotMissing when it reset
        the view from a point the stream no longer holds wholly after."""
        if self.holdings is None or stream_seq is None or not resets(body):
            return None
        if self.holdings.holds_after(stream_seq):
            return None
        key = rank_of(body)
        assert key is not None
        return SnapshotMissing(key[0], key[1], self.holdings.missing_after(stream_seq))

    def admit(self, body: object, stream_seq: int | None) -> tuple[SnapshotMissing | None, bool]:
        """What goes before the item (a SnapshotMissing or None), and whether the item itself goes on."""
        key = rank_of(body)
        if key is None:
            return None, True
        missing = None
        if key not in self.known:
            self.known.add(key)
            if not resets(body):
                missing = SnapshotMissing(key[0], key[1], "first seen after the bootstrap")
        if stream_seq is not None and stream_seq <= self.skip_seq.get(key, 0):
            return missing, False
        return missing, True


def add_bootstrap_arguments(parser: argparse.ArgumentParser, *, by_default: bool) -> None:
    """The tools' bootstrap flags: `--no-bootstrap` (where it is on by
    default) and the snapshot bucket to fall back on."""
    if by_default:
        parser.add_argument("--no-bootstrap", action="store_true",
                            help="Start from what arrives now instead of each worker rank's snapshot.")
    parser.add_argument("--snapshot-bucket", default=DEFAULT_SNAPSHOT_BUCKET,
                        help="JetStream bucket of the bridges' snapshots, for ranks whose bridge does not answer "
                             "('' for none).")


def bootstrap_options(args: argparse.Namespace, prefix: str) -> BootstrapOptions | None:
    """What the flags ask for: options for a core-NATS bootstrap or a `--since
    snapshot` replay, or None (no bootstrap)."""
    since = getattr(args, "since", None)
    if getattr(args, "no_bootstrap", True) and since != "snapshot":
        return None
    if since not in (None, "snapshot"):
        return None  # a replay from another point of the stream: no snapshots
    return BootstrapOptions(prefix=prefix, bucket=args.snapshot_bucket)


__all__ = [
    "BootstrapOptions", "Found", "LiveGate", "RankKey", "SnapshotSource", "StreamOpening", "add_bootstrap_arguments",
    "bootstrap_options", "discover", "fetch", "fetch_all", "open_snapshot_bucket", "rank_of", "resets",
    "splice_buffer", "stream_opening",
]
