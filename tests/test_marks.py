"""The fast loop's selection: tests that start a process are marked `process`
at collection from their code, not by hand, and `-m "not process"` leaves
them out; the `fast` Hypothesis profile caps a test's own example count."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tests.conftest as conftest
from tests import test_bench_children, test_config, test_service_process
from tests.conftest import FAST_EXAMPLES, _cap_examples
from tests.marks import ProcessReader

ROOT = Path(__file__).parent.parent


def test_the_reader_follows_helpers_to_the_process_they_start() -> None:
    reader = ProcessReader()
    # a fixture that starts nats-server through NatsServerProcess, a class of bridge.runtime
    assert reader.starts(conftest.nats_server)
    # a test that starts `kv-bridge run` through subprocess, and one that reaches it through a fixture
    assert reader.starts(test_service_process.test_invalid_configuration_names_the_option)
    assert reader.starts(test_service_process.test_readyz_waits_for_nats_and_healthz_does_not)
    # a test that starts a process through the benchmark's own helper (bench.run.Child)
    assert reader.starts(test_bench_children.test_a_child_leads_a_session_of_its_own)
    # a test of pure configuration parsing
    assert not reader.starts(test_config.test_flag_wins_over_environment_and_env_lists_split_on_commas)


def test_an_in_process_test_is_not_marked(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("process") is None


def test_the_fast_selection_leaves_process_tests_out() -> None:
    """Collection in a child pytest (so this test is itself process-level)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    files = ["tests/test_service_process.py", "tests/test_config.py"]

    def collected(*marks: str) -> set[str]:
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                              *marks, *files], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stdout + out.stderr
        return {line.split("::")[0] for line in out.stdout.splitlines() if "::" in line}

    assert collected("-m", "not process") == {"tests/test_config.py"}
    assert collected("-m", "process") == {"tests/test_service_process.py"}


def test_the_fast_profile_caps_a_tests_own_example_count() -> None:
    seen: list[int] = []

    @settings(max_examples=500, database=None)
    @given(st.integers())
    def many(x: int) -> None:
        seen.append(x)

    _cap_examples(SimpleNamespace(obj=many, cls=None))  # type: ignore[arg-type]
    many()
    assert 0 < len(seen) <= FAST_EXAMPLES
