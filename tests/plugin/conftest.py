"""Fixtures for the vLLM plugin tests: hash mode, and a clean tracker class per test."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")

import vllm.envs as vllm_envs  # noqa: E402

import bridge.plugin as plugin  # noqa: E402
from bridge.plugin import patch  # noqa: E402
from bridge.plugin.log import LOGGER_NAME  # noqa: E402

INT_HASHES_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"


@pytest.fixture
def live_envs(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Make vllm.envs read os.environ on every access for this test.

    vLLM caches every env var after engine start-up (enable_envs_cache);
    a test that changes one must see the change.
    """
    was_cached = vllm_envs._is_envs_cache_enabled()
    if was_cached:
        vllm_envs.disable_envs_cache()
    yield
    if was_cached:
        vllm_envs.enable_envs_cache()


@pytest.fixture(params=["bytes", "int"])
def hash_mode(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, live_envs: None
) -> str:
    """Both forms vLLM can publish hashes in (its default in 0.33.0 is int)."""
    monkeypatch.setenv(INT_HASHES_ENV, "1" if request.param == "int" else "0")
    assert vllm_envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES is (request.param == "int")
    return str(request.param)


@pytest.fixture
def bytes_hashes(monkeypatch: pytest.MonkeyPatch, live_envs: None) -> None:
    monkeypatch.setenv(INT_HASHES_ENV, "0")


@pytest.fixture(autouse=True)
def pristine_tracker(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts and ends with vLLM's own tracker and fresh warn-once flags."""
    patch.unpatch()
    monkeypatch.setattr(plugin, "_unsupported_warned", False)
    monkeypatch.setattr(plugin, "_stood_down", False)
    monkeypatch.setattr(patch, "_fallback_warned", False)
    monkeypatch.delenv(plugin.KILL_SWITCH_ENV, raising=False)
    # caplog listens on the root logger; keep ours propagating to it.
    logger = logging.getLogger(LOGGER_NAME)
    monkeypatch.setattr(logger, "propagate", True)
    monkeypatch.setattr(logger, "handlers", [])
    yield
    patch.unpatch()
