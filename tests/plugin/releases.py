"""The vLLM installs the cross-release tests run in, and running the scenario in them.

The release in .venv (requirements/vllm.txt) runs as it is; every other one
(requirements/vllm-releases.txt) from its own folder under .venv/releases,
which `make vllm-releases` fills and which goes first on PYTHONPATH, so the
process imports that release's vLLM over .venv's (and the same torch and
small dependencies). All of them start at once: each is a process of its own.
The session starts them as soon as it has collected their tests
(tests/plugin/conftest.py), at a lower priority, so they run on the CPU the
tests before them leave idle.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV_PIN = REPO / "requirements" / "vllm.txt"
RELEASE_PINS = REPO / "requirements" / "vllm-releases.txt"
RELEASES_DIR = REPO / ".venv" / "releases"
TIMEOUT_S = 400
ORACLE = "0.34.0"
REFUSED = "0.26.0"
# the priority of runs the session starts before their tests (tests/plugin/conftest.py)
EARLY_NICE = 10


def _pins(path: Path) -> list[str]:
    return re.findall(r"^vllm==(\S+)\s*$", path.read_text(encoding="utf-8"), flags=re.M)


def venv_version() -> str:
    (version,) = _pins(VENV_PIN)
    return version


def pinned_releases() -> list[str]:
    """The releases of requirements/vllm-releases.txt, in file order."""
    return _pins(RELEASE_PINS)


def release_dir(version: str) -> Path | None:
    """Where `make vllm-releases` put a release; None for .venv's own."""
    return None if version == venv_version() else RELEASES_DIR / version


def missing_releases() -> list[str]:
    return [v for v in pinned_releases() if not (RELEASES_DIR / v / "vllm").is_dir()]


@dataclass
class Launched:
    version: str
    out: Path
    process: subprocess.Popen[bytes]
    log: Path


def _env(version: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVB_", "VLLM_"))}
    # Releases before 0.29 seed their block hasher from it, at random without it.
    env["PYTHONHASHSEED"] = "0"
    folder = release_dir(version)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder) if folder else "", str(REPO)) if p)
    return env


def launch(version: str, out: Path, *args: str, module: str = "tests.plugin.scenario", nice: int = 0) -> Launched:
    """Start `python -m <module> OUT <args>` on one release, its output to OUT.log
    (a file, not a pipe: a run started long before it is collected never waits
    on a full pipe). `nice` lowers its priority, for runs started early."""
    log = out.with_suffix(".log")
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", module, str(out), *args],
            cwd=REPO,
            env=_env(version),
            stdout=sink,
            stderr=subprocess.STDOUT,
            preexec_fn=(lambda: os.nice(nice)) if nice else None,
        )
    return Launched(version=version, out=out, process=process, log=log)


def collect(launched: Launched) -> dict[str, Any]:
    """Wait for one run; its JSON, or an error naming the release and its output."""
    launched.process.wait(timeout=TIMEOUT_S)
    if launched.process.returncode != 0 or not launched.out.exists():
        output = launched.log.read_text(encoding="utf-8", errors="replace")
        raise RuntimeError(
            f"vLLM {launched.version}: exit {launched.process.returncode}\n{output[-6000:]}"
        )
    result: dict[str, Any] = json.loads(launched.out.read_text(encoding="utf-8"))
    if result["vllm_version"] != launched.version:
        raise RuntimeError(f"asked for vLLM {launched.version}, the process imported {result['vllm_version']}")
    return result


def patched_versions() -> list[str]:
    """The releases the plugin patches: .venv's and the pinned ones but the oracle and the refused."""
    return [venv_version(), *(v for v in pinned_releases() if v not in (ORACLE, REFUSED))]


def launch_all(tmp: Path, nice: int = 0) -> dict[str, Launched]:
    """Every release's run, all started at once (collected on first use)."""
    runs = {v: launch(v, tmp / f"scenario-{v}.json", "--register", nice=nice) for v in (*patched_versions(), ORACLE)}
    runs["refused"] = launch(REFUSED, tmp / "load.json", module="tests.plugin.load", nice=nice)
    return runs


# The runs the session started early, with their folder.
EARLY_RUNS = pytest.StashKey[tuple[Path, dict[str, Launched]]]()
