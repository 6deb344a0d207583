"""docs/security.md shows what `kv-bridge nats-permissions` prints (the
users the suite's servers are configured from), so a reader who copies it
gets the permissions the suite proves; and the command prints each form."""

from __future__ import annotations

import io
import json
import re
from contextlib import redirect_stdout
from pathlib import Path

from bridge.apps.permissions import Layout, roles, server_config
from bridge.cli import main
from tests.security.secure_nats import Permissions, bridge_permissions, reader_permissions

DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"


def _conf_block() -> str:
    text = DOC.read_text(encoding="utf-8")
    conf = re.search(r"```conf\njetstream \{[^\n]*\}\n(accounts \{.*?\n)```", text, re.S)
    assert conf, "the accounts example is gone from docs/security.md"
    return conf.group(1)


def _run(*args: str) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["nats-permissions", *args]) == 0
    return out.getvalue()


def _user(data: list[dict[str, object]], name: str) -> tuple[set[str], set[str], bool]:
    (u,) = [u for u in data if u["user"] == name]
    return set(u["publish"]), set(u["subscribe"]), bool(u["allow_responses"])  # type: ignore[call-overload]


def _as_sets(p: Permissions) -> tuple[set[str], set[str], bool]:
    return set(p.publish), set(p.subscribe), p.allow_responses


def test_the_documented_accounts_block_is_the_generated_one() -> None:
    assert _conf_block() == server_config(roles(Layout(workers=["pod-0"], ranks=2)))
    assert _conf_block() == _run("--worker", "pod-0", "--ranks", "2")


def test_the_documented_bridge_user_is_the_tested_one() -> None:
    data = json.loads(_run("--worker", "pod-0", "--ranks", "2", "--format", "json"))
    assert _user(data, "bridge-pod-0") == _as_sets(bridge_permissions("pod-0", ranks=2))
    assert 'user: "bridge-pod-0"' in _conf_block()


def test_the_documented_reader_is_the_tested_one() -> None:
    data = json.loads(_run("--worker", "pod-0", "--format", "json"))
    assert _user(data, "reader") == _as_sets(reader_permissions())
    (reader,) = [u for u in data if u["user"] == "reader"]
    assert reader["inbox_prefix"] == "_INBOX.reader" and reader["subscribe"] == ["kv.>", "_INBOX.reader.>"]


def test_nsc_commands_carry_the_same_lists() -> None:
    text = _run("--worker", "pod-0", "--format", "nsc")
    for role in roles(Layout(workers=["pod-0"])):
        assert f"--allow-pub '{','.join(role.publish)}'" in text
        assert f"--allow-sub '{','.join(role.subscribe)}'" in text
    assert text.count("--allow-pub-response 1") == 2  # the bridge and observe answer requests


def test_a_bad_prefix_is_refused() -> None:
    err = io.StringIO()
    from contextlib import redirect_stderr

    with redirect_stderr(err):
        assert main(["nats-permissions", "--worker", "w", "--subject-prefix", "kv.*"]) == 2
    assert "nats-permissions" in err.getvalue()
