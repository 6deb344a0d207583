"""Cheap checks of the container image recipe. The build itself and its smoke
test are scripts/build-image.sh, which .ci/run runs beside the installs, before
the tests (docs/kubernetes.md)."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.chart.helmutil import INSTALL_HINT, REPO, tool

DOCKERFILE = REPO / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _runtime_stage() -> list[tuple[str, str]]:
    ins = _instructions()
    last_from = max(i for i, (word, _) in enumerate(ins) if word == "FROM")
    return ins[last_from:]


@pytest.mark.skipif(tool("hadolint") is None, reason=f"hadolint is not installed: {INSTALL_HINT}")
def test_hadolint_clean() -> None:
    hadolint = tool("hadolint")
    assert hadolint is not None
    cmd = [hadolint, "--no-color"]
    if (REPO / ".hadolint.yaml").exists():
        cmd += ["--config", str(REPO / ".hadolint.yaml")]
    proc = subprocess.run([*cmd, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_base_image_is_an_argument_defaulting_to_official_slim() -> None:
    ins = _instructions()
    first_from = next(i for i, (word, _) in enumerate(ins) if word == "FROM")
    assert ("ARG", "BASE_IMAGE=python:3.12-slim") in ins[:first_from]
    froms = [rest for word, rest in ins if word == "FROM"]
    assert len(froms) == 2, "multi-stage: build, runtime"
    assert all(f.startswith("${BASE_IMAGE}") for f in froms)


def test_wheels_are_built_in_the_first_stage_only() -> None:
    ins = _instructions()
    runtime = _runtime_stage()
    build = ins[: len(ins) - len(runtime)]
    assert any(word == "RUN" and "pip wheel" in rest for word, rest in build)
    assert not any("pip " in rest for word, rest in runtime if word == "RUN")
    assert ("COPY", "--from=build /opt/kv-bridge /opt/kv-bridge") in runtime


def test_nats_server_only_on_request() -> None:
    build_run = " ".join(rest for word, rest in _instructions() if word == "RUN")
    assert ("ARG", "WITH_NATS_SERVER=0") in _instructions()
    assert '"${WITH_NATS_SERVER}" = "1"' in build_run and "[embedded]" in build_run


def test_runtime_is_non_root_read_only_friendly() -> None:
    runtime = _runtime_stage()
    users = [rest for word, rest in runtime if word == "USER"]
    assert users == ["10001:10001"]
    env = " ".join(rest for word, rest in runtime if word == "ENV")
    for needed in ("PYTHONDONTWRITEBYTECODE=1", "HOME=/tmp", "TMPDIR=/tmp"):
        assert needed in env
    assert ("ENTRYPOINT", json.dumps(["kv-bridge"])) in runtime
    assert ("CMD", json.dumps(["run"])) in runtime
    assert ("EXPOSE", "9400") in runtime


def test_oci_labels() -> None:
    labels = " ".join(rest for word, rest in _runtime_stage() if word == "LABEL")
    for key in ("title", "description", "version", "revision", "created", "source", "licenses", "base.name"):
        assert f"org.opencontainers.image.{key}=" in labels, key


def test_dockerignore_is_an_allow_list() -> None:
    lines = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*"
    assert {"!pyproject.toml", "!setup.py", "!README.md", "!bridge/"} <= set(lines)
    assert "**/*.so" in lines  # the image compiles its own native module, not the host's
    copied = " ".join(rest for word, rest in _instructions() if word == "COPY" and "--from" not in rest)
    assert all(name in copied for name in ("pyproject.toml", "setup.py", "README.md", "bridge/"))


def test_the_build_stage_fails_without_the_native_module() -> None:
    """Built without a compiler, the package falls back to Python tables at
    twice the memory: the image build compiles it, and checks it did."""
    runtime = _runtime_stage()
    build = _instructions()[: len(_instructions()) - len(runtime)]
    build_run = " ".join(rest for word, rest in build if word == "RUN")
    assert "gcc" in build_run and "import bridge.residency._cells" in build_run
    assert not any("gcc" in rest for word, rest in runtime if word == "RUN")


@pytest.mark.parametrize("script", ["build-image.sh", "install-chart-tools.sh"])
def test_scripts_parse(script: str) -> None:
    path = REPO / "scripts" / script
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = path.read_text()
    assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text


def test_build_script_uses_vfs_and_chroot() -> None:
    text = (REPO / "scripts" / "build-image.sh").read_text()
    assert "--storage-driver vfs" in text
    assert "--isolation chroot" in text
    assert "debootstrap" in text and "buildah" in text
