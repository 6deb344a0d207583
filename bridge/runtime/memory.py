"""Giving free memory back to the operating system.

A Python process that frees a burst's worth of buffers keeps the memory: the
C allocator (glibc's malloc, which takes every object over 512 bytes) gives
back to the system only the free memory at the top of its heap, and whatever
the process allocates last (a residency index growing as it applies the
burst) pins that top. glibc's `malloc_trim` gives back every free page. Other
C libraries (musl) have no such call: there it does nothing.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


class MemoryReturn:
    """`give_back()` returns the allocator's free pages to the system; where
    the C library offers no way to (`available` is False), it does nothing."""

    def __init__(self, trim: Callable[[int], int] | None = None, *, probe: bool = True) -> None:
        self._trim = trim if trim is not None or not probe else _malloc_trim()

    @property
    def available(self) -> bool:
        return self._trim is not None

    def give_back(self) -> bool:
        """Best called from a worker thread: ctypes lets the GIL go for the
        call, so the loop goes on, but the allocator is locked meanwhile (a
        few hundred MiB of free heap take some milliseconds), and the loop's
        own allocations over 512 bytes wait for it."""
        if self._trim is None:
            return False
        self._trim(0)
        return True
