"""Small measuring helpers: weighted latency percentiles, /proc CPU and RSS."""

from __future__ import annotations

import os
import resource
import statistics
from collections.abc import Sequence
from typing import Any

_CLK_TCK = os.sysconf("SC_CLK_TCK")


class LatencyLog:
    """Latency samples, each weighing as many events as it carried."""

    def __init__(self) -> None:
        self.values: list[float] = []
        self.weights: list[int] = []

    def add(self, latency_s: float, weight: int = 1) -> None:
        self.values.append(latency_s)
        self.weights.append(weight)

    def summary(self) -> dict[str, Any] | None:
        if not self.values:
            return None
        pairs = sorted(zip(self.values, self.weights))
        total = sum(self.weights)

        def pct(q: float) -> float:
            rank = q * total
            acc = 0
            for value, weight in pairs:
                acc += weight
                if acc >= rank:
                    return value
            return pairs[-1][0]

        mean = sum(v * w for v, w in pairs) / total
        return {
            "p50_ms": round(pct(0.50) * 1e3, 3),
            "p99_ms": round(pct(0.99) * 1e3, 3),
            "max_ms": round(pairs[-1][0] * 1e3, 3),
            "mean_ms": round(mean * 1e3, 3),
            "events": total,
            "messages": len(pairs),
        }


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all its threads, from /proc."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    # The command name may hold spaces; fields resume after its closing parenthesis.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def memory_mb(pid: int) -> dict[str, float]:
    """Current (VmRSS) and peak (VmHWM) resident set of a process, MiB."""
    out: dict[str, float] = {}
    with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":", 1)
                out["rss_mb" if key == "VmRSS" else "peak_rss_mb"] = round(int(value.split()[0]) / 1024, 1)
    return out


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def reset_peak_rss(pid: int) -> bool:
    """Restart VmHWM from the current RSS (Linux: clear_refs 5), so a peak can
    be read per phase. False where the kernel or permissions do not allow it."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def median(values: Sequence[float | None]) -> float | None:
    """The median of the values given (None: not measured), None when none is."""
    clean = [v for v in values if v is not None]
    return statistics.median(clean) if clean else None
