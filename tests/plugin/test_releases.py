"""The plugin across vLLM releases, each a real install in a process of its own.

- 0.34.0 describes Mamba groups itself and is the oracle: the plugin stands
  down on it, and 0.33.0 with the plugin must announce what it announces, field
  by field, in the fixed scenario of `scenario.py`.
- Every release the plugin patches (0.27.1 .. 0.33.0) must announce each Mamba
  chunk by the same rule against that release's own attention events, and
  leave attention and sliding-window events exactly as that release sends them.
- 0.26.0, the newest release before the verified range, is refused with one
  warning, by version and (when the version check is waived) by its layout.

The installs come from `make vllm-releases` (requirements/vllm-releases.txt).
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Iterator
from typing import Any

import pytest

from bridge.plugin import compat

from .releases import (
    EARLY_RUNS,
    ORACLE,
    REFUSED,
    REPO,
    Launched,
    collect,
    launch_all,
    missing_releases,
    patched_versions,
    venv_version,
)

PATCHED = patched_versions()
FORMS = ("bytes", "int")
ATTENTION, MAMBA, WINDOW = 0, 1, 2
# What the oracle comparison must cover, at the least.
REMOVED_FIELDS = {"type", "block_hashes", "group_idx", "medium", "locality", "ownership"}
STORED_FIELDS = REMOVED_FIELDS | {
    "parent_block_hash",
    "token_ids",
    "block_size",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "lora_id",
    "lora_name",
}
Result = dict[str, Any]


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Launched]]:
    """Every release's process, all started at once (collected on first use):
    the ones the session started after collection, else started now."""
    missing = missing_releases()
    if missing:
        message = f"vLLM releases not installed: {missing}; run `make vllm-releases`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    early = request.config.stash.get(EARLY_RUNS, None)
    launched = early[1] if early is not None else launch_all(tmp_path_factory.mktemp("releases"))
    yield launched
    for run in launched.values():
        if run.process.poll() is None:
            run.process.kill()


_results: dict[str, Result] = {}


def result(runs: dict[str, Launched], name: str) -> Result:
    """One run's JSON, waited for once."""
    if name not in _results:
        _results[name] = collect(runs[name])
    return _results[name]


def by_group(step: dict[str, Any], group_idx: int, kind: str) -> list[dict[str, Any]]:
    return [e for e in step["events"] if e["group_idx"] == group_idx and e["type"] == kind]


def named(res: Result, value: Any) -> Any:
    if isinstance(value, list):
        return [named(res, v) for v in value]
    return res["names"].get(str(value), value)


# ---------------------------------------------------------------- the rule


def checkpoint_of(attention: dict[str, Any]) -> dict[str, Any]:
    """The Mamba store that goes with an attention store of the same chunk (DESIGN §2)."""
    hashes = attention["block_hashes"]
    return {
        **attention,
        "block_hashes": hashes[-1:],
        "parent_block_hash": hashes[-2] if len(hashes) > 1 else attention["parent_block_hash"],
        "token_ids": [],
        "group_idx": MAMBA,
        "kv_cache_spec_kind": "mamba",
        "kv_cache_spec_sliding_window": None,
    }


def rule_violations(res: Result, run: str) -> list[str]:
    """Where a run's Mamba events break the rule against its own attention events.

    A Mamba store pairs with the attention store of the same chunk (the
    scenario lists both groups' keys in the same chunk order). Described
    attention: the Mamba store is its checkpoint. Placeholder attention (the
    chunk was forgotten): the Mamba store is the release's placeholder too, as
    the plain run of the same step has it. Removals name the key hashes either
    way, so they equal the plain run's.
    """
    problems = []
    for form in FORMS:
        for plain, got in zip(res["plain"][form], res[run][form], strict=True):
            where = f"{form} {got['step']}"
            if by_group(got, MAMBA, "BlockRemoved") != by_group(plain, MAMBA, "BlockRemoved"):
                problems.append(f"{where}: Mamba removals differ from the release's own")
            attention = by_group(got, ATTENTION, "BlockStored")
            mamba = by_group(got, MAMBA, "BlockStored")
            placeholders = by_group(plain, MAMBA, "BlockStored")
            if not len(attention) == len(mamba) == len(placeholders):
                problems.append(f"{where}: {len(attention)} attention vs {len(mamba)} Mamba stores")
                continue
            for att, state, placeholder in zip(attention, mamba, placeholders, strict=True):
                want = checkpoint_of(att) if att["block_size"] else placeholder
                if state != want:
                    diff = {k: (named(res, state.get(k)), named(res, want.get(k))) for k in want if state.get(k) != want.get(k)}
                    problems.append(f"{where}: Mamba store (got, want) {diff}")
    return problems


def described_mamba_stores(res: Result, run: str) -> int:
    return sum(
        1
        for step in res[run]["bytes"]
        for e in by_group(step, MAMBA, "BlockStored")
        if e["block_size"] > 0
    )


# ---------------------------------------------------------------- the oracle


def field_differences(ours: Result, oracle: Result, form: str) -> list[str]:
    """Every field of every event where 0.33.0 + plugin and 0.34.0 disagree."""
    mine, theirs = ours["plugin"][form], oracle["plain"][form]
    problems = []
    if [s["step"] for s in mine] != [s["step"] for s in theirs]:
        return [f"steps differ: {[s['step'] for s in mine]} vs {[s['step'] for s in theirs]}"]
    for a, b in zip(mine, theirs, strict=True):
        if len(a["events"]) != len(b["events"]):
            problems.append(f"{a['step']}: {len(a['events'])} events vs {len(b['events'])}")
            continue
        for idx, (ea, eb) in enumerate(zip(a["events"], b["events"], strict=True)):
            for field in sorted(set(ea) & set(eb)):
                if ea[field] != eb[field]:
                    problems.append(
                        f"{a['step']}[{idx}] {ea['type']} group {ea['group_idx']} {field}: "
                        f"{named(ours, ea[field])} vs {named(oracle, eb[field])}"
                    )
    return problems


@pytest.mark.parametrize("form", FORMS)
def test_plugin_on_0_33_announces_what_0_34_announces(runs: dict[str, Launched], form: str) -> None:
    ours, oracle = result(runs, venv_version()), result(runs, ORACLE)
    assert ours["skipped"] == oracle["skipped"] == []
    events = [e for step in oracle["plain"][form] for e in step["events"]]
    for e in events:
        assert (STORED_FIELDS if e["type"] == "BlockStored" else REMOVED_FIELDS) <= set(e)
    assert described_mamba_stores(oracle, "plain") > 0
    assert field_differences(ours, oracle, form) == []


def test_the_oracle_follows_the_rule(runs: dict[str, Launched]) -> None:
    oracle = result(runs, ORACLE)
    assert rule_violations(oracle, "plain") == []
    assert described_mamba_stores(oracle, "plain") > 0


def test_plugin_stands_down_on_a_self_describing_vllm(runs: dict[str, Launched]) -> None:
    oracle = result(runs, ORACLE)
    assert oracle["methods_after"] == oracle["methods_before"]
    assert [line["level"] for line in oracle["log"]] == ["INFO"], oracle["log"]
    message = oracle["log"][0]["message"]
    assert f"vLLM {ORACLE} describes Mamba offload events itself" in message
    assert "describes_group" in message and "standing down" in message
    assert oracle["plugin"] == oracle["plain"]


# ---------------------------------------------------------------- patched releases


@pytest.mark.parametrize("version", PATCHED)
def test_plugin_patches_release_by_the_rule(runs: dict[str, Launched], version: str) -> None:
    res = result(runs, version)
    infos = [line for line in res["log"] if line["level"] == "INFO"]
    assert [line["level"] for line in res["log"]] == ["INFO", "DEBUG"], res["log"]
    assert f"patched vLLM {version} " in infos[0]["message"]
    changed = {n for n in res["methods_before"] if res["methods_before"][n] != res["methods_after"][n]}
    wrapped = {"record_store", "record_lookup"}
    if res["features"]["partial_tails"]:
        wrapped |= {"record_partial_store", "record_partial_lookup"}
    assert changed == wrapped
    for form in FORMS:
        for plain, got in zip(res["plain"][form], res["plugin"][form], strict=True):
            for group_idx in (ATTENTION, WINDOW):
                same = [e for e in got["events"] if e["group_idx"] == group_idx]
                assert same == [e for e in plain["events"] if e["group_idx"] == group_idx], got["step"]
    assert rule_violations(res, "plugin") == []
    assert described_mamba_stores(res, "plugin") > 0
    assert described_mamba_stores(res, "plain") == 0


# ---------------------------------------------------------------- refused releases


def test_release_before_the_range_is_refused_by_version(runs: dict[str, Launched]) -> None:
    res = result(runs, "refused")
    assert res["vllm_version"] == REFUSED
    assert res["methods_after"] == res["methods_before"]
    assert [line["level"] for line in res["log"]] == ["WARNING"], res["log"]
    assert "NOT patching" in res["log"][0]["message"]
    assert f"vLLM {REFUSED} is not a verified version" in res["log"][0]["message"]


def test_release_before_the_range_is_refused_by_layout_too(runs: dict[str, Launched]) -> None:
    res = result(runs, "refused")
    assert res["methods_after_allowed"] == res["methods_before_allowed"] == res["methods_before"]
    assert [line["level"] for line in res["log_allowed"]] == ["WARNING"], res["log_allowed"]
    assert "record_lookup is missing" in res["log_allowed"][0]["message"]


# ---------------------------------------------------------------- what is claimed


def _line(version: str) -> str:
    return ".".join(version.split(".")[:2]) + "."


def test_verified_versions_are_the_tested_ones() -> None:
    assert set(compat.VERIFIED_VERSION_PREFIXES) == {_line(v) for v in PATCHED}
    assert not any(ORACLE.startswith(p) or REFUSED.startswith(p) for p in compat.VERIFIED_VERSION_PREFIXES)


def test_the_vllm_extra_spans_the_tested_releases() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    (spec,) = pyproject["project"]["optional-dependencies"]["vllm"]
    low, high = re.fullmatch(r"vllm>=([\d.]+),<([\d.]+)", spec).groups()  # type: ignore[union-attr]
    lines = sorted((int(v.split(".")[1]) for v in (*PATCHED, ORACLE)))
    assert (low, high) == (f"0.{lines[0]}", f"0.{lines[-1] + 1}")
