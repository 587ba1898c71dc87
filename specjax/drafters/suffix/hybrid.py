"""Hybrid SuffixDecoding: use the suffix draft when its score is high enough, else another drafter.

SCORE(T) estimates the expected number of accepted tokens of the suffix draft, so
the paper's rule is: if SCORE > tau use it, otherwise fall back. tau near the
fallback's mean accepted tokens suits mixed workloads; tau = 0 means suffix
whenever it has anything. The fallback here is any host drafter (prompt lookup);
a device drafter (draft model, layer skip) as fallback is not built.
"""

from __future__ import annotations

import numpy as np

from specjax.drafters.suffix.drafter import SuffixDrafter
from specjax.errors import require


class HybridDrafter:
    def __init__(self, suffix: SuffixDrafter, fallback, tau: float = 1.0):
        require(tau >= 0, f"hybrid tau must be >= 0, got {tau}")
        require(not getattr(fallback, "proposes_trees", False), "the hybrid fallback must propose chains")
        self.suffix, self.fallback, self.tau = suffix, fallback, float(tau)
        self.used = {"suffix": 0, "fallback": 0}  # steps that drafted from each source
        self._from_fallback: dict = {}  # row -> whether its last proposal was the fallback's

    @property
    def proposes_trees(self) -> bool:
        return self.suffix.proposes_trees

    def forget_outputs(self) -> None:
        self.suffix.forget_outputs()

    def start(self, row, tokens):
        self.suffix.start(row, tokens)
        self.fallback.start(row, tokens)

    def extend(self, row, tokens):
        self.suffix.extend(row, tokens)
        self.fallback.extend(row, tokens)

    def finish(self, row):
        self.suffix.finish(row)
        self.fallback.finish(row)
        self._from_fallback.pop(row, None)

    def _pick(self, row, k, tree):
        d = self.suffix.draft(row, k, tree=tree)
        self._from_fallback[row] = False
        if len(d) and d.score > self.tau:
            self.used["suffix"] += 1
            return d.parents, d.tokens, d.probs
        self._from_fallback[row] = True
        toks = np.asarray(self.fallback.propose(row, k), np.int32)
        if len(toks):
            self.used["fallback"] += 1
        return np.arange(-1, len(toks) - 1, dtype=np.int32), toks, None  # a chain, no estimates

    def propose(self, row, k):
        return self._pick(row, k, tree=False)[1]

    def draft_class(self, row):
        """The fallback's class of a fallback proposal (a suffix draft carries its own scores)."""
        if self._from_fallback.get(row) and hasattr(self.fallback, "draft_class"):
            return self.fallback.draft_class(row)
        return None

    def propose_tree(self, row, max_nodes):
        return self._pick(row, max_nodes, tree=None)
