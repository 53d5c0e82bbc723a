"""A loaded host for the benchmarks: ``--busy N`` runs N CPU-bound processes (a Python
busy loop each) beside the workers for the whole run, as a production host's neighbours
keep its cores busy. The measurements in BENCHMARKS.md marked "loaded" use 2 (this
machine has 2 cores)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

BUSY_LOOP = "while True: pass"


@contextmanager
def busy(processes: int) -> Iterator[None]:
    """``processes`` busy loops for the duration of the block (none for 0)."""
    loops = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(processes)]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def percentiles(values: list[float]) -> tuple[float, float, float]:
    """Median, p99 and most of ``values`` (not empty)."""
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return ordered[len(ordered) // 2], p99, ordered[-1]
