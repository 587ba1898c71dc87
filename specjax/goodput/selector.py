"""Choosing each step's proposal length by estimated goodput (seed 000 §5, Algorithms 1-3).

Goodput = expected generated tokens / estimated batch time (Eq. 3). A policy sees a
``BatchView`` of the running batch and returns K, which must be one of the K values compiled
for the batch bucket (K = 0, plain decoding, is always one of them).

Batch candidates (Algorithm 2, GetBatchCandidates). The engine admits the FCFS prefix of the
waiting queue that fits the free KV rows before each step. Among prefixes of the *running*
batch, the full batch always has the best goodput here: a compiled step costs its whole bucket
whichever rows it leaves idle, so dropping a request lowers the generated tokens and not the
time. The selector therefore optimises K for the whole batch (step-level granularity, the one
the paper also settles on); per-request alphas enter the expected length when enabled.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
from typing import Hashable, Sequence

import numpy as np

from specjax.buckets import proposal_bucket
from specjax.goodput.acceptance import (AcceptanceEstimator, ScoreCalibration, chain_rates, confidence_lengths,
                                        examined, expected_len, expected_len_from_positions)
from specjax.goodput.perf_model import CostCalibration, StepCostModel

HOLD_POOL = 512  # verified row-steps whose acceptance a held request's K is chosen from (GoodputPolicy._held)


@dataclasses.dataclass
class BatchView:
    """What a policy may look at before a step.

    ctx_lens: per running request, tokens in its KV cache (FCFS order).
    bucket: the compiled batch size the step will run at.
    k_options: compiled K values for this bucket, ascending, 0 included.
    request_ids: per running request.
    draft_lens: how many drafts each request can have: host drafters propose before the
      choice; a device drafter drafts K for every request except those admitted with the draft
      disabled (0). None: unknown (every request drafts K).
    confidences: optional [n, Kmax] per-token draft confidences (Algorithm 3).
    true_accept: simulator only: how many drafts each request *would* accept (oracle).
    draft_scores: host tree drafters (SuffixDecoding): per request, the drafter's estimated
      probability that each proposed node is accepted (node order, the order a tree is cut in),
      or None for a request without such estimates. The expected accepted drafts of the first
      m nodes is their sum.
    draft_classes: host drafters without scores (prompt lookup): per request, the kind of match
      its proposal came from (the n-gram length), or None; acceptance is learnt per class.
    drafted_ahead: draft forwards a device drafter already ran for this step before the choice
      (confidence-based proposal): their cost is spent whatever K is chosen.
    draft_free: the step runs no device drafting whatever K (hybrid_eagle when every row took a
      suffix chain): a verify step costs the target's block alone.
    token_options: K -> the packed verify sizes the backend compiled for (bucket, K) (empty: the
      block always costs bucket x (K + 1) rows); a packed step costs its real tokens.
    k_coming: K buckets not in ``k_options`` yet that a background warm-up is building for this
      bucket (each joins ``k_options`` once in).
    call_ks: the K values whose committed runs the backend runs as device calls of up to
      ``call_steps`` steps (K = 0's decode calls; a device drafter's K > 0): choosing one costs
      a step in such a call, not a step alone.
    """

    ctx_lens: Sequence[int]
    bucket: int
    k_options: Sequence[int]
    request_ids: Sequence[Hashable] = ()
    draft_lens: Sequence[int] | None = None
    confidences: np.ndarray | None = None
    true_accept: Sequence[int] | None = None
    draft_scores: Sequence[np.ndarray | None] | None = None
    draft_classes: Sequence[Hashable | None] | None = None
    drafted_ahead: int = 0
    draft_free: bool = False
    token_options: dict = dataclasses.field(default_factory=dict)
    k_coming: Sequence[int] = ()
    call_ks: Sequence[int] = ()
    call_steps: int = 1

    @property
    def n(self) -> int:
        return len(self.ctx_lens)


class Policy:
    name = "policy"
    may_speculate = True  # False: never drafts, so a request needs no draft-model prefill either
    # Confidence-based proposal (Algorithm 3): device drafters draft ahead of the choice, each row
    # going on while its last draft's confidence exceeds this; None: draft inside the step.
    draft_threshold: float | None = None
    # steps of the chosen K the engine may run in one device call (no choice is due before the call
    # ends; the backend's decode_steps caps it; K > 0 only where the backend's steps need nothing
    # from the host, a device drafter's); 1: a choice every step
    call_steps: int = 1
    # True: ``choose`` also weighs ``view.k_coming`` (drafts are proposed at their width) and sets
    # ``want_k`` to the one it would have taken had it been compiled (0: none), so a backend that
    # builds K steps on demand (JaxBackend.want) builds only those a job's choices reach
    plans_coming = False
    want_k = 0

    def choose(self, view: BatchView) -> int:
        raise NotImplementedError

    def observe(self, k: int, drafted: Sequence[int], accepted: Sequence[int], request_ids=(),
                classes=None, scores=None) -> None:
        """Feedback after the verify step (Algorithm 2 line 13-14); ``classes`` and ``scores``: the
        rows' draft classes and node scores when not those of the last choice (shadow-verified
        older proposals)."""

    def observe_time(self, view: BatchView, k_step: int, tokens: int, seconds: float, full_call: bool = False,
                     cold: bool = False, call_len: int = 1) -> None:
        """Feedback after the step: the compiled block it ran (``k_step``, ``tokens`` verified rows)
        and the seconds the whole iteration took, what the policy's cost estimate predicts;
        ``full_call``: a step of a decode call as long as the backend runs (``seconds``: the
        call's per step); ``cold``: the step waited for or ran beside a compilation, or also ran
        row ops, so ``seconds`` is not its cost; ``call_len``: the steps of the call that ran it."""

    def row_drafts(self, view: BatchView, k: int) -> list[int] | None:
        """Per-request draft counts (<= k, aligned with ``view.request_ids``) for the step just
        chosen, or None: every request gets up to k."""
        return None

    def could_pay(self, view: BatchView) -> bool:
        """Whether drafting could pay on this batch at all (the engine asks before a draft-model
        prefill; ``view``: the batch an admission would make, no proposal)."""
        return self.may_speculate

    def finish(self, rid: Hashable) -> None:
        pass

    def draft_changed(self) -> None:
        """The device draft's params were swapped (online distillation): what was learnt of the
        old draft's acceptance must not steer choices for the new one."""


class FixedK(Policy):
    """The baselines: K drafts every step (K = 0: no speculation). For host drafters the
    engine still shrinks the block to the longest proposal (a bucket holding it). Nothing is
    ever decided, so the engine may run as many steps in a call as it can (``call_steps``). While
    K's step is still being built in the background (``view.k_coming``: a lazy first answer),
    the largest compiled K below it runs: the tokens are the same."""

    def __init__(self, k: int):
        self.k = int(k)
        self.name = "no-SD" if k == 0 else f"K={k}"
        self.may_speculate = self.k > 0
        self.call_steps = 1 << 30

    def choose(self, view: BatchView) -> int:
        if self.k in view.k_options:
            return self.k
        if self.k not in view.k_coming:
            raise ValueError(f"K={self.k} is not compiled for bucket {view.bucket}: {list(view.k_options)}")
        return max(o for o in view.k_options if o <= self.k)


class GoodputPolicy(Policy):
    """SmartSpec: argmax over compiled K of estimated goodput.

    estimator: "moving_average" (Algorithms 1-2; per request if ``per_request``),
      "confidence" (Algorithm 3: a request's accepted drafts are predicted as its leading run of
      draft confidences above ``threshold``; needs ``view.confidences``), or "oracle" (simulator:
      the true accepted lengths, the paper's 'optimal' curve).
    """

    plans_coming = True

    def __init__(self, cost: StepCostModel, estimator: str = "moving_average", window: int = 16,
                 prior_alpha: float = 0.5, per_request: bool = False, threshold: float = 0.5,
                 name: str | None = None, reprobe_after: int | None = None, per_request_k: bool = False,
                 calibrate: bool = True, min_gain: float = 0.0, prior_weight: int = 0, hold_requests: bool = False):
        if estimator not in ("moving_average", "confidence", "oracle"):
            raise ValueError(f"unknown goodput estimator {estimator!r}")
        if min_gain < 0:
            raise ValueError(f"min_gain must be >= 0, got {min_gain}")
        self.cost = cost
        self.estimator = estimator
        # A K > 0 runs only where its estimated goodput beats K = 0's by more than this fraction:
        # both estimates carry errors of several percent (alpha from a moving average, the step
        # cost from calibrated measurements), and a marginal K > 0 also ends a K = 0 decode call.
        self.min_gain = float(min_gain)
        self.acc = AcceptanceEstimator(window, prior_alpha, per_request, prior_weight=prior_weight)
        self.threshold = threshold
        # Confidence policy: whether the next step drafts ahead (see draft_threshold); draft
        # calls in a row that ended in K = 0 (their first forward wasted), and the step count
        # before which no draft call is made after too many of them.
        self._draft_ahead = True
        self._steps = self._ahead_wasted = self._closed_until = 0
        self.reprobe_after = reprobe_after if reprobe_after is not None else 4 * window
        self.name = name or {"moving_average": "SmartSpec", "confidence": "SmartSpec-conf",
                             "oracle": "oracle"}[estimator]
        self.last_goodputs: dict[int, float] = {}
        # Per-request draft counts (SmartSpec's request-level K): each step also tries token
        # budgets with the drafts allocated where their expected gain is largest; it pays when
        # the backend runs packed blocks (a step then costs the tokens it verifies).
        self.per_request_k = per_request_k
        if per_request_k and name is None:
            self.name += "-req"
        self._row_k: dict | None = None
        self._stale = 0
        # Drafter scores (tree drafters' node probabilities) are calibrated online like alpha:
        # accepted / predicted accepted drafts, per band of the first node's score, scales them.
        self.score_calibration = ScoreCalibration(window)
        self._scores: dict = {}  # request id -> the node probabilities of its last proposal
        self._classes: dict = {}  # request id -> the draft class of its last proposal
        # The cost model is calibrated online too: measured / predicted per compiled step shape.
        self.calibration = CostCalibration(window, prior_weight) if calibrate else None
        self._plain_run = 0  # K = 0 choices since the last speculative step that paid (call_steps)
        self._run = (0, 0)  # (K > 0, times chosen in a row) (call_steps)
        self._k0_calls: set[int] = set()  # batch buckets whose K = 0 has run in full decode calls (call_s 0)
        self._accepted = 0  # drafts the last verify step accepted (observe -> observe_time)
        # Per-request K at batch 1 for device heads in calls (_held): at one request each step's
        # alpha reads 0 or 1, and a per-step choice from a window of 16 swung between K = 0 and
        # K = 1 (and 2) from run to run (EAGLE on chat: 0.94-1.06x AR where a fixed K = 1 ran 1.06-1.10x).
        self.hold_requests = hold_requests
        self.probe_every = 8
        self._pool: collections.deque = collections.deque(maxlen=HOLD_POOL)  # (accepted, examined) per row-step
        self._held_rid, self._held_k, self._plain_requests = None, 0, 0

    @property
    def draft_threshold(self) -> float | None:
        """Confidence policy (Algorithm 3): the cut for the next step's draft call, or None when
        the moving-average estimate says no K > 0 pays on the last batch: the draft call's first
        forward is spent whatever K is then chosen, so with a draft that is rarely accepted every
        step would pay it for nothing. Such steps choose K from the moving average (the fused
        step drafts inside, if any K pays); the stale-estimate re-probe (``observe``) reopens
        the draft call about once per ``reprobe_after`` steps."""
        if self.estimator == "confidence" and self._draft_ahead:
            return float(self.threshold)
        return None

    def draft_changed(self) -> None:
        self.acc.clear()
        self._scores.clear()

    def row_expected(self, view: BatchView, kmax: int) -> list[np.ndarray]:
        """Per request, its expected generated tokens (bonus included) with m = 0 .. cap drafts,
        cap = min(its proposal, kmax): the one estimate behind batch-level and per-request K."""
        n = view.n
        caps = np.minimum(np.asarray(view.draft_lens), kmax) if view.draft_lens is not None else np.full(n, kmax)
        ms = [np.arange(int(c) + 1) for c in caps]
        if self.estimator == "oracle":
            return [1.0 + np.minimum(int(a), m) for a, m in zip(view.true_accept, ms)]
        if self.estimator == "confidence" and view.confidences is not None:
            pred = confidence_lengths(view.confidences, self.threshold)
            return [1.0 + np.minimum(int(p), m) for p, m in zip(pred, ms)]
        if (self.acc.per_request or view.draft_classes is not None) and len(view.request_ids):
            classes = view.draft_classes if view.draft_classes is not None else [None] * n
            alphas = [self.acc.request_alpha(r, c) for r, c in zip(view.request_ids, classes)]
        else:
            alphas = [self.acc.alpha.value] * n
        if view.draft_lens is not None:
            scores = view.draft_scores if view.draft_scores is not None else [None] * n
            out = []
            for a, m, sc in zip(alphas, ms, scores):
                if sc is not None:  # the expected accepted drafts of the first m nodes: their scores' sum
                    cum = np.concatenate([[0.0], np.cumsum(np.asarray(sc, np.float64)[:len(m) - 1])])
                    out.append(1.0 + np.minimum(self.score_calibration.factor(sc) * cum, m))
                else:
                    out.append(np.array([expected_len(a, int(j)) for j in m]))
            return out
        rho = self.acc.rho.value  # device drafters always propose (rho = 1 once observed)
        return [np.array([1.0 + rho * (expected_len(a, int(j)) - 1.0) for j in m]) for a, m in zip(alphas, ms)]

    def expected_tokens(self, view: BatchView, k: int, rows: list[np.ndarray] | None = None) -> float:
        """Expected generated tokens of the batch with K drafts (bonus tokens included); ``rows``:
        row_expected(view, kmax) for some kmax >= k, computed once for every K of a step."""
        if k == 0 or view.n == 0:
            return float(view.n)
        if rows is None:
            rows = self.row_expected(view, k)
        return float(sum(e[min(k, len(e) - 1)] for e in rows))

    def step_cost(self, view: BatchView, k_step: int, n_tokens: int | None = None) -> float:
        """Predicted time of a step that runs block k_step with ``n_tokens`` real tokens (packed
        into the smallest compiled size holding them, where the backend has one), calibrated by
        what this shape measured so far."""
        tokens = self._step_tokens(view, k_step, n_tokens)
        t = self._model_cost(view, k_step, tokens)
        if self.calibration is not None:
            t *= self.calibration.factor(self._shape(view, k_step, tokens))
        return t

    @staticmethod
    def _step_tokens(view: BatchView, k_step: int, n_tokens: int | None) -> int:
        """The verify rows a step of block k_step runs: the smallest packed size holding
        ``n_tokens``, else the whole bucket x (k_step + 1) block."""
        if n_tokens is not None and k_step > 0:
            P = next((t for t in view.token_options.get(k_step, ()) if t >= n_tokens), 0)
            if P:
                return P
        return view.bucket * (k_step + 1)

    @staticmethod
    def _shape(view: BatchView, k_step: int, tokens: int) -> tuple:
        """The calibration's key: a draft-free verify step is measured apart from one of the
        same shape that drafts on the device."""
        shape = (view.bucket, k_step, tokens)
        return shape + ("draft_free",) if view.draft_free and k_step else shape

    def _model_cost(self, view: BatchView, k_step: int, tokens: int, call_len: int | None = None) -> float:
        """The cost model's own prediction (Eq. 7 with the step's shape), uncalibrated; a K the
        backend runs in calls (``view.call_ks``) costs a step of a call of ``call_len`` steps
        (None: a full call, what choosing it costs)."""
        packed = tokens if tokens != view.bucket * (k_step + 1) else None
        if view.drafted_ahead or view.draft_free:
            # Drafts made before the choice (Algorithm 3; draft_time of 0 forwards is 0) or none
            # to make: only the verify varies with K.
            t = (self.cost.draft_time(view.bucket, view.drafted_ahead, view.ctx_lens)
                 + self.cost.step_time(view.bucket, 0, view.ctx_lens, tokens_per_row=k_step + 1, batched=packed))
        else:
            t = self.cost.step_time(view.bucket, k_step, view.ctx_lens, batched=packed)
        return self.cost.in_call(t, call_len or view.call_steps) if k_step in view.call_ks else t

    def observe_time(self, view: BatchView, k_step: int, tokens: int, seconds: float, full_call: bool = False,
                     cold: bool = False, call_len: int = 1) -> None:
        if cold:  # (a compilation's or row ops' seconds: neither a cost nor a verdict on whether drafting paid)
            self._accepted = 0
            return
        if k_step > 0 and view.n and (view.n + self._accepted) / max(seconds, 1e-12) > self.goodput(view, 0):
            self._plain_run = 0  # it paid: more tokens a second than a K = 0 step makes (_commit)
        self._accepted = 0
        if not self.cost.call_s and k_step == 0 and full_call and view.bucket not in self._k0_calls:
            self._k0_calls.add(view.bucket)
            if self.calibration is not None:
                self.calibration.forget(view.bucket, 0)  # the single steps before the first call
        if self.calibration is None or (k_step == 0 and not full_call and view.bucket in self._k0_calls):
            # A model without the call's own cost (call_s 0: profiled before it was) cannot tell a
            # K = 0 step alone from one of a call, so once K = 0 has run in full decode calls at
            # this bucket only they calibrate it: that is what choosing it keeps costing. The
            # single steps and short calls (1, 2, 4, ...: _commit) that speculating leaves between
            # verify steps pay a host round trip per call (22 ms a step alone, 15 in a call of 16,
            # batch 4 on the CPU). Counted as K = 0's cost they made every K > 0 look better, which
            # drafted more, which ran more of them: a batch job served at 0.976x AR so, K = 0's
            # cost reading 1.35x its calls' where K > 0 was chosen. With call_s every step is
            # compared with a step of a call of its own length.
            return
        self.calibration.observe(self._shape(view, k_step, tokens), self._model_cost(view, k_step, tokens, call_len),
                                 seconds)

    def goodput(self, view: BatchView, k: int, rows: list[np.ndarray] | None = None) -> float:
        """Algorithm 1: generated length / batch execution time (``rows``: see expected_tokens)."""
        if k == 0 or view.n == 0:
            return view.n / max(self.step_cost(view, 0), 1e-12)
        drafts = np.minimum(np.asarray(view.draft_lens), k) if view.draft_lens is not None else np.full(view.n, k)
        # The block shrinks to the smallest compiled K holding the longest draft.
        k_step = proposal_bucket(view.k_options, int(drafts.max(initial=0)))
        t = self.step_cost(view, k_step, int(view.n + drafts.sum()))
        return self.expected_tokens(view, k, rows) / max(t, 1e-12)

    def choose(self, view: BatchView) -> int:
        if view.draft_scores is not None and len(view.request_ids):
            self._scores = {r: sc for r, sc in zip(view.request_ids, view.draft_scores) if sc is not None}
        self._classes = (dict(zip(view.request_ids, view.draft_classes))
                         if view.draft_classes is not None and len(view.request_ids) else {})
        held = self._held(view)
        if held is not None:
            self._commit(held)
            return held
        rows = self.row_expected(view, max(view.k_options)) if view.n else None
        self.last_goodputs = {k: self.goodput(view, k, rows) for k in view.k_options}
        bar = self._bar(view, self.last_goodputs)
        best_k = self._pick(bar)
        self.want_k = self._wanted(view, bar[best_k]) if view.k_coming and view.n else 0
        self._row_k = None
        if self.per_request_k and view.n > 1 and len(view.request_ids) == view.n:
            best_k = self._choose_per_request(view, best_k, bar[best_k])
        if self.estimator == "confidence":
            self._gate_draft_call(view, best_k)
        self._commit(best_k)
        return best_k

    def _held(self, view: BatchView) -> int | None:
        """``hold_requests``, a lone request whose every K the backend runs in calls (a device
        head at batch 1): the K chosen when it arrived, from the acceptance pooled over the last
        ``HOLD_POOL`` verified drafts of all requests (each draft position's own rate,
        ``chain_rates``), held for its whole life (one long call
        after another, as a fixed K runs). Every ``probe_every``-th request in a row held at K = 0
        gets the best K > 0 instead, so the pool stays current. None: choose per step."""
        if not (self.hold_requests and view.n == 1 and len(view.request_ids) == 1
                and all(k in view.call_ks for k in view.k_options)):
            return None
        rid = view.request_ids[0]
        if rid != self._held_rid:
            rates = chain_rates(self._pool, max(view.k_options), self.acc.prior_alpha, self.acc.prior_weight)
            gps = {k: expected_len_from_positions(rates, k) / max(self.step_cost(view, k), 1e-12)
                   for k in view.k_options}
            self.last_goodputs = gps
            bar = self._bar(view, gps)
            k = self._pick(bar)
            self._plain_requests = self._plain_requests + 1 if k == 0 else 0
            if k == 0 and self._plain_requests > self.probe_every:
                k, self._plain_requests = max((k for k in view.k_options if k), key=lambda k: gps[k], default=0), 0
            self._held_rid, self._held_k = rid, k
            # (a K still compiling that would beat it: the backend builds it first, for the next request)
            self.want_k = self._wanted(view, bar[k]) if view.k_coming else 0
        return self._held_k

    def could_pay(self, view: BatchView) -> bool:
        """Whether some K > 0 (compiled or coming) would beat K = 0 (by ``min_gain``) on this batch
        even if every draft were accepted: the ceiling no acceptance estimate can pass. A draft
        as costly as the target never gets there, so its requests need no draft prefill and no
        probe (the prefill gate's probes and first admissions cost a batch job with such a draft
        about 3 s of prefill in 90, for nothing to learn)."""
        ks = sorted({k for k in (*view.k_options, *view.k_coming) if k > 0})
        if not ks or view.n == 0:
            return bool(ks)
        full = dataclasses.replace(view, k_options=(0, *ks), draft_lens=None, drafted_ahead=0)
        plain = view.n / max(self.step_cost(full, 0), 1e-12) * (1.0 + self.min_gain)
        return any(view.n * (k + 1) / max(self.step_cost(full, k, view.n * (k + 1)), 1e-12) > plain for k in ks)

    def _bar(self, view: BatchView, goodputs: dict) -> dict:
        """The goodputs the choice compares: K = 0's raised by ``min_gain``; a K > 0 the backend runs
        in calls (``view.call_ks``) raised by half of it, as choosing it ends no K = 0 decode call
        (the margin's other reason, the estimates' own errors, stays); the others as estimated."""
        m = self.min_gain
        return {k: g * (1.0 + m) if k == 0 else g * (1.0 + m / 2) if k in view.call_ks else g
                for k, g in goodputs.items()}

    def _pick(self, bar: dict) -> int:
        """The K to run among ``bar``'s (``_bar``): from the smallest up, a larger K replaces the
        one held only where its goodput beats it by half of ``min_gain`` (K = 0's own margin is
        in its bar already). A deeper draft's gain rests on the least certain estimates (its
        position's acceptance, seen least often; a step of more rows and draft forwards, whose
        cost in calls the profile measured alone): EAGLE on chat in int8 ran K = 2 for 1.55
        tokens a step, 2-4% slower than a fixed K = 1 (1.42)."""
        best = None
        for k in sorted(bar):
            if best is None or bar[k] > bar[best] * (1.0 + (self.min_gain / 2 if best else 0.0)):
                best = k
        return best

    def _wanted(self, view: BatchView, best: float) -> int:
        """The K of ``view.k_coming`` whose estimated goodput beats ``best`` (the compiled
        options' best, K = 0's with its ``min_gain``) the most, else 0."""
        full = dataclasses.replace(view, k_options=tuple(sorted({*view.k_options, *view.k_coming})))
        rows = self.row_expected(full, max(full.k_options))
        gps = {k: self.goodput(full, k, rows) for k in view.k_coming}
        k = max(gps, key=lambda k: (gps[k], -k))
        return k if gps[k] > best * (1.0 + 1e-9) else 0

    def _commit(self, k: int) -> None:
        """The same K chosen again and again: commit to a run of its steps that doubles with every
        such choice (1, 2, 4, ...; the backend's decode_steps caps it), so the engine runs them as
        one device call with no proposal, choice or host round trip per step, as plain decoding
        does (K > 0: where the backend can, a device drafter's steps). For K = 0 (a drafter that
        finds nothing on this text) only a K > 0 step that paid (``observe_time``) restarts the
        run at one step: where speculation pays, a choice is due every step. One that did not
        (the rare draft of open-ended text, mostly rejected) leaves the run's length, else every
        such step would cost a ramp of short calls, each paying a call's fixed cost over few
        tokens. A K > 0 run ends when another K is chosen; each call's steps are observed before
        the next choice, so an acceptance that falls turns the choice at the call's end."""
        if k == 0:
            self._plain_run, self._run = self._plain_run + 1, (0, 0)
            self.call_steps = 1 << min(self._plain_run - 1, 16)
            return
        self._run = (k, self._run[1] + 1 if self._run[0] == k else 1)
        self.call_steps = 1 << min(self._run[1] - 1, 16)

    def _gate_draft_call(self, view: BatchView, best_k: int) -> None:
        """Draft ahead next step only where a moving-average choice with the drafts made inside
        the step (nothing sunk yet) would speculate, and not for ``reprobe_after`` steps after
        ``window / 4`` draft calls in a row whose confidences all said K = 0 (a draft that is
        confident too rarely: alpha is never observed then, so the moving average cannot say)."""
        self._steps += 1
        if view.confidences is not None:
            self._ahead_wasted = self._ahead_wasted + 1 if best_k == 0 else 0
            if self._ahead_wasted >= max(2, self.acc.window // 4):
                self._closed_until, self._ahead_wasted = self._steps + self.reprobe_after, 0
        if view.confidences is None and not view.drafted_ahead:
            gps = self.last_goodputs  # this step already chose from the moving average
        else:
            ma = dataclasses.replace(view, confidences=None, drafted_ahead=0)
            gps = {k: self.goodput(ma, k) for k in view.k_options}
        bar = self._bar(view, gps)
        ma_best = self._pick(bar)
        self._draft_ahead = self._steps >= self._closed_until and ma_best > 0

    def _choose_per_request(self, view: BatchView, best_k: int, best: float) -> int:
        """Request-level K: for each token budget (a packed size or a full block), give the
        drafts to the requests whose next draft adds the most expected tokens (greedy over the
        marginal gains, each request's drafts in order), and keep the allocation whose goodput
        beats the batch-level choice (``best``: its goodput as compared, see ``_bar``)."""
        kmax = max(view.k_options)
        rows = self.row_expected(view, kmax)
        budgets = sorted({t for k in view.k_options for t in view.token_options.get(k, ())}
                         | {view.bucket * (k + 1) for k in view.k_options if k > 0})
        for budget in budgets:
            m = _allocate(rows, budget - view.n)
            k_step = proposal_bucket(view.k_options, max(m, default=0))
            if k_step == 0:
                continue
            gp = sum(float(e[j]) for e, j in zip(rows, m)) / max(self.step_cost(view, k_step, view.n + sum(m)), 1e-12)
            if gp > best * (1.0 + 1e-9):
                best, best_k, self._row_k = gp, k_step, dict(zip(view.request_ids, m))
        return best_k

    def row_drafts(self, view: BatchView, k: int) -> list[int] | None:
        if self._row_k is None:
            return None
        return [min(k, self._row_k.get(r, k)) for r in view.request_ids]

    def observe(self, k, drafted, accepted, request_ids=(), classes=None, scores=None):
        """Record a verify step. Steps with K = 0 teach nothing about acceptance (unless the
        engine shadow-verifies host drafts), so after ``reprobe_after`` of them in a row the
        acceptance window is emptied: the estimate is the prior again for one decision, the
        next speculative step's real observation then dominates the window. A device drafter
        whose alpha once read ~0 is thus re-tried about once per ``reprobe_after`` steps
        (measured acceptance can change as requests change) instead of never again."""
        if k > 0 and np.sum(drafted) > 0:
            self._stale = 0
            if classes is None:  # the step's own verification (not a shadow-verified proposal)
                self._accepted = int(np.sum(accepted))
                if self.hold_requests:
                    self._pool.extend((int(a), int(e)) for a, e, d in zip(accepted, examined(drafted, accepted), drafted)
                                      if d > 0)
                if self._classes:
                    classes = [self._classes.get(r) for r in request_ids]
            self.acc.observe(drafted, accepted, k, request_ids, classes)
            if scores is None:
                scores = [self._scores.get(r) for r in request_ids]
            for sc, d, a in zip(scores, drafted, accepted):  # the first d nodes were verified
                if sc is not None and d > 0:
                    self.score_calibration.observe(sc, int(d), int(a))
            return
        self._stale += 1
        if self._stale >= self.reprobe_after:
            self._stale = 0
            self.acc.reprobe()

    def finish(self, rid):
        self.acc.forget(rid)
        self._scores.pop(rid, None)
        self._classes.pop(rid, None)
        if rid == self._held_rid:  # (the next request chooses again, whatever id it is given: each run numbers from 0)
            self._held_rid = None


def _allocate(rows: Sequence[np.ndarray], budget: int) -> list[int]:
    """Draft counts per request maximising the summed expected tokens within ``budget`` drafts:
    repeatedly the request whose next draft has the largest positive marginal gain (rows[i][m]:
    request i's expectation with m drafts)."""
    m = [0] * len(rows)
    heap = [(-(e[1] - e[0]), i) for i, e in enumerate(rows) if len(e) > 1]
    heapq.heapify(heap)
    while budget > 0 and heap:
        g, i = heapq.heappop(heap)
        if -g <= 0:
            break
        m[i] += 1
        budget -= 1
        if m[i] + 1 < len(rows[i]):
            heapq.heappush(heap, (-(rows[i][m[i] + 1] - rows[i][m[i]]), i))
    return m


class DraftPrefillGate:
    """Prefill disabling (seed 000 §5): a new request skips the draft model's prefill, and is
    served without speculation for its whole life, when more than ``threshold`` of the last
    ``window`` steps in which some request could draft proposed nothing.

    Steps where no running request could draft (all admitted without their draft) are not
    counted: they say nothing about whether drafting pays, and counting them kept a closed gate
    closed for good. After ``reopen_after`` refusals in a row one request is admitted with its
    draft anyway, a probe whose steps tell the policy (and the gate) whether drafting pays now.
    Each probe that leaves the gate closed doubles the refusals before the next, up to
    ``max_reopen_after`` (a batch job where drafting never pays paid a draft prefill for one
    request in nine: 2-3% of a layer-skip job's throughput); the gate opening resets them."""

    def __init__(self, threshold: float = 0.7, window: int = 32, reopen_after: int = 8, max_reopen_after: int = 64):
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"prefill-disable threshold must be in [0, 1], got {threshold}")
        if reopen_after < 1:
            raise ValueError(f"reopen_after must be >= 1, got {reopen_after}")
        self.threshold = threshold
        self.reopen_after = reopen_after
        self.max_reopen_after = max(max_reopen_after, reopen_after)
        self._spacing = reopen_after  # refusals before the next probe
        self._ks: collections.deque = collections.deque(maxlen=window)
        self._refused = 0

    def record(self, k: int, could_draft: bool = True) -> None:
        if could_draft:
            self._ks.append(int(k))

    def speculate(self) -> bool:
        if not self._ks or sum(k == 0 for k in self._ks) / len(self._ks) <= self.threshold:
            self._refused, self._spacing = 0, self.reopen_after
            return True
        self._refused += 1
        if self._refused > self._spacing:
            self._refused, self._spacing = 0, min(2 * self._spacing, self.max_reopen_after)
            return True
        return False
