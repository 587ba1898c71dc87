"""SuffixDecoding's hybrid with a feature head as its fallback (``--drafter hybrid_eagle``).

The suffix trees propose a chain for every row on the host (path mode); a row whose proposal
scores above ``tau`` verifies it, every other row verifies the head's drafts, all in one chain
step: the head drafts inside the step for every row when any row needs its drafts, not at all
when none does, and the step takes the host chains for the rows marked by
``draft_tokens[:, 0] >= 0`` (``HostRows``, the head's step hooks; a deterministic draft's q is
one-hot, so sampling stays lossless). In a step where the head drafted, it catches up on each row's verified
block whoever drafted it; a step whose rows all took suffix chains runs none of the head (no
settle, drafting or catch-up) and defers its committed block to the head's lag window, as plain
steps do, so the head catches up in one block when the window fills or before it next drafts.

Repetitive requests (a long suffix match) then get suffix drafts at no cost per token, open-ended
ones the head's; a row neither can help drafts nothing when the policy says so.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax import buckets as bk
from specjax.drafters.device import FeatureHeadDraft, FeatureHeadDrafter
from specjax.drafters.eagle import EagleDraft
from specjax.drafters.protocol import StepInputs
from specjax.errors import require
from specjax.serving_types import Proposal


class HostRows:
    """A feature head's chain step that also verifies host chains (mixed into the head's class:
    ``host_rows``): a row whose ``host_tokens[:, 0] >= 0`` verifies those (q one-hot: deterministic
    drafts), every other row the head's drafts. The head drafts (settle, K forwards) only when
    some drafting row needs its drafts (``lax.cond``); after the step it catches up on each row's
    verified block whoever drafted it, or, when it drafted nothing, defers the committed block to
    its lag window as K + 1 plain steps would (the catch-up overwrites what drafting writes to its
    cache, so skipping leaves the same state)."""

    def chain_drafts(self, dparams, dcache, state, host_tokens, num_draft, active, K, samp, greedy_only):
        host = host_tokens[:, 0] >= 0
        need_head = jnp.any(active & (num_draft > 0) & ~host)

        def head(dc):
            dc = self.settle(dparams, dc)
            toks, q, drafted = self.draft(dparams, dc, state.prev, state.pending, state.cache.lengths, K, samp,
                                          greedy_only)
            return toks, q, drafted, dc.feat

        made = jax.eval_shape(head, dcache)[:2]

        def skip(dc):
            return (*jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), made), dc, dc.feat)

        toks, q, dcache, feat0 = jax.lax.cond(need_head, head, skip, dcache)
        toks = jnp.where(host[:, None], host_tokens, toks)
        if q is not None:
            q = jnp.where(host[:, None, None], jax.nn.one_hot(host_tokens, q.shape[-1], dtype=q.dtype), q)
        return toks, q, dcache, (need_head, feat0)

    def after_chain(self, dparams, dcache, carry, block, feats, lengths, n_commit, active, K):
        if K == 0:
            return super().after_chain(dparams, dcache, carry, block, feats, lengths, n_commit, active, K)
        need_head, feat0 = carry

        def catch_up(dc):
            return self.catch_up(dparams, dc, feat0, block, feats, lengths, n_commit)

        def defer_block(dc):  # as K + 1 plain steps would: the head catches up when it next drafts
            for j in range(K + 1):
                dc = self.defer(dparams, dc, block[:, j], feats[:, j], active & (j < n_commit))
            return dc

        return jax.lax.cond(need_head, catch_up, defer_block, dcache)


@dataclasses.dataclass(frozen=True)
class HostRowsEagleDraft(HostRows, EagleDraft):
    """The EAGLE head with host rows (``SuffixHeadDrafter``'s compile-key part)."""


def host_rows(draft: FeatureHeadDraft) -> FeatureHeadDraft:
    """``draft`` (the EAGLE head) as a head whose chain step also verifies host chains."""
    require(type(draft) is EagleDraft, f"the head hybrid takes the EAGLE head, not {type(draft).__name__}")
    return HostRowsEagleDraft(**{f.name: getattr(draft, f.name) for f in dataclasses.fields(draft)})


class SuffixHeadDrafter(FeatureHeadDrafter):
    """``suffix``: a SuffixDrafter in path mode (chains); ``draft``, ``params``: the head."""

    fuses = False  # (each step's suffix chains come from the host)

    def __init__(self, suffix, draft, params, tau: float = 1.0):
        require(tau >= 0, f"hybrid tau must be >= 0, got {tau}")
        require(not suffix.proposes_trees, "the head hybrid takes the suffix trees' chains (path mode)")
        super().__init__(host_rows(draft), params)
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

    def forget_outputs(self):
        self.suffix.forget_outputs()

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
        # took suffix chains runs none of the head (HostRows.chain_drafts): it is costed as
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


def build(model, spec, draft=None) -> SuffixHeadDrafter:
    """The ``hybrid_eagle`` kind: suffix chains where they score above ``suffix_tau``, the EAGLE
    head elsewhere."""
    from specjax.drafters import eagle, suffix

    head = eagle.build(model, spec.eagle_head, activations=eagle.copies_activations(spec.fwd))
    sd = suffix.SuffixDrafter(dataclasses.replace(suffix.config_of(spec), tree=False),
                              history=suffix.history_of(spec, model.tokenizer))
    return SuffixHeadDrafter(sd, head.draft, head.params, tau=spec.suffix_tau)
