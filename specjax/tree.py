"""Token trees for speculative verification (host side, numpy).

A proposal tree is a parents array in topological order: node 0 is the root (the last
accepted token, not yet in the cache), ``parents[0] = -1`` and ``0 <= parents[i] < i``.
Node i runs at RoPE position ``seq_len + depth[i]`` and attends the row's prefix plus its
own ancestors (the ancestor mask). A chain of K drafts is the path tree ``[-1, 0, 1, ..]``.
Trees are padded to a node-count bucket with invalid nodes hung off the root: nobody
attends them and verification never accepts them, so one compiled variant serves every
tree up to that size.
"""

from __future__ import annotations

import dataclasses

import numpy as np


def validate_parents(parents) -> np.ndarray:
    p = np.asarray(parents, np.int64)
    if p.ndim != 1 or p.size == 0:
        raise ValueError(f"parents must be a non-empty [N] array, got shape {p.shape}")
    if p[0] != -1:
        raise ValueError(f"parents[0] must be -1 (node 0 is the root), got {p[0]}")
    for i in range(1, p.size):
        if not 0 <= p[i] < i:
            raise ValueError(f"parents[{i}] = {p[i]}: a parent must come before its child (0 <= parent < {i})")
    return p


def depths(parents) -> np.ndarray:
    p = validate_parents(parents)
    d = np.zeros(p.size, np.int32)
    for i in range(1, p.size):
        d[i] = d[p[i]] + 1
    return d


def ancestor_mask(parents) -> np.ndarray:
    """[N, N] bool: mask[i, j] is True when j is i or an ancestor of i ([B, N] -> [B, N, N])."""
    p = np.asarray(parents)
    if p.ndim == 2:
        return np.stack([ancestor_mask(row) for row in p])
    p = validate_parents(p)
    mask = np.zeros((p.size, p.size), bool)
    mask[0, 0] = True
    for i in range(1, p.size):
        mask[i] = mask[p[i]]
        mask[i, i] = True
    return mask


def children(parents) -> list[list[int]]:
    p = validate_parents(parents)
    out: list[list[int]] = [[] for _ in range(p.size)]
    for i in range(1, p.size):
        out[p[i]].append(i)
    return out


def children_table(parents, width: int | None = None) -> np.ndarray:
    """[N, width] child indices in node order, padded with -1."""
    ch = children(parents)
    w = width if width is not None else max(1, max(len(c) for c in ch))
    t = np.full((len(ch), w), -1, np.int32)
    for i, c in enumerate(ch):
        if len(c) > w:
            raise ValueError(f"node {i} has {len(c)} children, more than the table width {w}")
        t[i, :len(c)] = c
    return t


def root_to_leaf_paths(parents) -> list[list[int]]:
    ch = children(parents)
    paths, stack = [], [[0]]
    while stack:
        path = stack.pop()
        kids = ch[path[-1]]
        if not kids:
            paths.append(path)
        stack.extend(path + [k] for k in reversed(kids))
    return paths


def chain_parents(n: int) -> np.ndarray:
    return np.arange(-1, n - 1, dtype=np.int32)


def pad_tree(parents, tokens, num_nodes: int):
    """Pad a tree to `num_nodes`: returns (parents, tokens, valid) as int32/int32/bool arrays.
    Padding nodes hang off the root, carry token 0 and are invalid."""
    p = validate_parents(parents)
    t = np.asarray(tokens, np.int32)
    if t.shape != p.shape:
        raise ValueError(f"tokens {t.shape} and parents {p.shape} differ in length")
    if p.size > num_nodes:
        raise ValueError(f"a tree of {p.size} nodes does not fit the {num_nodes}-node bucket")
    pad = num_nodes - p.size
    return (np.concatenate([p, np.zeros(pad, np.int64)]).astype(np.int32),
            np.concatenate([t, np.zeros(pad, np.int32)]),
            np.arange(num_nodes) < p.size)


@dataclasses.dataclass(frozen=True)
class DraftTree:
    """A host drafter's proposal as the engine handles it: ``parents[i]`` is draft node i's parent
    among the draft nodes, -1 for a child of the root (the pending token); topological order.
    A chain of drafts is ``DraftTree.chain(tokens)``. ``tree[:k]`` keeps the first k nodes,
    which is again a tree."""

    parents: np.ndarray
    tokens: np.ndarray
    probs: np.ndarray | None = None  # the drafter's estimated acceptance of each node, if it has one

    @staticmethod
    def chain(tokens) -> "DraftTree":
        t = np.asarray(tokens, np.int32)
        return DraftTree(np.arange(-1, len(t) - 1, dtype=np.int32), t)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, s: slice) -> "DraftTree":
        if not isinstance(s, slice) or s.start not in (None, 0) or s.step not in (None, 1):
            raise TypeError("a draft tree is cut to a prefix of its nodes: tree[:k]")
        return DraftTree(self.parents[s], self.tokens[s], None if self.probs is None else self.probs[s])

    def child(self, node: int, token: int) -> int | None:
        """The draft node under ``node`` (-1: the root) carrying ``token``, or None."""
        hits = np.flatnonzero((self.parents == node) & (self.tokens == token))
        return int(hits[0]) if hits.size else None
