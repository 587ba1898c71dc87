"""The batch execution-time model of SmartSpec (seed 000 §4.3), fitted by least squares.

    T_fwd(M, N_context, N_batched) = a_M * N_context + g_M * N_batched + d_M          (Eq. 7)
    T_batch = T_draft + T_target,  T_draft = sum over the s draft forwards of T_fwd     (Eqs. 4-6)

What N_context means is a property of the attention implementation, so it is part of the
model: ``"sum"`` is the paper's (context tokens of all rows: a paged kernel reads exactly
those); ``"padded"`` is batch bucket x max context rounded up to the chunk (the XLA:CPU chunked
attention here reads that many slots, padding rows included). N_batched is always the padded
block: bucket x tokens per row, because a compiled static-shape step computes padding rows too.

The JSON file holds one entry per (model, drafter, hardware, compiled code) key (``model_key``) so one
file serves several machines and configurations.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import os
import statistics
from typing import Sequence

import numpy as np

from specjax.errors import SpecjaxError


@dataclasses.dataclass(frozen=True)
class LinearCost:
    """T = alpha * n_context + gamma * n_batched + delta (seconds)."""

    alpha: float = 0.0
    gamma: float = 0.0
    delta: float = 0.0

    def __call__(self, n_context: float, n_batched: float) -> float:
        return self.alpha * n_context + self.gamma * n_batched + self.delta


def context_tokens(ctx_lens: Sequence[int], bucket: int, mode: str, chunk: int = 256) -> float:
    if mode == "sum":
        return float(np.sum(ctx_lens)) if len(ctx_lens) else 0.0
    if mode == "padded":
        m = max(ctx_lens) if len(ctx_lens) else 0
        return float(bucket * chunk * math.ceil(m / chunk))
    raise SpecjaxError(f"unknown context mode {mode!r} (expected 'sum' or 'padded')")


@dataclasses.dataclass(frozen=True)
class StepCostModel:
    """Cost of one engine step and one prefill for a (target, drafter) pair.

    target: T_fwd of the target over the verify block (K + 1 tokens per row).
    draft: T_fwd of a device draft model (None for host drafters). Its K forwards feed
      2 tokens per row (re-feed of the last committed and the pending token), then 1 each.
    host_draft: the constant C of draft-model-free drafting, per step (Eq. 4 with T_draft = C).
    host_step, host_row: Python/dispatch overhead per step and per running request, which a
      simulator needs to match a real engine (the paper calibrates its simulator likewise).
    prefill: T of a prefill over bucket x prompt-bucket tokens (draft prefill included if any).
    draft_forwards: a head's token tree of any node budget costs this many draft forwards
      (EAGLE-2's dynamic tree: its depth; Medusa's: one pass of every head); 0: one per draft,
      a chain's (what launch/profile.py fits: its tree cost is in the fitted coefficients).
    call_s: what one device call costs beyond its steps (dispatch, transfers, the program's
      start), inside every step the profile timed alone; a step that runs in a call of n steps
      pays call_s / n of it (``in_call``; profiling.profile_call_overhead measures it).
    """

    target: LinearCost
    draft: LinearCost | None = None
    host_draft: float = 0.0
    host_step: float = 0.0
    host_row: float = 0.0
    prefill: LinearCost = LinearCost()
    context_mode: str = "sum"
    chunk: int = 256
    draft_forwards: int = 0
    call_s: float = 0.0

    def in_call(self, t: float, n: int) -> float:
        """A step predicted at ``t`` (timed alone), run in a call of ``n`` steps."""
        return t - self.call_s * (1.0 - 1.0 / max(n, 1))

    def _forwards(self, k: int) -> int:
        return min(k, self.draft_forwards) if self.draft_forwards else k

    def target_time(self, bucket: int, k: int, ctx_lens: Sequence[int], tokens_per_row: int | None = None,
                    batched: int | None = None) -> float:
        """``batched``: the block's tokens when packed (per-row draft counts), else bucket x (k + 1)."""
        n = tokens_per_row if tokens_per_row is not None else k + 1
        return self.target(context_tokens(ctx_lens, bucket, self.context_mode, self.chunk),
                           batched if batched else bucket * n)

    def draft_time(self, bucket: int, k: int, ctx_lens: Sequence[int]) -> float:
        if k <= 0:
            return 0.0
        if self.draft is None:
            return self.host_draft
        ctx = np.asarray(ctx_lens, np.int64)
        t = 0.0
        for i in range(self._forwards(k)):
            t += self.draft(context_tokens(ctx + i, bucket, self.context_mode, self.chunk), bucket * (2 if i == 0 else 1))
        return t

    def step_time(self, bucket: int, k: int, ctx_lens: Sequence[int], n_rows: int | None = None,
                  tokens_per_row: int | None = None, batched: int | None = None) -> float:
        """Predicted wall time of one engine step (device + host overhead)."""
        n = len(ctx_lens) if n_rows is None else n_rows
        return (self.draft_time(bucket, k, ctx_lens) + self.target_time(bucket, k, ctx_lens, tokens_per_row, batched)
                + self.host_step + self.host_row * n)

    def device_time(self, bucket: int, k: int, ctx_lens: Sequence[int]) -> float:
        return self.draft_time(bucket, k, ctx_lens) + self.target_time(bucket, k, ctx_lens)

    def prefill_time(self, bucket: int, prompt_bucket: int, draft: bool = True) -> float:
        """``draft``: whether the draft model is prefilled too (this model does not tell the
        two apart; ``ProfiledCost`` does when the profile timed both)."""
        return self.prefill(0.0, bucket * prompt_bucket)

    def with_host(self, host_step: float, host_row: float) -> "StepCostModel":
        return dataclasses.replace(self, host_step=host_step, host_row=host_row)

    def row_op_time(self, op: str, b_from: int, b_to: int) -> float:
        """Cost of a cache row operation (alloc / take / clear): not in Eq. 7, so 0 here; a
        ``ProfiledCost`` charges what the profile measured."""
        return 0.0

    # ------------------------------------------------------------ features for fitting

    def step_features(self, bucket: int, k: int, ctx_lens: Sequence[int], device_draft: bool) -> np.ndarray:
        """[t_ctx, t_batched, 1, d_ctx, d_batched, d_forwards]: T_step is linear in these with
        coefficients (target.alpha, target.gamma, target.delta, draft.alpha, draft.gamma, draft.delta)."""
        f = np.zeros(6)
        f[0] = context_tokens(ctx_lens, bucket, self.context_mode, self.chunk)
        f[1] = bucket * (k + 1)
        f[2] = 1.0
        if device_draft and k > 0:
            ctx = np.asarray(ctx_lens, np.int64)
            for i in range(self._forwards(k)):
                f[3] += context_tokens(ctx + i, bucket, self.context_mode, self.chunk)
                f[4] += bucket * (2 if i == 0 else 1)
                f[5] += 1.0
        return f

    # ------------------------------------------------------------ persistence

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        return d

    @staticmethod
    def from_dict(d: dict) -> "StepCostModel":
        d = dict(d)
        d["target"] = LinearCost(**d["target"])
        d["draft"] = LinearCost(**d["draft"]) if d.get("draft") else None
        d["prefill"] = LinearCost(**d.get("prefill", {}))
        known = {f.name for f in dataclasses.fields(StepCostModel)}
        return StepCostModel(**{k: v for k, v in d.items() if k in known})


class CostCalibration:
    """Online correction of a step-cost model (the way alpha is learnt online): per compiled step
    shape (batch bucket, K, verified tokens; a draft-free step apart: ``GoodputPolicy._shape``),
    the median of the last ``window`` ratios of the measured iteration time to the model's
    prediction. The fitted line is one line through every batch size; measured, the batch-1
    verify steps cost 1.2-1.5x what it predicts while the batch-8 ones match, which made the
    selector draft where drafting does not pay.

    A shape not measured yet borrows the ratio of the nearest measured shape of its bucket (by
    verified tokens, then K), else 1: an underestimated shape gets tried, measured and corrected;
    an overestimated one is the cautious error, and with ``prior_weight`` > 0 what it borrows
    counts as that many observations until real ones replace them: a K = 1 EAGLE step once
    measured at 1.24x the model, alone, kept SmartSpec from choosing it, so nothing ever measured
    it again; and at the model's own 1.0 it looked 1.45x a K = 0 step that ran at 0.88x its own."""

    def __init__(self, window: int = 16, prior_weight: int = 0):
        if window < 1:
            raise ValueError(f"calibration window must be >= 1, got {window}")
        if prior_weight < 0:
            raise ValueError(f"prior_weight must be >= 0, got {prior_weight}")
        self.window = window
        self.prior_weight = prior_weight
        self._ratios: dict[tuple, collections.deque] = {}
        # Factors looked up since the last observation (the selector asks for every compiled K
        # each step; a median per lookup was most of its host time).
        self._cache: dict[tuple, float] = {}

    def observe(self, key: tuple, predicted: float, measured: float) -> None:
        if predicted > 0 and measured > 0 and math.isfinite(measured):
            self._ratios.setdefault(tuple(key), collections.deque(maxlen=self.window)).append(measured / predicted)
            self._cache.clear()

    def forget(self, bucket: int, k: int) -> None:
        """Drop what the shapes of block K = ``k`` at ``bucket`` measured (another way of running
        them takes over)."""
        self._ratios = {key: v for key, v in self._ratios.items() if key[:2] != (bucket, k)}
        self._cache.clear()

    def factor(self, key: tuple) -> float:
        key = tuple(key)
        f = self._cache.get(key)
        if f is None:
            xs = list(self._ratios.get(key, ()))
            if len(xs) < max(self.prior_weight, 1):  # (what it borrows: the nearest measured shape's)
                same = [k for k in self._ratios if k[0] == key[0] and k != key]
                near = (float(statistics.median(self._ratios[min(same, key=lambda k: (abs(k[2] - key[2]),
                                                                                     abs(k[1] - key[1]), k))]))
                        if same else 1.0)
                xs += [near] * max(self.prior_weight - len(xs), 0 if xs else 1)
            f = self._cache[key] = float(statistics.median(xs))
        return f

    def factors(self) -> dict[tuple, float]:
        """Every measured shape's current factor (for reports)."""
        return {k: float(np.median(v)) for k, v in sorted(self._ratios.items())}


def least_squares(X: np.ndarray, y: np.ndarray, nonneg: bool = True, relative: bool = False) -> np.ndarray:
    """Coefficients minimising ||X c - y||^2; with ``nonneg`` a column whose coefficient comes out
    negative is dropped and the fit redone (active-set NNLS: times never shrink with more work).
    ``relative``: minimise the squared *relative* error, sum ((X c - y) / y)^2, instead (every
    row scaled by 1 / y; ``y`` must be positive), so large samples do not set the line alone."""
    X = np.asarray(X, np.float64)
    y = np.asarray(y, np.float64)
    if relative:
        if not (y > 0).all():
            raise SpecjaxError("a relative-error fit needs positive times")
        X, y = X / y[:, None], np.ones_like(y)
    active = np.ones(X.shape[1], bool)
    active &= np.abs(X).sum(axis=0) > 0  # a feature that is always 0 cannot be identified
    while True:
        c = np.zeros(X.shape[1])
        if active.any():
            c[active] = np.linalg.lstsq(X[:, active], y, rcond=None)[0]
        if not nonneg or (c[active] >= 0).all():
            return c
        active &= ~(c < 0)


def r_squared(y: np.ndarray, pred: np.ndarray) -> float:
    y = np.asarray(y, np.float64)
    ss_res = float(np.sum((y - pred) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan")


def fit_linear(n_context: Sequence[float], n_batched: Sequence[float], times: Sequence[float]) -> LinearCost:
    """Fit Eq. 7 for one model from (N_context, N_batched, T) samples."""
    X = np.stack([np.asarray(n_context, float), np.asarray(n_batched, float), np.ones(len(times))], axis=1)
    a, g, d = least_squares(X, np.asarray(times, float))
    return LinearCost(float(a), float(g), float(d))


def fit_step_model(features: np.ndarray, times: np.ndarray, base: StepCostModel) -> StepCostModel:
    """Fit target and (if any row has draft features) draft coefficients jointly from whole-step
    timings: T_step = target(f0, f1) + sum of draft forwards (f3, f4, f5). By relative error: a
    profile's batch-8 steps take 4-8x a batch-1 step, and an absolute-error fit let them set the
    line alone (the AVX2 EAGLE model priced a batch-1 K = 3 step at 3.8x K = 0 where its own cells
    say 2.3x); goodput compares steps of one batch, so each step's relative error is what counts."""
    c = least_squares(features, times, relative=True)
    draft = LinearCost(*map(float, c[3:6])) if np.abs(features[:, 3:]).sum() > 0 else base.draft
    return dataclasses.replace(base, target=LinearCost(*map(float, c[:3])), draft=draft)


def hardware_key() -> str:
    """'<platform>:<device kind>' of the default JAX backend, e.g. 'gpu:NVIDIA H100 80GB HBM3'; on
    a CPU the vector class its kernels run ('cpu:avx512', 'cpu:avx2', 'cpu:portable'): a model
    profiled on one class misleads the goodput choice on another (a batch job's suffix_path at
    0.90x AR on an AVX-512 CPU with the AVX2 one's model, 1.01x with its own; BENCHMARKS.md)."""
    import jax

    d = jax.devices()[0]
    if d.platform == "cpu":
        from specjax.models.cpu.rows_dot import simd_class

        return f"cpu:{simd_class()}"
    return f"{d.platform}:{getattr(d, 'device_kind', 'unknown')}"


def save_model(path: str, key: str, model: StepCostModel, meta: dict | None = None) -> None:
    """Store ``model`` under ``key`` in the JSON file at ``path`` (other keys are kept)."""
    data = read_store(path) if os.path.exists(path) else {}  # (a damaged store: one line, never overwritten)
    data[key] = {"model": model.to_dict(), "meta": meta or {}}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def read_store(path: str, flag: str = "performance-model file") -> dict:
    """The performance models in ``path`` ({key: {"model": ..., "meta": ..., "table": ...}}),
    every one checked to load: a file that is missing, unreadable, not JSON or not such a store is
    a one-line SpecjaxError naming ``flag``, so a file the user named is never silently ignored."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise SpecjaxError(f"{flag} {path} does not exist (make one with launch/profile.py)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpecjaxError(f"{flag} {path} cannot be read: {e}") from None
    except json.JSONDecodeError as e:
        raise SpecjaxError(f"{flag} {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise SpecjaxError(f"{flag} {path} is not a performance-model file (launch/profile.py writes one)")
    for key, entry in data.items():
        try:
            StepCostModel.from_dict(entry["model"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise SpecjaxError(f"{flag} {path} is not a performance-model file: its entry {key!r} is not a "
                               f"model ({type(e).__name__}: {e})"[:400]) from None
    return data


def load_model(path: str, key: str) -> StepCostModel:
    data = read_store(path)
    if key not in data:
        raise SpecjaxError(f"{path} has no performance model for {key!r} (it has: {', '.join(sorted(data)) or 'none'}); "
                           "profile this model on this hardware with launch/profile.py")
    return StepCostModel.from_dict(data[key]["model"])


def model_key(target: str, drafter: str, hardware: str, code: str) -> str:
    """'<target>|<drafter's perf label>|<hardware>|<code>': ``code`` is EngineSpec.code_key(), the
    settings that change the compiled step (forward options, dtype, layout), so a model profiled
    for one executable is never found for another."""
    return f"{target}|{drafter}|{hardware}|{code}"


def code_mismatch(path: str, key: str) -> str | None:
    """When ``path`` has no model under ``key`` but has ones for the same target, drafter and
    hardware profiled for other compiled code: which code settings differ; else, when it has
    this code's on other hardware: which (else None)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    head, _, code = key.rpartition("|")
    ours = dict(x.split("=", 1) for x in code.split(","))
    diffs = []
    for other in sorted(data):
        h, _, c = other.rpartition("|")
        if other.count("|") != key.count("|") or h != head:
            continue
        theirs = dict(x.split("=", 1) for x in c.split(",") if "=" in x)
        diffs.append(" ".join(f"{k} {theirs.get(k, '?')} (profiled) vs {v}" for k, v in ours.items()
                              if theirs.get(k) != v))
    if not diffs:
        target, drafter, hw = head.split("|")[:3]
        diffs = [f"hardware {other.split('|')[2]} (profiled) vs {hw}" for other in sorted(data)
                 if other.count("|") == key.count("|") and other.split("|")[:2] == [target, drafter]
                 and other.rpartition("|")[2] == code]
    return "; or ".join(diffs) or None


# ---------------------------------------------------------------- profiled tables


@dataclasses.dataclass(frozen=True)
class ProfiledCost:
    """Step times looked up in the profile itself, for the simulator (seed 000 §7.2: the event
    clock advances by *profiled* execution times). Measured device time of one step, median per
    (batch bucket, K, context chunks), where chunks = ceil(max context / chunk): with the
    padded XLA:CPU attention that is all the context a step's cost depends on, so on the grid the
    table is exact where Eq. 7 is only a line through it. Shapes the grid did not time fall back
    to ``linear`` (the fitted Eq. 7), as do prefill and host overhead.

    Only the simulator uses it; the SmartSpec selector keeps the paper's linear model."""

    linear: StepCostModel
    cells: tuple[tuple[int, int, int, float], ...] = ()  # (bucket, K, chunks, seconds)
    row_ops: tuple[tuple[str, int, int, float], ...] = ()  # (op, bucket from, bucket to, seconds)
    prefill_plain: LinearCost | None = None  # device drafters: a prefill without the draft's
    # (bucket, prompt bucket, with the draft model 0/1, seconds): measured prefill medians.
    prefill_cells: tuple[tuple[int, int, int, float], ...] = ()
    # Optional (bucket, factor): this machine's speed now relative to the profile, measured by a
    # probe just before a run (``engine.profiling.probe_speed``); scales steps and prefills.
    speed: tuple[tuple[int, float], ...] = ()

    @functools.cached_property
    def _lookup(self) -> dict:
        return {(b, k, c): t for b, k, c, t in self.cells}

    def _speed(self, bucket: int) -> float:
        return dict(self.speed).get(bucket, 1.0)

    def device_time(self, bucket: int, k: int, ctx_lens: Sequence[int]) -> float:
        m = max(ctx_lens) if len(ctx_lens) else 0
        t = self._lookup.get((bucket, k, max(1, math.ceil(m / self.linear.chunk))))
        t = t if t is not None else self.linear.device_time(bucket, k, ctx_lens)
        return t * self._speed(bucket)

    def step_time(self, bucket: int, k: int, ctx_lens: Sequence[int], n_rows: int | None = None,
                  tokens_per_row: int | None = None, batched: int | None = None) -> float:
        if (tokens_per_row is not None and tokens_per_row != k + 1) or batched:
            # trees, packed blocks: not tabled
            return self.linear.step_time(bucket, k, ctx_lens, n_rows, tokens_per_row, batched)
        n = len(ctx_lens) if n_rows is None else n_rows
        return self.device_time(bucket, k, ctx_lens) + self.linear.host_step + self.linear.host_row * n

    @functools.cached_property
    def _prefill_lookup(self) -> dict:
        return {(b, tp, d): t for b, tp, d, t in self.prefill_cells}

    def prefill_time(self, bucket: int, prompt_bucket: int, draft: bool = True) -> float:
        """The measured median where the profile timed this (bucket, prompt bucket, draft or
        not); else the fitted line (the target-only line for a request admitted without its draft)."""
        t = self._prefill_lookup.get((bucket, prompt_bucket, int(draft)))
        if t is None:
            if not draft and self.prefill_plain is not None:  # admitted with the draft disabled / no-SD
                t = self.prefill_plain(0.0, bucket * prompt_bucket)
            else:
                t = self.linear.prefill_time(bucket, prompt_bucket)
        return t * self._speed(bucket)

    @property
    def call_s(self) -> float:
        return self.linear.call_s

    def in_call(self, t: float, n: int) -> float:
        return self.linear.in_call(t, n)

    def with_speed(self, factors: dict[int, float] | None) -> "ProfiledCost":
        """A copy whose steps and prefills at batch bucket b take ``factors[b]`` x the profiled time."""
        return dataclasses.replace(self, speed=tuple(sorted((int(b), float(f)) for b, f in (factors or {}).items())))

    @functools.cached_property
    def _row_lookup(self) -> dict:
        return {(op, a, b): t for op, a, b, t in self.row_ops}

    def row_op_time(self, op: str, b_from: int, b_to: int) -> float:
        """Measured cost of a cache row operation (0 where the profile did not time it)."""
        return self._row_lookup.get((op, b_from, b_to), 0.0)

    def with_host(self, host_step: float, host_row: float) -> "ProfiledCost":
        return dataclasses.replace(self, linear=dataclasses.replace(self.linear, host_step=host_step,
                                                                    host_row=host_row))


def median_cells(recs: Sequence[dict], key) -> tuple:
    """(*key(r), median t) per distinct key over records {..., t}, sorted by key."""
    groups: dict = {}
    for r in recs:
        groups.setdefault(tuple(key(r)), []).append(float(r["t"]))
    return tuple((*k, float(np.median(ts))) for k, ts in sorted(groups.items()))


def table_cells(recs: Sequence[dict], chunk: int = 256) -> tuple[tuple[int, int, int, float], ...]:
    """Median step time per (bucket, K, context chunks) of profiling records {B, K, ctx_lens, t}."""
    return median_cells(recs, lambda r: (int(r["B"]), int(r["K"]), max(1, math.ceil(max(r["ctx_lens"]) / chunk))))


def prefill_table_cells(recs: Sequence[dict], draft: bool) -> tuple[tuple[int, int, int, float], ...]:
    """Median prefill time per (bucket, prompt bucket) of profiling records {B, Tp, t}."""
    return median_cells(recs, lambda r: (int(r["B"]), int(r["Tp"]), int(draft)))


def save_table(path: str, key: str, cost: ProfiledCost) -> None:
    """Store the profiled cells and their own host calibration beside the model saved under ``key``."""
    with open(path) as f:
        data = json.load(f)
    data[key]["table"] = {"cells": [list(c) for c in cost.cells], "host_step": cost.linear.host_step,
                          "host_row": cost.linear.host_row, "row_ops": [list(c) for c in cost.row_ops],
                          "prefill_plain": dataclasses.asdict(cost.prefill_plain) if cost.prefill_plain else None,
                          "prefill_cells": [list(c) for c in cost.prefill_cells]}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def load_profiled(path: str, key: str) -> ProfiledCost:
    """The linear model under ``key`` with its profiled table and host terms (an empty table, i.e.
    the linear model alone, if the profile saved none)."""
    linear = load_model(path, key)
    with open(path) as f:
        tab = json.load(f)[key].get("table")
    if not tab:
        return ProfiledCost(linear)
    cells = tuple((int(b), int(k), int(c), float(t)) for b, k, c, t in tab["cells"])
    ops = tuple((str(op), int(a), int(b), float(t)) for op, a, b, t in tab.get("row_ops", ()))
    plain = LinearCost(**tab["prefill_plain"]) if tab.get("prefill_plain") else None
    pcells = tuple((int(b), int(tp), int(d), float(t)) for b, tp, d, t in tab.get("prefill_cells", ()))
    return ProfiledCost(linear, cells, ops, plain, pcells).with_host(float(tab["host_step"]), float(tab["host_row"]))
