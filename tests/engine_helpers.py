"""What the engine's tests share: the tiny model's prompts and geometry, the reference tokens, a
cheap cost model and an operation clock (imported by tests/test_engine.py and
tests/test_compile_plan.py)."""

from __future__ import annotations

import numpy as np
import pytest

from specjax.engine.loop import EventClock
from specjax.engine.scheduler import Request
from specjax.goodput import LinearCost, StepCostModel
from specjax.reference_ar import reference_generate

ROWS = (1, 4)  # batch buckets: the live state grows 1 -> 4 and shrinks back
KS = (0, 2)
SLOTS = 256
MAX_NEW = 16


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        if i % 3 == 0:  # repetitive: prompt lookup has something to draft
            unit = list(rng.integers(1, 255, size=int(rng.integers(2, 5))))
            out.append((unit * 8)[:14])
        else:
            out.append(list(rng.integers(1, 255, size=int(rng.integers(3, 15)))))
    return out


PROMPTS = _prompts(10)


@pytest.fixture(scope="module")
def reference(tiny):
    cfg, params = tiny
    return [r.tokens for r in reference_generate(cfg, params, PROMPTS, max_new_tokens=MAX_NEW, batch_buckets=(1,))]


def _cheap_spec():
    # Verify tokens almost free: the goodput selector speculates.
    return StepCostModel(target=LinearCost(0.0, 1e-6, 1e-2), draft=LinearCost(0.0, 1e-6, 1e-4))


class OpClock(EventClock):
    """Simulated time that advances 1 ms per engine operation (a prefill pass or a step),
    whatever it measured: arrivals then interleave with steps the same way on any machine
    (on measured durations, a fast CPU finished each request before the next one arrived)."""

    def advance(self, dt: float) -> None:
        self.t += 0.001


def _reqs(arrival_gap, prompts=PROMPTS, **kw):
    return [Request(f"q{i}", p, MAX_NEW, arrival=i * arrival_gap, **kw) for i, p in enumerate(prompts)]


def _batch_of(key) -> int:
    """The batch bucket a StepTable key runs at (a row operation: the live state's)."""
    return key.batch if hasattr(key, "batch") else key[1]
