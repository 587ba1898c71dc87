"""Timing helpers shared by the benchmark scripts."""

from __future__ import annotations

import time


def median_seconds(fn, reps: int) -> float:
    """Median wall seconds of ``fn()`` (which must block until its work is done) over ``reps``
    calls, after one untimed warm-up call."""
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2]
