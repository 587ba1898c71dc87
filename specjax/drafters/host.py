"""Host drafters in the engine: proposals made on the host from each request's tokens.

``HostChain`` wraps a ``base.HostDrafter`` (prompt lookup, suffix trees in path mode): it
proposes up to the largest K for every request before the policy chooses; the step then runs
the smallest compiled block that holds the longest draft cut to K (``be.shrink_to_proposal``
False: always the chosen K, for measuring a fixed block's cost). ``HostTree`` wraps one with
``propose_tree`` (SuffixDecoding in tree mode, hybrid): K is then the node budget, a tree is cut
to its first K nodes (nodes are topologically ordered, so any prefix is a tree) and verified by
the tree step.
"""

from __future__ import annotations

import numpy as np

from specjax import buckets as bk
from specjax import tree
from specjax.drafters.protocol import TREE, Drafter, StepInputs, tree_inputs
from specjax.serving_types import Proposal


class HostChain(Drafter):
    def __init__(self, host):
        self.host = host  # start / extend / propose / finish per request (base.HostDrafter)
        self._drafts: dict = {}  # uid -> the last proposal

    def reset(self):
        self._drafts = {}

    def start(self, uid, prompt):
        self.host.start(uid, prompt)

    def extend(self, uid, tokens):
        self.host.extend(uid, tokens)

    def finish(self, uid):
        self.host.finish(uid)
        self._drafts.pop(uid, None)

    def forget_outputs(self):
        forget = getattr(self.host, "forget_outputs", None)
        if forget is not None:
            forget()

    def _propose_one(self, uid, k: int):
        return np.asarray(self.host.propose(uid, k), np.int32)

    def propose(self, be, rs, k_max, threshold=None):
        self._drafts = {r.uid: self._propose_one(r.uid, k_max) if k_max > 0 else np.zeros(0, np.int32) for r in rs}
        drafts = [self._drafts[r.uid] for r in rs]
        lens = [len(d) for d in drafts]
        scores = [d.probs if isinstance(d, tree.DraftTree) else None for d in drafts]
        cls_of = getattr(self.host, "draft_class", None)
        classes = [cls_of(r.uid) if n else None for r, n in zip(rs, lens)] if cls_of and k_max > 0 else []
        return Proposal(draft_lens=lens, drafts=drafts,
                        draft_scores=scores if any(x is not None for x in scores) else None,
                        draft_classes=classes if any(c is not None for c in classes) else None)

    def _cut(self, be, k: int, cap: dict) -> tuple[dict, int]:
        """Each request's proposal cut to its cap, and the K the step runs."""
        cut = {u: d[:cap[u]] for u, d in self._drafts.items() if u in cap}
        longest = max((len(d) for d in cut.values()), default=0)
        return cut, bk.proposal_bucket(be.k_options(be.B), longest) if be.shrink_to_proposal else k

    def step_inputs(self, be, rs, k, cap):
        cut, k_step = self._cut(be, k, cap)
        tokens = np.zeros((be.B, max(k_step, 1)), np.int32)
        num_draft = np.zeros(be.B, np.int32)
        for u, d in cut.items():
            row = be.row_of[u]
            tokens[row, :len(d)] = d
            num_draft[row] = len(d)
        return StepInputs(self.step, k_step, num_draft, (tokens,))


class HostTree(HostChain):
    step = TREE

    def _propose_one(self, uid, k):
        # (parents, tokens) or (parents, tokens, node probabilities) for drafters that estimate
        # their acceptance (SuffixDecoding): the goodput policy's predictor
        t = self.host.propose_tree(uid, k)
        probs = None if len(t) < 3 or t[2] is None else np.asarray(t[2], np.float64)
        return tree.DraftTree(np.asarray(t[0], np.int32), np.asarray(t[1], np.int32), probs)

    def step_inputs(self, be, rs, k, cap):
        cut, k_step = self._cut(be, k, cap)
        inputs = tree_inputs(be.B, k_step, cut, be.row_of)
        return StepInputs(self.step, k_step, inputs[2][:, 1:].sum(axis=1).astype(np.int32), inputs)


def host_drafter(host) -> HostChain:
    """A host drafter as the engine runs it: token trees when it has ``propose_tree`` (unless it
    says ``proposes_trees = False``, as SuffixDrafter in path mode does), else chains."""
    trees = getattr(host, "proposes_trees", hasattr(host, "propose_tree"))
    return (HostTree if trees else HostChain)(host)
