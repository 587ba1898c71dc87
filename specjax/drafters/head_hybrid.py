"""SuffixDecoding's hybrid with a feature head as its fallback (``--drafter hybrid_eagle``).

The suffix trees propose a chain for every row on the host (path mode); a row whose proposal
scores above ``tau`` verifies it, every other row verifies the head's drafts, all in one chain
step: the head drafts inside the step for every row when any row needs its drafts, not at all
when none does, and the step takes the host chains for the rows marked by
``draft_tokens[:, 0] >= 0`` (``ModelDraft.host_rows``; a deterministic draft's q is one-hot, so
sampling stays lossless). In a step where the head drafted, it catches up on each row's verified
block whoever drafted it; a step whose rows all took suffix chains runs none of the head (no
settle, drafting or catch-up) and defers its committed block to the head's lag window, as plain
steps do, so the head catches up in one block when the window fills or before it next drafts.

Repetitive requests (a long suffix match) then get suffix drafts at no cost per token, open-ended
ones the head's; a row neither can help drafts nothing when the policy says so.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from specjax import buckets as bk
from specjax.drafters.device import FeatureHeadDrafter
from specjax.drafters.protocol import StepInputs
from specjax.engine.loop import Proposal
from specjax.errors import require


class SuffixHeadDrafter(FeatureHeadDrafter):
    """``suffix``: a SuffixDrafter in path mode (chains); ``draft``, ``params``: the head."""

    def __init__(self, suffix, draft, params, tau: float = 1.0):
        require(tau >= 0, f"hybrid tau must be >= 0, got {tau}")
        require(not suffix.proposes_trees, "the head hybrid takes the suffix trees' chains (path mode)")
        super().__init__(dataclasses.replace(draft, host_rows=True), params)
        self.suffix, self.tau = suffix, float(tau)
        self.used = {"suffix": 0, "head": 0}  # rows that drafted from each source
        self.head_skipped = 0  # verify steps whose drafting rows all had suffix chains (the head did not draft)
        self._host: dict = {}  # uid -> this step's suffix chain (absent: the head drafts)

    def reset(self):
        super().reset()
        self._host = {}

    def start(self, uid, prompt):
        self.suffix.start(uid, prompt)

    def extend(self, uid, tokens):
        self.suffix.extend(uid, tokens)

    def finish(self, uid):
        self.suffix.finish(uid)
        self._host.pop(uid, None)

    def propose(self, be, rs, k_max, threshold=None):
        require(threshold is None, "the head hybrid drafts inside the step; confidence-based proposal "
                "(smartspec-conf) is not available for it")
        self._host = {}
        lens, scores = [], []
        for r in rs:
            d = self.suffix.draft(r.uid, k_max, tree=False) if k_max > 0 else None
            # (a request admitted without the head's cache, ``speculate`` False, still takes
            # suffix chains: they need nothing of the head, whose entries for it are never read)
            if d is not None and len(d) and d.score > self.tau:
                self._host[r.uid] = np.asarray(d.tokens, np.int32)
                lens.append(len(d.tokens))
                scores.append(np.asarray(d.probs, np.float64))
            else:
                lens.append(k_max if r.speculate else 0)
                scores.append(None)
        # For a goodput policy: a suffix chain is weighed by its node probabilities (as the
        # suffix drafter's are), calibrated against their real acceptance, and the head's drafts
        # by their class's alpha (a suffix chain weighed at the head's alpha was never verified);
        # the chains are host drafts too, shadow-verified while K = 0 runs, so that calibration
        # keeps learning (one rejected chain read 0 forever); and a step whose drafting rows all
        # took suffix chains runs none of the head (spec_step's hybrid branch): it is costed as
        # the verify alone.
        head_free = all(r.uid in self._host or not r.speculate for r in rs)
        none = np.zeros(0, np.int32)
        return Proposal(draft_lens=lens, drafts=[self._host.get(r.uid, none) for r in rs],
                        draft_scores=scores if self._host else None,
                        draft_classes=["suffix" if r.uid in self._host else "head" for r in rs],
                        draft_free=bool(self._host) and head_free)

    def step_inputs(self, be, rs, k, cap):
        num_draft = np.zeros(be.B, np.int32)
        host = {}
        for r in rs:
            row = be.row_of[r.uid]
            d = self._host.get(r.uid)
            if d is not None:
                host[row] = d[:cap[r.uid]]
                num_draft[row] = len(host[row])
            else:
                num_draft[row] = cap[r.uid] if r.speculate else 0
        k_step = bk.proposal_bucket(be.k_options(be.B), int(num_draft.max(initial=0)))
        tokens = np.full((be.B, max(k_step, 1)), -1, np.int32)  # (-1 first: the head's row)
        for row, d in host.items():
            tokens[row, :] = 0
            tokens[row, :len(d)] = d
            self.used["suffix"] += 1
        heads = int(sum(1 for r in rs if be.row_of[r.uid] not in host and num_draft[be.row_of[r.uid]]))
        self.used["head"] += heads
        self.head_skipped += int(k_step > 0 and heads == 0)
        return StepInputs(self.step, k_step, num_draft, (tokens,))
