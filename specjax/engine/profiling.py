"""Profiling the real backend for the SmartSpec performance model (seed 000 §4.3).

``profile_steps`` drives a ``JaxBackend`` directly: B requests with prompts of length c are
prefilled, then every compiled K runs ``reps`` steps with a drafter that always proposes
exactly K tokens (so the block is K + 1 wide; acceptance does not change the time of a
verify). ``profile_prefills`` times prefill + row insert per (batch, prompt bucket).
``profile_call_overhead`` times what a device call costs beyond its steps (a step of a
decode call pays a share of it). ``fit_profile`` fits Eq. 7 for the target (host-draft records) and the draft model (device-draft
records, jointly with the target), holding out a random share of the (B, c, K) cells to report
R^2 on points the fit never saw. ``profile_row_ops`` times the cache allocations, resizes and
clears of continuous batching. ``calibrate_host`` fits the loop's own per-step and per-request
overhead from a real engine run, again scoring on held-out steps. ``probe_speed`` re-times a few
steps against a profile to measure how far the machine has drifted since. Steps and prefills
are timed in the benchmark harness's rounds (``specjax.benchtime``).
"""

from __future__ import annotations

import collections
import dataclasses
import re
import time
from typing import Sequence

import numpy as np

from specjax import benchtime, buckets as bk
from specjax.engine.scheduler import Request, Scheduler
from specjax.goodput.perf_model import (LinearCost, StepCostModel, fit_linear, fit_step_model, least_squares,
                                        median_cells,
                                        r_squared)


class FixedLengthDrafter:
    """Host drafter for profiling: always proposes k tokens (the last token repeated)."""

    def __init__(self):
        self._last: dict = {}

    def start(self, row, tokens):
        self._last[row] = int(tokens[-1])

    def extend(self, row, tokens):
        if len(tokens):
            self._last[row] = int(tokens[-1])

    def propose(self, row, k):
        return np.full(k, self._last[row], np.int32)

    def finish(self, row):
        self._last.pop(row, None)


def _running(backend, B: int, c: int, vocab: int, rng) -> list:
    sched = Scheduler(backend.num_rows, backend.slots, backend.k_max + 1)
    return [sched.start(Request(f"p{i}", list(rng.integers(1, vocab, size=c)), 1), True, 0.0) for i in range(B)]


def profile_steps(backend, batch_sizes: Sequence[int], contexts: Sequence[int], ks: Sequence[int], reps: int = 4,
                  seed: int = 0, progress=None) -> list[dict]:
    """Records {B, K, ctx_lens, t} of real backend steps (the first round of each cell is dropped).
    The K values of a cell run in rounds (benchtime.rounds) in a fresh random order each: a slow
    drift of this machine's speed then lands on every K of the cell alike instead of on the last K."""
    rng = np.random.default_rng(seed)
    recs = []
    for B in batch_sizes:
        for c in contexts:
            backend.reset()
            rs = _running(backend, B, c, backend.cfg.vocab_size, rng)
            backend.prefill(rs)

            def step(K, c=c, B=B, rs=rs):
                def run():
                    backend.propose(rs, K)
                    ctx = [r.ctx_len for r in rs]
                    res, t = backend.step(rs, K)
                    for r, x in zip(rs, res):
                        r.ctx_len += len(x.tokens)
                    return {"B": backend.bucket(B), "n": B, "K": backend.last_k_step, "c": c, "ctx_lens": ctx, "t": t}
                return run

            samples = benchtime.rounds({int(K): step(int(K)) for K in ks}, reps, shuffle=rng)
            recs += [_record(s) for per_k in samples.values() for s in per_k]
            if progress:
                progress(len(ks))
            for r in rs:
                backend.release(r)
    return recs


def profile_call_overhead(backend, context: int = 32, reps: int = 5, seed: int = 0) -> float:
    """``StepCostModel.call_s`` of ``backend``: what one device call costs beyond its steps, from
    K = 0 at batch 1, n = ``decode_steps`` steps alone against one call of n, in turn: per
    round (alone - in call) per step x n / (n - 1), the median over ``reps`` rounds (the first
    dropped); 0 for a backend without decode calls. Leaves the backend reset."""
    n = getattr(backend, "decode_steps", 1)
    if n <= 1:
        return 0.0
    backend.reset()
    (r,) = _running(backend, 1, context, backend.cfg.vocab_size, np.random.default_rng(seed))
    backend.prefill([r])
    out = []
    for i in range(reps + 1):
        alone = 0.0
        for _ in range(n):
            backend.propose([r], 0)
            _, t = backend.step([r], 0)
            alone += t
        res, t = backend.decode([r], n, [n], [False], frozenset(), False, 0)
        if i:
            out.append((alone / n - t / len(res[0])) * n / (n - 1))
    backend.release(r)
    backend.reset()
    return max(float(np.median(out)), 0.0)


def _record(sample: dict) -> dict:
    """A profile record: the backend's own device time ``t``, not the harness's wall ``s``."""
    return {k: v for k, v in sample.items() if k != "s"}


def probe_speed(backend, cost, context: int = 32, reps: int = 3, seed: int = 0) -> dict[int, float]:
    """This machine's speed now relative to the profile behind ``cost`` (a ``ProfiledCost``):
    per batch bucket, the median of measured / profiled K = 0 step time over ``reps`` steps at
    ``context`` tokens. About a second on SmolLM2; leaves the backend reset. This shared machine
    ran 0.9-1.6x the profiled step time within an hour of a profile, which the profile cannot know."""
    recs = profile_steps(backend, backend.batch_buckets, [context], [0], reps, seed)
    backend.reset()
    ratios: dict[int, list] = {}
    for r in recs:
        ratios.setdefault(int(r["B"]), []).append(r["t"] / cost.device_time(r["B"], 0, r["ctx_lens"]))
    return {b: float(np.median(x)) for b, x in sorted(ratios.items())}


def profile_prefills(backend, batch_sizes: Sequence[int], prompt_lens: Sequence[int], reps: int = 3,
                     seed: int = 0) -> list[dict]:
    """Records {B, Tp, t} of prefill + row insert; the prompt lengths of a batch size in rounds
    (benchtime.rounds, the first dropped)."""
    rng = np.random.default_rng(seed)
    recs = []
    for B in batch_sizes:
        def prefill(c, B=B):
            def run():
                backend.reset()
                backend.reserve(B)  # serving prefills into a live state; its allocation is a row op
                _, t = backend.prefill(_running(backend, B, c, backend.cfg.vocab_size, rng))
                return {"B": backend.bucket(B), "Tp": bk.prefill_tokens(c, backend.max_chunk), "t": t}
            return run

        samples = benchtime.rounds({int(c): prefill(int(c)) for c in prompt_lens}, reps, shuffle=rng)
        recs += [_record(s) for per_c in samples.values() for s in per_c]
    backend.reset()
    return recs


def profile_row_ops(backend, reps: int = 3) -> list[dict]:
    """Records {op, a, b, t} of the cache row operations continuous batching triggers, which
    the step and prefill grids do not contain: allocating a [b] state (op 'alloc', a = 0),
    regathering a [a] state into [b] (op 'take': a fresh buffer, so its page faults count) and
    zeroing freed rows' lengths (op 'clear', a = b). The first round only warms."""
    bbs = backend.batch_buckets
    recs = []
    for rep in range(reps + 1):
        for B in bbs:
            backend.reset()
            t0 = time.perf_counter()
            backend.reserve(B)
            t_alloc = time.perf_counter() - t0
            t0 = time.perf_counter()
            backend.clear_state_rows([0])
            t_clear = time.perf_counter() - t0
            if rep:
                recs += [{"op": "alloc", "a": 0, "b": B, "t": t_alloc}, {"op": "clear", "a": B, "b": B, "t": t_clear}]
            for B2 in bbs:
                if B2 == B:
                    continue
                backend.reset()
                backend.reserve(B)
                t0 = time.perf_counter()
                backend.resize_state(B2)
                if rep:
                    recs.append({"op": "take", "a": B, "b": B2, "t": time.perf_counter() - t0})
    backend.reset()
    return recs


def row_op_cells(recs: Sequence[dict]) -> tuple[tuple[str, int, int, float], ...]:
    """Median time per (op, a, b) of ``profile_row_ops`` records."""
    return median_cells(recs, lambda r: (r["op"], int(r["a"]), int(r["b"])))


def _cells(recs):
    return sorted({(r["B"], r["c"], r["K"], r.get("draft", False)) for r in recs})


def fit_profile(target_recs: list[dict], draft_recs: list[dict], prefill_recs: list[dict], base: StepCostModel,
                holdout: float = 0.25, seed: int = 0) -> tuple[StepCostModel, dict]:
    """Fit the step model on (1 - holdout) of the cells, report R^2 and errors on the rest, then
    refit on everything. Returns (model, report)."""
    recs = [dict(r, draft=False) for r in target_recs] + [dict(r, draft=True) for r in draft_recs]
    cells = _cells(recs)
    rng = np.random.default_rng(seed)
    test_cells = set(map(tuple, [cells[i] for i in rng.permutation(len(cells))[: max(1, int(holdout * len(cells)))]]))

    def design(rs):
        X = np.stack([base.step_features(r["B"], r["K"], r["ctx_lens"], r["draft"]) for r in rs])
        return X, np.array([r["t"] for r in rs])

    train = [r for r in recs if (r["B"], r["c"], r["K"], r["draft"]) not in test_cells]
    test = [r for r in recs if (r["B"], r["c"], r["K"], r["draft"]) in test_cells]
    Xtr, ytr = design(train)
    m_train = fit_step_model(Xtr, ytr, base)
    Xte, yte = design(test)
    c_train = _coef(m_train)
    pred = Xte @ c_train
    # Per cell: the median measured step against the mean prediction. A single step carries this
    # machine's step-to-step jitter, which no cost model can predict; the median is what a
    # model of the *expected* step time should match.
    keys = [(r["B"], r["c"], r["K"], r["draft"]) for r in test]
    med = {k: (np.median([y for y, kk in zip(yte, keys) if kk == k]), np.mean([p for p, kk in zip(pred, keys) if kk == k]))
           for k in set(keys)}
    ym, pm = np.array([v[0] for v in med.values()]), np.array([v[1] for v in med.values()])
    report = {"held_out_cells": len(test_cells), "cells": len(cells), "held_out_steps": len(test),
              "r2_held_out": r_squared(yte, pred),
              "mean_abs_rel_err_held_out": float(np.mean(np.abs(pred - yte) / yte)),
              "r2_held_out_cell_medians": r_squared(ym, pm),
              "mean_abs_rel_err_held_out_cell_medians": float(np.mean(np.abs(pm - ym) / ym))}
    Xall, yall = design(recs)
    model = fit_step_model(Xall, yall, base)
    report["r2_all"] = r_squared(yall, Xall @ _coef(model))
    if prefill_recs:
        n_tok = [r["B"] * r["Tp"] for r in prefill_recs]
        pre = fit_linear(np.zeros(len(n_tok)), n_tok, [r["t"] for r in prefill_recs])
        model = dataclasses.replace(model, prefill=pre)
        report["prefill_r2"] = r_squared(np.array([r["t"] for r in prefill_recs]),
                                         np.array([pre(0, n) for n in n_tok]))
    return model, report


def _coef(m: StepCostModel) -> np.ndarray:
    d = m.draft or LinearCost()
    return np.array([m.target.alpha, m.target.gamma, m.target.delta, d.alpha, d.gamma, d.delta])


def calibrate_host(steps: Sequence, cost, seed: int = 0):
    """Fit the loop's own overhead, host_step + host_row * n, to the part of each real engine
    step (``engine.loop.StepRecord``) spent outside the backend call: wall - elapsed (proposing,
    choosing K, emitting, bookkeeping). The backend call itself, forward pass, cache row
    operations and all, is what the profiled table and ``row_op_time`` model.

    An earlier version fitted wall minus the *modelled* backend time: any drift of this shared
    machine between the profile and the calibration run (up to 20% here) then landed in the host
    terms (8-15 ms per step, against 0.1-0.5 ms measured outside the backend), and the simulator
    over-charged every step. Reports the whole-step prediction (modelled backend + host) on the
    held-out half too, which shows that drift. ``cost``: a ``StepCostModel`` or a
    ``ProfiledCost``; returns it with the host terms set."""
    steps = list(steps)
    if len(steps) < 8:
        return cost, {"calibration_steps": len(steps)}
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(steps))
    half = len(steps) // 2
    fit_idx, test_idx = perm[:half], perm[half:]
    wall = np.array([s.wall for s in steps])
    host = wall - np.array([s.elapsed for s in steps])
    X = np.stack([np.ones(len(steps)), np.array([s.n for s in steps], float)], axis=1)
    c = least_squares(X[fit_idx], host[fit_idx])
    dev = np.array([cost.device_time(s.bucket, s.k_step, s.ctx_lens)
                    + sum(cost.row_op_time(*op) for op in getattr(s, "row_ops", ())) for s in steps])
    pred = dev + X @ c
    report = {"calibration_steps": len(steps), "calibration_batch_sizes": sorted({int(s.n) for s in steps}),
              "host_step_s": float(c[0]), "host_row_s": float(c[1]),
              "host_mean_abs_err_held_out_s": float(np.mean(np.abs(X[test_idx] @ c - host[test_idx]))),
              "r2_engine_steps_held_out": r_squared(wall[test_idx], pred[test_idx]),
              "mean_rel_err_engine_steps": float(np.mean((pred[test_idx] - wall[test_idx]) / wall[test_idx])),
              "mean_abs_rel_err_engine_steps": float(np.mean(np.abs(pred[test_idx] - wall[test_idx]) / wall[test_idx]))}
    c_all = least_squares(X, host)
    return cost.with_host(float(c_all[0]), float(c_all[1])), report


# ------------------------------------------------------------------ the step's compiled program

_HLO_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.-]+\s*=\s*(\([^=]*?\)|\S+)\s+([a-z][a-z0-9-]*)\(", re.M)
_HLO_ARRAY = re.compile(r"[a-z][a-z0-9]*\[([0-9,]*)\]")


def hlo_op_kinds(text: str, min_elements: int = 0) -> collections.Counter:
    """Opcode histogram of an HLO module's text, every computation included (fusion and loop
    bodies), shapes ignored; ``min_elements``: count only instructions with an array result of at
    least that many elements (the whole-cache copies and transposes that make a step slow)."""
    kinds = collections.Counter()
    for m in _HLO_INSTR.finditer(text):
        shape, op = m.groups()
        if min_elements:
            if shape.startswith("("):
                continue
            dims = _HLO_ARRAY.match(shape)
            if dims is None or int(np.prod([int(d) for d in dims.group(1).split(",") if d])) < min_elements:
                continue
        kinds[op] += 1
    return kinds


def compile_only_device(platform: str, target_config: str):
    """A device to compile for without one attached (XLA's deviceless AOT): ``target_config`` is
    a GpuTargetConfig text proto (benchmarks/h100_target_config.pbtxt); needs the platform's jax
    plugin installed (jax-cuda13-plugin / -pjrt of jaxlib's version), not the hardware."""
    from jax.experimental import topologies

    return topologies.get_topology_desc("compile_only", platform, target_config=target_config,
                                        topology="1x1x1").devices[0]


def step_programs(cfg, ks: Sequence[int], *, batch: int = 1, slots: int = 2048, fwd=None, dtype="float32",
                  compiled: bool = True, device=None) -> dict[int, str]:
    """HLO text of the engine's greedy chain step (step.spec_step, host drafts) for each K, for
    abstract params of ``cfg`` (no weights are drawn): as XLA optimized it for ``device`` (default:
    jax's default device; a ``compile_only_device`` compiles for a GPU that is not here), or as
    lowered (``compiled`` False, before any XLA pass)."""
    import functools

    import jax
    import jax.numpy as jnp

    from specjax.engine.compile_key import CompileKey
    from specjax.engine.step import fresh_state, spec_step_jit
    from specjax.models import llama
    from specjax.models.options import ForwardOptions
    from specjax.sampling import SamplingArrays

    fwd = fwd or ForwardOptions()
    sh = None if device is None else jax.sharding.SingleDeviceSharding(device)

    def sds(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=sh)

    def abstract(tree):
        return jax.tree_util.tree_map(lambda a: sds(a.shape, a.dtype), tree)

    B = batch
    params = abstract(jax.eval_shape(lambda: llama.init_random_params(cfg, dtype=jnp.dtype(dtype), on_device=True)))
    pkey = CompileKey("prefill", cfg, B, slots, True, None, fwd, prompt=bk.MIN_PROMPT_BUCKET)
    state = abstract(jax.eval_shape(functools.partial(fresh_state, B=B, key=pkey), params, None))
    samp = jax.tree_util.tree_map(lambda a: sds((B,), a.dtype), SamplingArrays.build([], B))
    out = {}
    for K in ks:
        key = CompileKey("step", cfg, B, slots, True, None, fwd, k=int(K))
        lowered = spec_step_jit.lower(params, None, state, sds((B, max(K, 1)), jnp.int32), sds((B,), jnp.int32),
                                      sds((B,), jnp.bool_), samp, None, None, key=key)
        out[int(K)] = lowered.compile().as_text() if compiled else lowered.as_text(dialect="hlo")
    return out


def step_op_kinds(cfg, ks: Sequence[int], min_elements: int = 0, **kw) -> dict[int, collections.Counter]:
    """``hlo_op_kinds`` of each K's step program (``step_programs``' keywords)."""
    return {K: hlo_op_kinds(text, min_elements) for K, text in step_programs(cfg, ks, **kw).items()}


def op_kinds_table(kinds: dict[int, collections.Counter], only_differing: bool = False) -> str:
    """A Markdown table, one row per opcode and one column per K."""
    ks = sorted(kinds)
    ops = sorted(set().union(*kinds.values()))
    if only_differing:
        ops = [op for op in ops if len({kinds[K][op] > 0 for K in ks}) > 1]
    lines = ["| op | " + " | ".join(f"K={K}" for K in ks) + " |", "|---|" + "---|" * len(ks)]
    lines += [f"| {op} | " + " | ".join(str(kinds[K][op]) for K in ks) + " |" for op in ops]
    return "\n".join(lines)
