"""The compatibility matrix's goldens (made by scripts/make_compat_goldens.py), read back.

A golden holds what one vLLM release's own ZmqEventPublisher put on the wire for
the fixed scenario (live frames, the raw replay answer), and the events as that
release's structs held them: field -> value, only the fields the release has,
hashes tagged {"int": n} or {"bytes": hex}.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import msgspec

HERE = Path(__file__).resolve().parent / "goldens"
END = b"\xff" * 8
HASH_FIELDS = ("block_hashes", "parent_block_hash")


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def untag(value: Any) -> Any:
    """A tagged hash back to bytes or int."""
    if value is None:
        return None
    if "bytes" in value:
        return bytes.fromhex(value["bytes"])
    return value["int"]


def sent_value(name: str, value: Any) -> Any:
    """An expected field's value as Python holds it after decoding msgpack."""
    if name == "block_hashes":
        return [untag(h) for h in value]
    if name == "parent_block_hash":
        return untag(value)
    return value


@dataclass(frozen=True)
class Golden:
    name: str
    version: str
    hash_form: str
    event_encoding: str
    replay_layout: str
    topic: str
    fields: dict[str, list[str]]
    batches: list[dict[str, Any]]
    live: list[list[bytes]]
    replay: list[list[bytes]]

    @property
    def id(self) -> str:
        return f"{self.version}-{self.hash_form}"

    @property
    def dp_rank(self) -> int | None:
        return self.batches[0].get("data_parallel_rank")

    @property
    def payloads(self) -> list[bytes]:
        return [frames[2] for frames in self.live]

    def has(self, event_type: str, field: str) -> bool:
        return field in self.fields.get(event_type, [])


def _frames(rows: list[list[str]]) -> list[list[bytes]]:
    return [[base64.b64decode(f) for f in row] for row in rows]


@cache
def index() -> dict[str, Any]:
    return json.loads((HERE / "index.json").read_text())


@cache
def load(name: str) -> Golden:
    raw = json.loads((HERE / name).read_text())
    return Golden(
        name=name,
        version=raw["version"],
        hash_form=raw["hash_form"],
        event_encoding=raw["event_encoding"],
        replay_layout=raw["replay_layout"],
        topic=raw["topic"],
        fields=raw["fields"],
        batches=raw["batches"],
        live=_frames(raw["live"]),
        replay=_frames(raw["replay"]),
    )


def all_names() -> list[str]:
    return [name for release in index()["releases"] for name in release["goldens"]]


def find(version: str, hash_form: str) -> Golden:
    return load(f"vllm-{version}-{hash_form}.json")


def token_ids(value: Any) -> Any:
    """A field as numbers, whether decoded or kept as the publisher's msgpack
    bytes (the relay keeps token ids, extra keys and lookahead token ids so)."""
    if isinstance(value, msgspec.Raw):
        return msgspec.msgpack.decode(value)
    return value
