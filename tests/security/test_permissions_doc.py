"""docs/security.md's least-privilege example lists exactly what the tests'
users are given (bridge_permissions, reader_permissions), so a reader who
copies it gets the permissions the suite proves sufficient."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.security.secure_nats import Permissions, bridge_permissions, reader_permissions

DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"


def _users() -> dict[str, tuple[set[str], set[str], bool]]:
    text = DOC.read_text(encoding="utf-8")
    conf = re.search(r"```conf\n(jetstream \{.*?\n)```", text, re.S)
    assert conf, "the accounts example is gone from docs/security.md"
    users = {}
    # Each user block runs from its `user:` to the next one (or the end).
    for block in re.split(r"(?=\{ user: )", conf.group(1))[1:]:
        name = re.match(r'\{ user: "([^"]+)"', block).group(1)  # type: ignore[union-attr]
        users[name] = (_allowed(block, "publish"), _allowed(block, "subscribe"), "allow_responses: true" in block)
    return users


def _allowed(block: str, kind: str) -> set[str]:
    found = re.search(kind + r": \{ allow: \[(.*?)\] \}", block, re.S)
    assert found, f"no {kind} list in {block[:40]!r}"
    return set(json.loads("[" + found.group(1) + "]"))


def _as_sets(p: Permissions) -> tuple[set[str], set[str], bool]:
    return set(p.publish), set(p.subscribe), p.allow_responses


def test_the_documented_bridge_user_is_the_tested_one() -> None:
    assert _users()["bridge-pod-0"] == _as_sets(bridge_permissions("pod-0", ranks=2))


def test_the_documented_reader_is_the_tested_one() -> None:
    assert _users()["reader"] == _as_sets(reader_permissions())
