"""The docs site builds without a warning, and the README stays a short page whose links all resolve."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MKDOCS = Path(sys.executable).parent / "mkdocs"

# [text](target) and [text](target "title"); images too.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def test_mkdocs_builds_strictly_without_warnings(tmp_path: Path) -> None:
    if not MKDOCS.exists():
        pytest.fail(f"{MKDOCS} is missing: install requirements/ci.txt")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [str(MKDOCS), "build", "--strict", "--clean", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env, check=False,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    warnings = [line for line in output.splitlines() if re.match(r"\s*(WARNING|ERROR)\b", line)]
    assert not warnings, "\n".join(warnings)
    assert (tmp_path / "site" / "index.html").exists()


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; the manual belongs in docs/"


def _local_targets(text: str) -> list[str]:
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks hold no links
    targets = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # a URL (http:, mailto:, ...) or an anchor on the same page
        targets.append(target.split("#", 1)[0])
    return targets


def test_readme_links_only_to_files_that_exist() -> None:
    targets = _local_targets(README.read_text(encoding="utf-8"))
    assert targets, "the README should point into docs/"
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_the_link_check_sees_a_missing_file() -> None:
    assert _local_targets("[a](docs/nope.md#x) [b](https://example.com) [c](#top)\n```\n[d](e.md)\n```") == ["docs/nope.md"]
