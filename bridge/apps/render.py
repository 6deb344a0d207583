"""One readable line per bus message."""

from __future__ import annotations

from typing import Any

from bridge.contract import BlockStored, GroupMessage, WorkerRecord, hash_hex
from bridge.contract.snapshot import RankSnapshot, SnapshotMissing


def render_group(msg: GroupMessage) -> str:
    parts: list[str] = []
    for event in msg.events:
        hashes = ",".join(hash_hex(h) for h in event.block_hashes[:4])
        more = f"+{len(event.block_hashes) - 4}" if len(event.block_hashes) > 4 else ""
        if type(event) is BlockStored:
            parent = hash_hex(event.parent_block_hash) if event.parent_block_hash is not None else "-"
            flag = " placeholder" if event.placeholder else ""
            parts.append(f"stored[{event.medium or '?'}] {hashes}{more} parent={parent} bs={event.block_size}{flag}")
        else:
            parts.append(f"removed[{event.medium or '?'}] {hashes}{more}")
    head = (
        f"{msg.worker} dp{msg.dp_rank} seq={msg.seq} g{msg.group} {msg.family}/{msg.kind}"
        f"{'' if msg.kind_source == 'event' else f' ({msg.kind_source})'}"
    )
    return f"{head}: " + "; ".join(parts)


def render_record(rec: WorkerRecord) -> str:
    extra = ""
    if rec.type == "gap":
        extra = f" lost={rec.gap_from}..{rec.gap_to} reason={rec.reason}"
    elif rec.seq is not None:
        extra = f" seq={rec.seq}"
    return f"{rec.worker} dp{rec.dp_rank} WORKER {rec.type.upper()} epoch={rec.epoch}{extra}"


def snapshot_summary(item: RankSnapshot | SnapshotMissing) -> dict[str, Any]:
    """What a snapshot holds, counted: per group and medium, hashes by layer."""
    if type(item) is SnapshotMissing:
        return {"type": "snapshot_missing", "worker": item.worker, "dp_rank": item.dp_rank, "reason": item.reason}
    snap: RankSnapshot = item  # type: ignore[assignment]
    groups = {
        str(g.group): {"kind": g.kind, "family": g.family, "media": {
            t.medium: {"trusted": len(t.trusted), "suspect": len(t.suspect), "placeholders": len(t.placeholders)}
            for t in g.tiers}}
        for g in snap.groups
    }
    return {"type": "snapshot", "worker": snap.worker, "dp_rank": snap.dp_rank, "epoch": snap.epoch,
            "through": snap.through, "stream_seq": snap.stream_seq, "last_seq": snap.last_seq,
            "complete": snap.complete, "groups": groups}


def render_snapshot(item: RankSnapshot | SnapshotMissing) -> str:
    doc = snapshot_summary(item)
    head = f"{doc['worker']} dp{doc['dp_rank']}"
    if doc["type"] == "snapshot_missing":
        return f"{head} SNAPSHOT MISSING ({doc['reason']}): the view is stale"
    at = f" stream_seq={doc['stream_seq']}" if doc["stream_seq"] else ""
    parts = []
    for number, g in doc["groups"].items():
        media = " ".join(f"{m}={c['trusted']}" + (f"+{c['suspect']}?" if c["suspect"] else "")
                         for m, c in g["media"].items())
        parts.append(f"g{number} {g['family']}/{g['kind']} {media}".rstrip())
    flag = "" if doc["complete"] else " (partial)"
    return f"{head} SNAPSHOT epoch={doc['epoch']} seq={doc['last_seq']}{at}{flag}: " + "; ".join(parts)
