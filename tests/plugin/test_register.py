"""Loading the plugin: discovery, vLLM's loader, idempotence, kill switch, stand-down, refusal."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import vllm.plugins  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading import events as vllm_events  # noqa: E402
from vllm.v1.kv_cache_interface import MambaSpec  # noqa: E402

import bridge.plugin as plugin  # noqa: E402
from bridge.plugin import compat, patch  # noqa: E402

Tracker = vllm_events.OffloadingEventsTracker
METHODS = (
    "record_store",
    "record_lookup",
    "record_partial_store",
    "record_partial_lookup",
    "take_events",
    "reset",
)
REPO = Path(__file__).resolve().parents[2]


def own_methods() -> dict[str, object]:
    return {name: Tracker.__dict__.get(name) for name in METHODS}


def plugin_records(caplog: pytest.LogCaptureFixture, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "kv_bridge.plugin" and r.levelno == level]


def test_register_patches_once(caplog: pytest.LogCaptureFixture) -> None:
    originals = own_methods()
    with caplog.at_level(logging.DEBUG, logger="kv_bridge.plugin"):
        plugin.register()
        first = own_methods()
        plugin.register()
        second = own_methods()
    assert patch.is_patched()
    assert first == second  # the second load wrapped nothing
    changed = {name for name in METHODS if first[name] is not originals[name]}
    assert changed == set(patch.PATCHABLE_METHODS)
    infos = plugin_records(caplog, logging.INFO)
    assert len(infos) == 1
    assert "patched vLLM 0.33" in infos[0].getMessage() and "record_store" in infos[0].getMessage()
    assert not plugin_records(caplog, logging.WARNING)


def test_unpatch_restores_vllms_own_methods() -> None:
    originals = own_methods()
    plugin.register()
    assert patch.unpatch() is True
    assert own_methods() == originals
    assert not patch.is_patched()
    assert patch.unpatch() is False


def test_patched_context_undoes_only_what_it_did() -> None:
    originals = own_methods()
    with patch.patched():
        assert patch.is_patched()
    assert own_methods() == originals
    plugin.register()
    with patch.patched():
        pass
    assert patch.is_patched()  # registered before the block, so left in place


@pytest.mark.parametrize("value", ["1", "true", "YES"])
def test_kill_switch(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, value: str
) -> None:
    monkeypatch.setenv("KVB_PLUGIN_DISABLE", value)
    originals = own_methods()
    with caplog.at_level(logging.INFO, logger="kv_bridge.plugin"):
        plugin.register()
    assert own_methods() == originals and not patch.is_patched()
    assert any("KVB_PLUGIN_DISABLE" in r.getMessage() for r in plugin_records(caplog, logging.INFO))


def test_kill_switch_off_values_still_patch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVB_PLUGIN_DISABLE", "0")
    plugin.register()
    assert patch.is_patched()


def _drop_method(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(Tracker, "record_partial_lookup")


def _change_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    def record_store(self, req, group_config, chunk_idx, offload_key, medium):
        return None

    monkeypatch.setattr(Tracker, "record_store", record_store)


def _move_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "EVENTS_MODULE", "vllm.distributed.kv_transfer.no_such_module")


def _newer_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.34.0")


def _metadata_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(vllm_events, "_OffloadEventMetadata")


def _unexpected_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom() -> compat.Layout:
        raise RuntimeError("boom")

    monkeypatch.setattr(compat, "detect", boom)


@pytest.mark.parametrize(
    ("break_vllm", "says"),
    [
        (_drop_method, "record_partial_lookup is missing"),
        (_change_signature, "record_store"),
        (_move_module, "cannot import"),
        (_newer_vllm, "0.34.0 is not a verified version"),
        (_metadata_changed, "_OffloadEventMetadata is missing"),
        (_unexpected_error, "boom"),
    ],
    ids=[
        "method-missing",
        "signature-changed",
        "module-moved",
        "unverified-version",
        "metadata-gone",
        "unexpected-error",
    ],
)
def test_unknown_layout_warns_once_and_leaves_vllm_untouched(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, break_vllm, says: str
) -> None:
    break_vllm(monkeypatch)
    before = own_methods()
    with caplog.at_level(logging.DEBUG, logger="kv_bridge.plugin"):
        plugin.register()
        plugin.register()
    assert own_methods() == before
    assert not patch.is_patched()
    warnings = plugin_records(caplog, logging.WARNING)
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "NOT patching" in warnings[0].getMessage() and says in warnings[0].getMessage()
    assert not plugin_records(caplog, logging.INFO)


def _native_predicate(monkeypatch: pytest.MonkeyPatch) -> None:
    # What 0.34.0 ships: a module-level predicate that says yes for MambaSpec.
    monkeypatch.setattr(
        vllm_events,
        "describes_group",
        lambda group_config: isinstance(group_config.kv_cache_spec, MambaSpec),
        raising=False,
    )


def _native_behaviour(monkeypatch: pytest.MonkeyPatch) -> None:
    # No predicate, but the tracker keeps a payload for a Mamba chunk itself.
    def record_store(self, req, group_config, chunk_idx, offload_key):
        self._pending_event_metadata[offload_key] = object()

    monkeypatch.setattr(Tracker, "record_store", record_store)


@pytest.mark.parametrize(
    ("make_native", "says"),
    [(_native_predicate, "describes_group() is true"), (_native_behaviour, "keeps a payload")],
    ids=["predicate", "behaviour"],
)
def test_self_describing_vllm_is_left_alone_with_one_info_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, make_native, says: str
) -> None:
    make_native(monkeypatch)
    before = own_methods()
    with caplog.at_level(logging.DEBUG, logger="kv_bridge.plugin"):
        plugin.register()
        plugin.register()
    assert own_methods() == before and not patch.is_patched()
    records = [r for r in caplog.records if r.name == "kv_bridge.plugin"]
    assert [r.levelno for r in records] == [logging.INFO]
    assert "standing down" in records[0].getMessage() and says in records[0].getMessage()


def test_a_predicate_that_says_no_for_mamba_does_not_stand_down(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_events, "describes_group", lambda group_config: False, raising=False)
    plugin.register()
    assert patch.is_patched()


def test_native_support_is_not_fooled_by_our_own_patch() -> None:
    assert compat.native_support() is None
    plugin.register()
    assert patch.is_patched()
    assert compat.native_support() is None  # it probes vLLM's own record_store


def test_layout_on_0_33_wraps_all_four_methods() -> None:
    assert compat.detect().methods == patch.PATCHABLE_METHODS


def test_unverified_version_can_be_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    _newer_vllm(monkeypatch)
    monkeypatch.setenv(compat.ALLOW_UNVERIFIED_ENV, "1")
    plugin.register()
    assert patch.is_patched()


def test_entry_point_is_discoverable() -> None:
    found = [
        ep
        for ep in importlib.metadata.entry_points(group="vllm.general_plugins")
        if ep.name == "kv_bridge_mamba_events"
    ]
    assert found, "kv-bridge is not installed in this environment (pip install -e . --no-deps)"
    assert found[0].value == "bridge.plugin:register"
    assert found[0].load() is plugin.register


@pytest.mark.parametrize(
    ("allow", "expect_patched"),
    [("kv_bridge_mamba_events", True), ("some_other_plugin", False), (None, True)],
    ids=["allow-listed", "filtered-out", "all-plugins"],
)
def test_vllm_loader_runs_it(
    monkeypatch: pytest.MonkeyPatch, live_envs: None, allow: str | None, expect_patched: bool
) -> None:
    # vLLM loads general plugins once per process; pretend this is a new one.
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    if allow is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
        # The other plugins vLLM ships in this group only act when these are set.
        monkeypatch.delenv("VLLM_LORA_RESOLVER_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", allow)
    vllm.plugins.load_general_plugins()
    assert patch.is_patched() is expect_patched


def test_fresh_process_logs_through_vllms_handler() -> None:
    """In a real process the INFO line must reach vLLM's log, not vanish."""
    code = (
        # What vLLM's engine-core and worker processes do before loading plugins.
        "from vllm.config.logging import LoggingConfig\n"
        "from vllm.logger import configure_logging\n"
        "configure_logging(LoggingConfig())\n"
        "import vllm.plugins\n"
        "vllm.plugins.load_general_plugins()\n"
        "from bridge.plugin import patch\n"
        "print('PATCHED', patch.is_patched())\n"
    )
    env = {**os.environ, "VLLM_PLUGINS": "kv_bridge_mamba_events", "VLLM_LOGGING_LEVEL": "INFO"}
    env.pop("KVB_PLUGIN_DISABLE", None)
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=240
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "PATCHED True" in output
    lines = [line for line in output.splitlines() if "kv-bridge plugin: patched vLLM" in line]
    assert len(lines) == 1, output
    assert lines[0].lstrip("(").startswith("INFO") or " INFO " in lines[0], lines[
        0
    ]  # vLLM's format
