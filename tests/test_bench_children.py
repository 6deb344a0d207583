"""`bench.run`'s measured processes: each in a session of its own, so that
stopping the others (`alone`, SIGSTOP) while whatever started the bench
exits cannot make the kernel hang them all up (SIGHUP to a process group
left without its parent that holds a stopped process)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from bench.run import Child


@pytest.mark.anyio
async def test_a_child_leads_a_session_of_its_own(tmp_path: Path) -> None:
    child = Child("probe", [sys.executable, "-c", "import os; print(os.getsid(0), os.getpgid(0), os.getpid())"],
                  tmp_path, json_io=False)
    await child.start()
    assert child.proc is not None
    assert await child.proc.wait() == 0
    sid, pgid, pid = map(int, (tmp_path / "probe.log").read_text().split())
    assert sid == pgid == pid
    assert sid != os.getsid(0)
