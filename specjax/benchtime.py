"""The benchmark harness: timings of prefills, steps and serving runs with interleaved medians.

Every benchmark script and the SmartSpec profiler (``engine.profiling``) time through ``rounds``:
the variants being compared are called once each per round, in an order rotated by one every
round (or shuffled, given a generator), after warm-up rounds whose samples are dropped. On a
shared machine whose speed drifts over seconds, back-to-back medians put the drift on whichever
variant ran last; rotated rounds spread it over all of them, so their ratios stay meaningful.

Warm-up rule: one untimed round by default. A first call compiles (or loads) and touches fresh
buffers and cold code pages; timing it would charge whichever variant met it first.

A sample is a plain dict: ``{"s": the call's wall seconds}`` updated with whatever dict the
variant returns (its own measurements: an engine run's prefill seconds, a backend's device time),
so scripts print and dump results as rows without conversion. Nothing here needs jax except the
step/prefill builders, which import it when called.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Mapping


def rounds(variants: Mapping, reps: int, warmup: int = 1, shuffle=None, clock=time.perf_counter) -> dict:
    """{name: [sample, ...]} of ``reps`` timed rounds of ``variants`` ({name: fn}; ``fn()`` must
    block until its work is done and return None or a dict merged into its sample). Round r calls
    the variants rotated by r; ``shuffle`` (a numpy Generator) permutes them instead."""
    names = list(variants)
    out: dict = {n: [] for n in names}
    for r in range(warmup + reps):
        order = ([names[i] for i in shuffle.permutation(len(names))] if shuffle is not None
                 else names[r % len(names):] + names[:r % len(names)])
        for n in order:
            t = clock()
            extra = variants[n]()
            sample = {"s": clock() - t, **(extra or {})}
            if r >= warmup:
                out[n].append(sample)
    return out


def summarize(samples: list, stat: Callable = statistics.median) -> dict:
    """``stat`` (median by default) of every numeric key over a variant's samples: one row."""
    keys = [k for k, v in samples[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return {k: stat([s[k] for s in samples]) for k in keys}


def interleaved_medians(variants: Mapping, reps: int, warmup: int = 1, stat: Callable = statistics.median,
                        clock=time.perf_counter) -> dict:
    """{name: median wall seconds} (or ``stat``: ``min`` for best-of) of ``variants`` in rotated
    rounds; what the variants return is dropped (only their wall time is reported)."""
    walls = {n: _discarding(f) for n, f in variants.items()}
    return {n: stat([s["s"] for s in v]) for n, v in rounds(walls, reps, warmup, clock=clock).items()}


def _discarding(fn: Callable) -> Callable:
    def run():
        fn()
    return run


def median_seconds(fn: Callable, reps: int, warmup: int = 1, stat: Callable = statistics.median,
                   clock=time.perf_counter) -> float:
    """Median wall seconds of one function (``rounds`` of a single variant)."""
    return interleaved_medians({"": fn}, reps, warmup, stat, clock)[""]


def serve_sample(engine, requests) -> dict:
    """One ServingEngine run of ``requests`` as a sample: ``prefill_s`` (its prefills), ``step_s``
    (mean wall of its loop iterations: host bookkeeping included), ``steps`` and ``tokens`` (the
    outputs' token lists, to compare runs)."""
    outs = engine.run(requests)
    steps = engine.steps
    return {"prefill_s": engine.prefill_s, "step_s": sum(s.wall for s in steps) / max(len(steps), 1),
            "steps": len(steps), "tokens": [o.tokens for o in outs]}


def generate_sample(gen, prompt, max_new_tokens: int, **kw) -> dict:
    """One ``generate`` of one prompt (a Generator or SpecGenerator: the engine's serving path) as
    a sample: ``prefill_s``, ``decode_s``, ``decode_step_s`` (decode seconds per token after the
    first, which the prefill makes) and ``tokens``."""
    r = gen.generate([prompt], max_new_tokens=max_new_tokens, **kw)[0]
    return {"prefill_s": r.prefill_s, "decode_s": r.decode_s, "decode_step_s": r.decode_s / max(len(r.tokens) - 1, 1),
            "tokens": r.tokens}


def _greedy_samp(B: int):
    from specjax.sampling import SamplingArrays, SamplingParams

    return SamplingArrays.build([SamplingParams()], B)


def prefill_fn(table, B: int, n: int, S: int, rng) -> Callable:
    """A greedy chunked prefill (the engine's chunks, ``buckets.prefill_chunks``) of B random
    prompts of ``n`` tokens into fresh S-slot caches of ``table`` (an engine.table.StepTable),
    compiled here; each call runs it and returns the state."""
    import jax
    import numpy as np

    from specjax import buckets as bk

    samp = _greedy_samp(B)
    chunks = bk.prefill_chunks(n)
    prompt = rng.integers(0, table.cfg.vocab_size, (B, chunks[-1][0] + chunks[-1][1]), dtype=np.int32)
    calls = []
    for i, (start, C) in enumerate(chunks):
        exe = table.prefill(B, C, S, True, compile_if_missing=True, first=i == 0)
        nv = jax.device_put(np.full(B, min(C, n - start), np.int32))
        calls.append((exe, jax.device_put(prompt[:, start:start + C]), nv))

    def run():
        state = None
        for exe, toks, nv in calls:
            args = (table.params, table.dparams, toks, nv, samp)
            state = exe(*args) if state is None else exe(*args, state)
        jax.block_until_ready(state.pending)
        return state

    return run


def _held(state, lengths):
    """``state`` with its cache lengths set back (a new buffer: the step donated the old one)."""
    from specjax import cache as kv

    return type(state)(cache=kv.set_lengths(state.cache, lengths), dcache=state.dcache, prev=state.prev,
                       pending=state.pending)


def steady_step(table, B: int, K: int, ctx: int, S: int, rng, tree: bool = False) -> Callable:
    """A greedy K-draft chain step of ``table`` on B rows held at ``ctx`` committed tokens: each
    call runs the step and sets the lengths back, so every call costs the same (random drafts:
    acceptance does not change a verify's time). ``tree``: the tree step of K nodes instead (a
    device tree drafter drafts its own tree; otherwise K random siblings of the pending token)."""
    import jax
    import numpy as np

    samp = _greedy_samp(B)
    holder = [prefill_fn(table, B, ctx, S, rng)()]
    act = jax.device_put(np.ones(B, bool))
    lens = np.full(B, ctx, np.int32)
    if tree:
        exe = table.tree_step(B, K, S, True, compile_if_missing=True)
        inputs = (jax.device_put(rng.integers(0, table.cfg.vocab_size, (B, K + 1), dtype=np.int32)),
                  jax.device_put(np.zeros((B, K + 1), np.int32)),
                  jax.device_put(np.broadcast_to(np.arange(K + 1) > 0, (B, K + 1))), act, samp, None)
    else:
        exe = table.step(B, K, S, True, compile_if_missing=True)
        inputs = (jax.device_put(rng.integers(0, table.cfg.vocab_size, (B, max(K, 1)), dtype=np.int32)),
                  jax.device_put(np.full(B, K, np.int32)), act, samp, None, None)

    def run():
        st, o = exe(table.params, table.dparams, holder[0], *inputs)
        jax.block_until_ready(o.tokens)
        holder[0] = _held(st, jax.device_put(lens))

    return run


def steady_chunk(table, B: int, C: int, ctx: int, S: int, rng) -> Callable:
    """A greedy later prefill chunk of C tokens on B rows after ``ctx`` cached tokens, the lengths
    set back after each call (``steady_step``'s rule for prefill)."""
    import jax
    import numpy as np

    samp = _greedy_samp(B)
    holder = [prefill_fn(table, B, ctx, S, rng)()]
    exe = table.prefill(B, C, S, True, compile_if_missing=True, first=False)
    toks = jax.device_put(rng.integers(0, table.cfg.vocab_size, (B, C), dtype=np.int32))
    nv = jax.device_put(np.full(B, C, np.int32))
    lens = np.full(B, ctx, np.int32)

    def run():
        st = exe(table.params, table.dparams, toks, nv, samp, holder[0])
        jax.block_until_ready(st.pending)
        holder[0] = _held(st, jax.device_put(lens))

    return run


class LockStep:
    """Two threads that take turns, for comparing two serving runs under the same machine speed:
    each thread calls ``turn(i)`` between its units of work (a serving engine's iterations) and
    returns from it when its partner has done one unit, so the two runs alternate every few
    hundred milliseconds and a drift of the machine's speed lands on both alike, where runs one
    after the other (minutes apart) differ here by up to 8%. Neither thread starts before both
    have called ``turn`` once (what comes before, a compilation, overlaps). ``waited[i]``: the
    seconds thread i spent in ``turn`` (to subtract from its wall time). ``finish(i)`` once a
    thread has no more work: its partner then runs on alone."""

    def __init__(self, clock=time.perf_counter):
        import threading

        self._cv = threading.Condition()
        self._clock = clock
        self._turn = 0
        self._started = [False, False]
        self._done = [False, False]
        self.waited = [0.0, 0.0]

    def turn(self, i: int) -> None:
        t0 = self._clock()
        with self._cv:
            if self._started[i]:
                self._turn = 1 - i  # hand over: one unit done
            self._started[i] = True
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._done[1 - i] or (all(self._started) and self._turn == i))
        self.waited[i] += self._clock() - t0

    def finish(self, i: int) -> None:
        with self._cv:
            self._done[i] = True
            self._turn = 1 - i
            self._cv.notify_all()
