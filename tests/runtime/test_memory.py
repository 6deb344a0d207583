"""Free memory goes back to the system when asked (glibc's malloc_trim)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bridge.runtime.memory import MemoryReturn

# A burst's worth of payload-sized buffers freed in the middle of the heap:
# objects over 512 bytes that outlive them sit after them, as the keeper's
# index leaves the heap after applying a burst.
BURST = r"""
import os
from bridge.runtime.memory import MemoryReturn
def rss(): return int(open("/proc/self/statm").read().split()[1]) * 4096
keep, log = [], []
for i in range(12000):
    log.append(os.urandom(4000 + (i % 7) * 700))
    if i % 50 == 0:
        keep.append(bytearray(1000))
full = rss()
log.clear()
freed = rss()
given = MemoryReturn().give_back()
print(full, freed, rss(), given)
"""


def test_a_freed_burst_leaves_the_process_only_once_given_back() -> None:
    if not MemoryReturn().available:
        pytest.skip("this C library has no malloc_trim")
    out = subprocess.run([sys.executable, "-c", BURST], capture_output=True, text=True, check=True)
    full, freed, after, given = out.stdout.split()
    assert given == "True"
    assert int(full) - int(after) > 40 * 2**20  # about 70 MiB of buffers left the process ...
    assert int(freed) > int(after) + 40 * 2**20  # ... when given back, not when freed


def test_without_malloc_trim_giving_back_does_nothing() -> None:
    memory = MemoryReturn(None, probe=False)
    assert not memory.available and memory.give_back() is False
