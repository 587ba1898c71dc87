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


def interleaved_medians(fns: dict, reps: int) -> dict:
    """Median wall seconds of each ``fns[name]()`` over ``reps`` rounds that call every function
    once in turn (after one untimed warm-up round). On a shared machine whose speed drifts over
    seconds, ratios between the functions stay meaningful where back-to-back medians do not."""
    for fn in fns.values():
        fn()
    ts = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            ts[name].append(time.perf_counter() - t)
    return {name: sorted(v)[len(v) // 2] for name, v in ts.items()}
