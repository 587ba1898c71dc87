"""Brute-force definition of the suffix trie's counts and speculation (the tests' oracle).

No index at all: a string's count is found by scanning every stored sequence for
its occurrences. The expansion below is Algorithm 1 of SuffixDecoding written
plainly (heapq, best D(N) first, ties to the earlier push, children pushed in token
order); `kernels.py` must produce exactly the same drafts.
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence


class BruteSuffixIndex:
    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.seqs: dict[int, list[int]] = {}
        self._next = 0

    def add(self, tokens: Sequence[int] = ()) -> int:
        sid = self._next
        self._next += 1
        self.seqs[sid] = [int(t) for t in tokens]
        return sid

    def extend(self, sid: int, tokens: Sequence[int]) -> None:
        self.seqs[sid].extend(int(t) for t in tokens)

    def remove(self, sid: int) -> None:
        del self.seqs[sid]

    def count(self, pattern: Sequence[int]) -> int:
        pat = list(pattern)
        n = len(pat)
        if n > self.max_depth:
            return 0
        if n == 0:  # the root: one suffix starts at every stored token
            return sum(len(s) for s in self.seqs.values())
        return sum(1 for s in self.seqs.values() for i in range(len(s) - n + 1) if s[i:i + n] == pat)

    def children(self, pattern: Sequence[int]) -> list[tuple[int, int]]:
        """(token, count) of every one-token extension that is stored, by token."""
        pat = list(pattern)
        n = len(pat)
        if n + 1 > self.max_depth:
            return []
        found: dict[int, int] = {}
        for s in self.seqs.values():
            for i in range(len(s) - n):
                if s[i:i + n] == pat:
                    found[s[i + n]] = found.get(s[i + n], 0) + 1
        return sorted(found.items())

    def all_strings(self) -> dict[tuple[int, ...], int]:
        out: dict[tuple[int, ...], int] = {}
        for s in self.seqs.values():
            for i in range(len(s)):
                for j in range(i + 1, min(len(s), i + self.max_depth) + 1):
                    key = tuple(s[i:j])
                    out[key] = out.get(key, 0) + 1
        return out

    def expand(self, pattern, budget: int, min_prob: float, tree: bool):
        """(tokens, parents, probs, score) of the expansion under `pattern`'s node."""
        toks, pars, probs = [], [], []
        if budget <= 0:
            return toks, pars, probs, 0.0
        if not tree:
            path, prob, par = list(pattern), 1.0, -1
            while len(toks) < budget:
                ch = self.children(path)
                if not ch:
                    break
                tok, cnt = max(ch, key=lambda tc: (tc[1], -tc[0]))  # most frequent, then lower token
                p = prob * cnt / self.count(path)
                if p < min_prob:
                    break
                toks.append(tok), pars.append(par), probs.append(p)
                par, prob, path = len(toks) - 1, p, path + [tok]
            return toks, pars, probs, sum(probs)
        heap, pushes = [], 0
        path, prob, par = list(pattern), 1.0, -1
        while True:
            denom = self.count(path)
            for tok, cnt in self.children(path):
                p = prob * cnt / denom
                if p >= min_prob:
                    heapq.heappush(heap, (-p, pushes, tok, par, path + [tok]))
                    pushes += 1
            if len(toks) >= budget or not heap:
                break
            negp, _, tok, parent, path = heapq.heappop(heap)
            prob = -negp
            toks.append(tok), pars.append(parent), probs.append(prob)
            par = len(toks) - 1
            if len(toks) >= budget:
                break
        return toks, pars, probs, sum(probs)

    def speculate(self, context, *, max_spec: int, alpha: float = 1.0, offset: float = 0.0,
                  min_prob: float = 0.1, tree: bool = True, max_pattern: int | None = None):
        """(tokens, parents, probs, score, match_len): best over p, ties to the longer match."""
        best = ([], [], [], 0.0, 0)
        if max_spec <= 0 or not any(self.seqs.values()):
            return best
        P = min(self.max_depth - 1, max_pattern or self.max_depth)
        ctx = list(context)[-P:] if P > 0 else []
        for p in range(1, min(P, len(ctx)) + 1):
            pat = ctx[len(ctx) - p:]
            if self.count(pat) == 0:
                break
            budget = min(max_spec, int(math.floor(alpha * p + offset)))
            toks, pars, probs, score = self.expand(pat, budget, min_prob, tree)
            if toks and (score > best[3] or (score == best[3] and p > best[4])):
                best = (toks, pars, probs, score, p)
        return best
