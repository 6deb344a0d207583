"""One readable line per bus message."""

from __future__ import annotations

from bridge.contract import BlockStored, GroupMessage, WorkerRecord, hash_hex


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
