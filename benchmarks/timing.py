"""Timing shared by the benchmarks."""

from __future__ import annotations

import statistics
import time


def median_seconds(fn, n: int, warmup: int = 2) -> float:
    """Median seconds per call after `warmup` calls: on a small shared machine the mean
    follows stray stalls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
