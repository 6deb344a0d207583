"""A worker view as plain data, to compare two consumers' views."""

from __future__ import annotations

from typing import Any

from bridge.contract.snapshot import RankSnapshot
from bridge.residency import ResidencyIndex, WorkerView


def view_state(view: WorkerView) -> dict[str, Any]:
    """What a consumer relies on: epoch, position, liveness, staleness, and per
    group its shape and every medium's copies by layer (consumer-local
    figures, such as lag or interruptions, left out)."""
    groups = {}
    for number, g in sorted(view.groups.items()):
        media = {}
        for medium in sorted(g.trusted):
            media[medium] = (dict(g.trusted[medium].items()), dict(g.suspect[medium].items()),
                             dict(g.placeholders[medium].items()))
        groups[number] = (g.kind, g.family, g.block_size, g.window, g.last_position, media)
    return {"epoch": view.epoch, "last_seq": view.last_seq, "watching": view.watching, "stale": view.stale,
            "partial": view.partial, "lost": list(view.lost), "groups": groups}


def index_state(index: ResidencyIndex) -> dict[tuple[str, int], dict[str, Any]]:
    return {(v.key.worker, v.key.dp_rank): view_state(v) for v in index}


def snapshot_state(snap: RankSnapshot) -> tuple[str, list[Any]]:
    """A rank snapshot's last message, and per group its position, counts
    and every tier, to compare two keepers' residencies."""
    return snap.through, [(g.group, g.last_position, g.stored, g.removed, tier) for g in snap.groups for tier in g.tiers]
