"""Tree masks for a verification block, and the check that a mask really is one.

A block of N new tokens is a token tree in topological order: node 0 is the root (the
last accepted token), every other node's parent comes before it. Its ancestor mask
``mask[i, j]`` is True when node j is node i itself or one of its ancestors; a causal
chain is the path tree. Kernels trust the mask they get, so callers with a mask built
elsewhere can check it here first (host side, numpy).
"""

from __future__ import annotations

import numpy as np


def mask_from_parents(parents) -> np.ndarray:
    """Ancestor mask [N, N] (or [B, N, N] for [B, N] parents) from a parents array.

    parents[0] must be -1 (the root); parents[i] must be in [0, i) for i > 0."""
    p = np.asarray(parents)
    if p.ndim == 2:
        return np.stack([mask_from_parents(row) for row in p])
    if p.ndim != 1 or p.size == 0:
        raise ValueError(f"parents must be a non-empty [N] or [B, N] array, got shape {p.shape}")
    n = p.size
    if p[0] != -1:
        raise ValueError(f"parents[0] must be -1 (node 0 is the root), got {p[0]}")
    mask = np.zeros((n, n), bool)
    mask[0, 0] = True
    for i in range(1, n):
        if not 0 <= p[i] < i:
            raise ValueError(f"parents[{i}] = {p[i]}: a parent must come before its child (0 <= parent < {i})")
        mask[i] = mask[p[i]]
        mask[i, i] = True
    return mask


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
