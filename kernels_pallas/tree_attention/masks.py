"""Tree masks for a verification block, and the check that a mask really is one.

A block of N new tokens is a token tree in topological order: node 0 is the root (the
last accepted token), every other node's parent comes before it. Its ancestor mask
``mask[i, j]`` is True when node j is node i itself or one of its ancestors; a causal
chain is the path tree. Kernels trust the mask they get, so callers with a mask built
elsewhere can check it here first (host side, numpy).
"""

from __future__ import annotations

import numpy as np

from specjax.tree import ancestor_mask


def mask_from_parents(parents) -> np.ndarray:
    """Ancestor mask [N, N] (or [B, N, N] for [B, N] parents) from a parents array
    (parents[0] = -1, 0 <= parents[i] < i); the one definition lives in specjax.tree."""
    return ancestor_mask(parents)


def chain_mask(n: int) -> np.ndarray:
    return np.tril(np.ones((n, n), bool))


def check_tree_mask(mask) -> None:
    """Raise ValueError unless `mask` ([N, N] or [B, N, N]) is the ancestor mask of a tree
    in topological order rooted at node 0."""
    m = np.asarray(mask)
    if m.ndim == 3:
        for b in range(m.shape[0]):
            try:
                check_tree_mask(m[b])
            except ValueError as e:
                raise ValueError(f"row {b}: {e}") from None
        return
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(f"a tree mask must be square [N, N] (or [B, N, N]), got shape {m.shape}")
    m = m.astype(bool)
    n = m.shape[0]
    if not m.diagonal().all():
        raise ValueError(f"not a tree mask: node {int(np.argmin(m.diagonal()))} does not attend to itself")
    if np.triu(m, 1).any():
        i, j = np.argwhere(np.triu(m, 1))[0]
        raise ValueError(f"not a tree mask: node {i} attends to later node {j} (nodes must be in topological order)")
    for i in range(1, n):
        anc = np.flatnonzero(m[i, :i])
        if anc.size == 0 or anc[0] != 0:
            raise ValueError(f"not a tree mask: node {i} does not descend from the root (node 0)")
        parent = anc[-1]
        expected = m[parent].copy()
        expected[i] = True
        if not np.array_equal(m[i], expected):
            raise ValueError(f"not a tree mask: node {i}'s ancestors are not its parent {parent}'s ancestors "
                             f"plus the parent (a node with two parents?)")
