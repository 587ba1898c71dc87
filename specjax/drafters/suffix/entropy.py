"""Empirical entropy of a workload's outputs (SuffixDecoding, appendix): will suffix trees help?

Build a suffix tree from sample outputs (about 100 are enough), take the distribution
of next tokens at every node (how often each child follows it) and average the node
entropies, weighted by how many continuations each node has seen. Low entropy means
outputs are predictable from their recent tokens: suffix decoding should do well.

Choices, stated: only nodes that have seen at least two continuations count (a string
seen once predicts its single successor perfectly and says nothing about the
workload), and the root (the unigram distribution, never used to speculate) is left
out. Entropy is in bits.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from specjax.drafters.suffix import kernels as K
from specjax.drafters.suffix.trie import SuffixTrie


def node_entropies(trie: SuffixTrie) -> tuple[np.ndarray, np.ndarray]:
    """(entropy in bits, continuations seen) for every non-root node with >= 2 continuations."""
    n = int(trie._meta[K.M_NODES])
    rows = trie._nodes[1:n]
    live = rows[:, K.DEP] > 0
    par = rows[live, K.PAR].astype(np.int64)
    cnt = np.where(rows[live, K.RSID] >= 0, 1, rows[live, K.CNT]).astype(np.float64)
    keep = par != 0  # children of the root belong to the root's (excluded) distribution
    par, cnt = par[keep], cnt[keep]
    total = np.bincount(par, weights=cnt, minlength=n)
    plogp = np.bincount(par, weights=cnt * np.log2(cnt), minlength=n)
    nodes = np.nonzero(total >= 2)[0]
    t = total[nodes]
    return np.log2(t) - plogp[nodes] / t, t


def empirical_entropy(outputs: Iterable[Sequence[int]], max_depth: int = 64) -> dict:
    """Weighted mean node entropy of the outputs' suffix tree, with the counts behind it."""
    trie = SuffixTrie(max_depth)
    n_seq = 0
    for out in outputs:
        if len(out):
            trie.add(out)
            n_seq += 1
    h, w = node_entropies(trie)
    mean = float((h * w).sum() / w.sum()) if len(w) else float("nan")
    return {"sequences": n_seq, "tokens": trie.num_tokens, "nodes": int(len(w)), "mean_entropy_bits": mean}
