"""The vLLM installs the cross-release tests run in, and running the scenario in them.

The release in .venv (requirements/vllm.txt) runs as it is; every other one
(requirements/vllm-releases.txt) from its own folder under .venv/releases,
which `make vllm-releases` fills and which goes first on PYTHONPATH, so the
process imports that release's vLLM over .venv's (and the same torch and
small dependencies). All of them start at once: each is a process of its own.
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

REPO = Path(__file__).resolve().parents[2]
VENV_PIN = REPO / "requirements" / "vllm.txt"
RELEASE_PINS = REPO / "requirements" / "vllm-releases.txt"
RELEASES_DIR = REPO / ".venv" / "releases"
TIMEOUT_S = 400


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
    process: subprocess.Popen[str]


def _env(version: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVB_", "VLLM_"))}
    # Releases before 0.29 seed their block hasher from it, at random without it.
    env["PYTHONHASHSEED"] = "0"
    folder = release_dir(version)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder) if folder else "", str(REPO)) if p)
    return env


def launch(version: str, out: Path, *args: str, module: str = "tests.plugin.scenario") -> Launched:
    """Start `python -m <module> OUT <args>` on one release."""
    process = subprocess.Popen(
        [sys.executable, "-m", module, str(out), *args],
        cwd=REPO,
        env=_env(version),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return Launched(version=version, out=out, process=process)


def collect(launched: Launched) -> dict[str, Any]:
    """Wait for one run; its JSON, or an error naming the release and its output."""
    output, _ = launched.process.communicate(timeout=TIMEOUT_S)
    if launched.process.returncode != 0 or not launched.out.exists():
        raise RuntimeError(
            f"vLLM {launched.version}: exit {launched.process.returncode}\n{output[-6000:]}"
        )
    result: dict[str, Any] = json.loads(launched.out.read_text(encoding="utf-8"))
    if result["vllm_version"] != launched.version:
        raise RuntimeError(f"asked for vLLM {launched.version}, the process imported {result['vllm_version']}")
    return result
