"""What machine a benchmark ran on, for the header every result carries."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (Linux), else whatever platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def interpreter_ns_per_step(steps: int = 2_000_000, repeat: int = 5) -> float:
    """Nanoseconds per step of a plain Python loop (``for i in range(n): s += i``), the best
    of ``repeat``: how fast this machine runs CPython. The CPU's name does not say it (one
    "AMD EPYC" VM is not the next), and decision costs are pure Python, so they are quoted
    beside it to be compared across machines."""
    import time

    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        s = 0
        for i in range(steps):
            s += i
        best = min(best, (time.perf_counter_ns() - t0) / steps)
    return best
