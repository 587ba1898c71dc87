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
from typing import Hashable, Sequence

import numpy as np

from specjax.buckets import proposal_bucket
from specjax.goodput.acceptance import AcceptanceEstimator, MovingAverage, confidence_lengths, expected_len
from specjax.goodput.perf_model import StepCostModel


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
    """

    ctx_lens: Sequence[int]
    bucket: int
    k_options: Sequence[int]
    request_ids: Sequence[Hashable] = ()
    draft_lens: Sequence[int] | None = None
    confidences: np.ndarray | None = None
    true_accept: Sequence[int] | None = None
    draft_scores: Sequence[np.ndarray | None] | None = None

    @property
    def n(self) -> int:
        return len(self.ctx_lens)


class Policy:
    name = "policy"
    may_speculate = True  # False: never drafts, so a request needs no draft-model prefill either

    def choose(self, view: BatchView) -> int:
        raise NotImplementedError

    def observe(self, k: int, drafted: Sequence[int], accepted: Sequence[int], request_ids=()) -> None:
        """Feedback after the verify step (Algorithm 2 line 13-14)."""

    def finish(self, rid: Hashable) -> None:
        pass


class FixedK(Policy):
    """The baselines: K drafts every step (K = 0: no speculation). For host drafters the
    engine still shrinks the block to the longest proposal (a bucket holding it)."""

    def __init__(self, k: int):
        self.k = int(k)
        self.name = "no-SD" if k == 0 else f"K={k}"
        self.may_speculate = self.k > 0

    def choose(self, view: BatchView) -> int:
        if self.k not in view.k_options:
            raise ValueError(f"K={self.k} is not compiled for bucket {view.bucket}: {list(view.k_options)}")
        return self.k


class GoodputPolicy(Policy):
    """SmartSpec: argmax over compiled K of estimated goodput.

    estimator: "moving_average" (Algorithms 1-2; per request if ``per_request``),
      "confidence" (Algorithm 3: a request's accepted drafts are predicted as its leading run of
      draft confidences above ``threshold``; needs ``view.confidences``), or "oracle" (simulator:
      the true accepted lengths, the paper's 'optimal' curve).
    """

    def __init__(self, cost: StepCostModel, estimator: str = "moving_average", window: int = 16,
                 prior_alpha: float = 0.5, per_request: bool = False, threshold: float = 0.5,
                 name: str | None = None, reprobe_after: int | None = None):
        if estimator not in ("moving_average", "confidence", "oracle"):
            raise ValueError(f"unknown goodput estimator {estimator!r}")
        self.cost = cost
        self.estimator = estimator
        self.acc = AcceptanceEstimator(window, prior_alpha, per_request)
        self.threshold = threshold
        self.reprobe_after = reprobe_after if reprobe_after is not None else 4 * window
        self.name = name or {"moving_average": "SmartSpec", "confidence": "SmartSpec-conf",
                             "oracle": "oracle"}[estimator]
        self.last_goodputs: dict[int, float] = {}
        self._stale = 0
        # Drafter scores (tree drafters' node probabilities) are calibrated online like alpha:
        # the moving average of accepted / predicted accepted drafts scales every prediction.
        self.score_calibration = MovingAverage(window, 1.0)
        self._scores: dict = {}  # request id -> the node probabilities of its last proposal

    def expected_tokens(self, view: BatchView, k: int) -> float:
        """Expected generated tokens of the batch with K drafts (bonus tokens included)."""
        n = view.n
        if k == 0 or n == 0:
            return float(n)
        lens = np.minimum(np.asarray(view.draft_lens), k) if view.draft_lens is not None else np.full(n, k)
        if self.estimator == "oracle":
            return float(np.sum(1 + np.minimum(np.asarray(view.true_accept), lens)))
        if self.estimator == "confidence" and view.confidences is not None:
            pred = confidence_lengths(view.confidences, self.threshold)
            return float(np.sum(1 + np.minimum(pred, lens)))
        if self.acc.per_request and len(view.request_ids):
            alphas = [self.acc.request_alpha(r) for r in view.request_ids]
        else:
            alphas = [self.acc.alpha.value] * n
        if view.draft_lens is not None:
            scores = view.draft_scores if view.draft_scores is not None else [None] * n
            c = self.score_calibration.value
            return float(sum(1.0 + min(c * float(np.sum(sc[:int(m)])), float(m)) if sc is not None
                             else expected_len(a, int(m)) for a, m, sc in zip(alphas, lens, scores)))
        rho = self.acc.rho.value  # device drafters always propose (rho = 1 once observed)
        return float(sum(1.0 + rho * (expected_len(a, k) - 1.0) for a in alphas))

    def goodput(self, view: BatchView, k: int) -> float:
        """Algorithm 1: generated length / batch execution time."""
        k_step = k
        if view.draft_lens is not None and k > 0:
            # Host drafts shrink the block to the smallest compiled K holding the longest one.
            longest = int(min(max(view.draft_lens, default=0), k))
            k_step = proposal_bucket(view.k_options, longest)
        t = self.cost.step_time(view.bucket, k_step, view.ctx_lens)
        return self.expected_tokens(view, k) / max(t, 1e-12)

    def choose(self, view: BatchView) -> int:
        if view.draft_scores is not None and len(view.request_ids):
            self._scores = {r: sc for r, sc in zip(view.request_ids, view.draft_scores) if sc is not None}
        self.last_goodputs = {k: self.goodput(view, k) for k in view.k_options}
        return max(view.k_options, key=lambda k: (self.last_goodputs[k], -k))  # ties: the smaller K

    def observe(self, k, drafted, accepted, request_ids=()):
        """Record a verify step. Steps with K = 0 teach nothing about acceptance (unless the
        engine shadow-verifies host drafts), so after ``reprobe_after`` of them in a row the
        acceptance window is emptied: the estimate is the prior again for one decision, the
        next speculative step's real observation then dominates the window. A device drafter
        whose alpha once read ~0 is thus re-tried about once per ``reprobe_after`` steps
        (measured acceptance can change as requests change) instead of never again."""
        if k > 0 and np.sum(drafted) > 0:
            self._stale = 0
            self.acc.observe(drafted, accepted, k, request_ids)
            self._calibrate_scores(drafted, accepted, request_ids)
            return
        self._stale += 1
        if self._stale >= self.reprobe_after:
            self._stale = 0
            self.acc.alpha = MovingAverage(self.acc.window, self.acc.alpha.prior)

    def _calibrate_scores(self, drafted, accepted, request_ids) -> None:
        """accepted / predicted over the rows whose drafts carried scores (the first ``drafted``
        nodes of the scored proposal were verified, for real or in the shadow)."""
        pred = got = 0.0
        for rid, d, a in zip(request_ids, drafted, accepted):
            sc = self._scores.get(rid)
            if sc is not None and d > 0:
                pred += float(np.sum(sc[:int(d)]))
                got += float(a)
        if pred > 0:
            self.score_calibration.add(got / pred)

    def finish(self, rid):
        self.acc.forget(rid)
        self._scores.pop(rid, None)


class DraftPrefillGate:
    """Prefill disabling (seed 000 §5): a new request skips the draft model's prefill, and is
    served without speculation for its whole life, when more than ``threshold`` of the last
    ``window`` steps proposed nothing."""

    def __init__(self, threshold: float = 0.7, window: int = 32):
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"prefill-disable threshold must be in [0, 1], got {threshold}")
        self.threshold = threshold
        self._ks: collections.deque = collections.deque(maxlen=window)

    def record(self, k: int) -> None:
        self._ks.append(int(k))

    def speculate(self) -> bool:
        if not self._ks:
            return True
        return sum(k == 0 for k in self._ks) / len(self._ks) <= self.threshold
