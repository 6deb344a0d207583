"""Fixtures for the vLLM plugin tests: hash mode, and a clean tracker class per
test. The cross-release runs start as soon as the session has collected
their tests."""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import vllm.envs as vllm_envs  # noqa: E402

import bridge.plugin as plugin  # noqa: E402
from bridge.plugin import patch  # noqa: E402
from bridge.plugin.log import LOGGER_NAME  # noqa: E402
from tests.plugin.releases import EARLY_NICE, EARLY_RUNS, launch_all, missing_releases  # noqa: E402

INT_HASHES_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"
HERE = Path(__file__).parent


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the cross-release runs (tests/plugin/test_releases.py's `runs`)
    when the session will use them. Each imports torch and a vLLM: together
    two to three minutes of CPU that their first test would otherwise wait for.
    pytest runs its tests on one core, so at a lower priority the runs take
    what the tests before theirs leave idle, and are done when theirs come."""
    if session.config.option.collectonly:
        return
    if not any(item.path.parent == HERE and "runs" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    if missing_releases():
        return  # the fixture says so, as a skip or (in CI) a failure
    tmp = Path(tempfile.mkdtemp(prefix="kvb-releases-"))
    session.config.stash[EARLY_RUNS] = (tmp, launch_all(tmp, nice=EARLY_NICE))


def pytest_sessionfinish(session: pytest.Session) -> None:
    early = session.config.stash.get(EARLY_RUNS, None)
    if early is None:
        return
    tmp, launched = early
    for run in launched.values():
        if run.process.poll() is None:
            run.process.kill()
            run.process.wait()
    shutil.rmtree(tmp, ignore_errors=True)


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
