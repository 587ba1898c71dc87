"""SuffixTrie: a depth-capped suffix tree over many token sequences, with counts.

Every substring of length <= max_depth of the stored sequences is a node whose
count is its number of occurrences. Sequences are added whole or grown token by
token (the newest one only), and removed whole (eviction). The heavy lifting is
in `kernels.py` (numba); this class owns and grows the arrays. `reference.py` is
the brute-force definition the tests hold it to.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from specjax.drafters.suffix import kernels as K
from specjax.errors import SpecjaxError, require


@dataclasses.dataclass
class Draft:
    """A speculation: tokens with parents (-1 = the root, i.e. the last context token)."""
    tokens: np.ndarray
    parents: np.ndarray
    probs: np.ndarray
    score: float
    match_len: int

    @staticmethod
    def empty() -> "Draft":
        return Draft(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float64), 0.0, 0)

    def __len__(self):
        return len(self.tokens)


def _as_int32(tokens) -> np.ndarray:
    a = np.asarray(tokens)
    if a.size == 0:
        return np.zeros(0, np.int32)
    require(a.ndim == 1 and a.dtype.kind in "iu", "token sequences must be 1-D integer lists")
    # Token ids are hash-key halves: a negative id would alias another key.
    require((min(tokens) if isinstance(tokens, list) and len(tokens) < 16 else int(a.min())) >= 0,
            "token ids must be non-negative")
    return a if a.dtype == np.int32 and a.flags.c_contiguous else np.ascontiguousarray(a, dtype=np.int32)


_EMPTY_DRAFT = Draft.empty()  # shared: drafts are never mutated


class Cursors:
    """Where each suffix of a context sits in one trie (one cursor per match length that occurs).

    Advanced token by token with `step`; valid only while the trie is unchanged
    (`version`), after which they must be rebuilt with `SuffixTrie.cursors`."""

    def __init__(self, trie: "SuffixTrie", u=None, e=None, n: int = 0):
        self.trie = trie
        self.version = trie.version
        self.u = np.zeros(trie.max_depth + 1, np.int32) if u is None else u
        self.e = np.zeros(trie.max_depth + 1, np.int32) if e is None else e
        self.n = n

    def step(self, tokens) -> None:
        t = self.trie
        if self.version != t.version:
            raise SpecjaxError("stale suffix cursors: the trie changed since they were made")
        self.n = K.step_cursors_many(t._nodes, t._hkeys, t._hvals, t._store, t._seqs, self.u, self.e, self.n,
                                     np.asarray(tokens, np.int32), t.max_depth)


class SuffixTrie:
    def __init__(self, max_depth: int = 64, initial_nodes: int = 256):
        require(1 <= max_depth <= 1024, f"suffix max_depth must be in [1, 1024], got {max_depth}")
        self.max_depth = int(max_depth)
        cap = max(16, int(initial_nodes))
        self._nodes = np.full((cap, K.NCOLS), -1, np.int32)
        self._nodes[0] = (0, 0, -1, 0, -1, -1, -1, -1, -1, 0)  # the root; its count = stored tokens
        self._free = np.zeros(cap, np.int32)
        hcap = 1 << max(4, int(np.ceil(np.log2(cap * 2))))
        self._hkeys = np.full(hcap, K.EMPTY, np.int64)
        self._hvals = np.zeros(hcap, np.int32)
        self._meta = np.zeros(4, np.int64)
        self._meta[K.M_NODES] = 1
        self._store = np.zeros(1024, np.int32)
        self._store_end = 0
        self._seqs = np.zeros((16, 2), np.int64)  # (start in store, length); length -1 = removed
        self._nseq = 0
        self._live: dict[int, None] = {}  # live sequence ids in insertion order (oldest first)
        self._growing = -1  # the only sequence that may still grow
        self._active = np.zeros(self.max_depth + 1, np.int32)
        self._zeros = np.zeros(self.max_depth + 1, np.int32)
        self._n_active = 0
        self._max_tok = 0
        self.num_tokens = 0  # tokens currently stored (live sequences)
        self._headroom = 0  # tokens that can be appended before storage must grow
        self.version = 0  # bumped by every change; match cursors are valid for one version

    # ------------------------------------------------------------------ building

    def add(self, tokens: Sequence[int] = ()) -> int:
        """Store a new sequence (it may keep growing through `extend` until the next add)."""
        if self._nseq == len(self._seqs):
            self._seqs = np.concatenate([self._seqs, np.zeros_like(self._seqs)])
        sid = self._nseq
        self._nseq += 1
        self._seqs[sid] = (self._store_end, 0)
        self.version += 1
        self._live[sid] = None
        self._growing = sid
        self._n_active = 0
        self.extend(sid, tokens)
        return sid

    def extend(self, sid: int, tokens: Sequence[int]) -> None:
        """Append tokens to sequence `sid`, which must be the most recently added one."""
        if sid != self._growing:
            raise SpecjaxError(f"only the newest sequence can grow (got {sid}, newest {self._growing})")
        try:
            toks = np.asarray(tokens, np.int32)
        except (OverflowError, TypeError, ValueError):
            raise SpecjaxError("token ids must be integers in [0, 2**31)") from None
        if toks.ndim != 1:
            raise SpecjaxError("token sequences must be 1-D integer lists")
        n = toks.shape[0]
        if n == 0:
            return
        for lo in range(0, n, 512):  # chunks bound the node reservation
            chunk = toks[lo: lo + 512] if n > 512 else toks
            m = chunk.shape[0]
            if m > self._headroom:
                self._reserve(m)
            n_active, mx = K.append(self._nodes, self._hkeys, self._hvals, self._meta, self._free, self._store,
                                    self._seqs, sid, chunk, self._active, self._n_active, self.max_depth)
            if n_active < 0:
                raise SpecjaxError("token ids must be non-negative")
            self._headroom -= m
            self._n_active = n_active
            self._store_end += m
            if mx > self._max_tok:
                self._max_tok = mx
            self.num_tokens += m
        self.version += 1

    def remove(self, sid: int) -> None:
        """Forget sequence `sid` (eviction)."""
        require(sid in self._live, f"sequence {sid} is not stored")
        K.remove(self._nodes, self._hkeys, self._hvals, self._meta, self._free, self._store, self._seqs, sid,
                 self.max_depth)
        self.num_tokens -= int(self._seqs[sid, 1])
        self.version += 1
        self._headroom = 0  # removal leaves hash tombstones: re-check room before the next append
        self._seqs[sid, 1] = -1
        del self._live[sid]
        if sid == self._growing:
            self._growing = -1
        if self._store_end > 2 * max(self.num_tokens, 1024):
            self._compact_store()

    def oldest(self) -> int | None:
        return next(iter(self._live), None)

    @property
    def num_sequences(self) -> int:
        return len(self._live)

    @property
    def num_nodes(self) -> int:
        """Materialised nodes, root included."""
        return int(self._meta[K.M_NODES] - self._meta[K.M_FREE])

    def used_bytes(self) -> int:
        """Bytes the live content needs: node rows, hash slots at the 1/2 load bound, live tokens."""
        return self.num_nodes * (K.NCOLS * 4 + 2 * 12) + self.num_tokens * 4 + self._nseq * 16

    def allocated_bytes(self) -> int:
        return sum(a.nbytes for a in (self._nodes, self._free, self._hkeys, self._hvals, self._store, self._seqs))

    # ------------------------------------------------------------------ queries

    def count(self, pattern: Sequence[int]) -> int:
        """Occurrences of `pattern` (0 if absent or longer than max_depth); the root counts tokens."""
        pat = _as_int32(pattern)
        if pat.size > self.max_depth:
            return 0
        u, e = K.match(self._nodes, self._hkeys, self._hvals, self._store, self._seqs, pat, 0, pat.size,
                       self.max_depth)
        if u < 0:
            return 0
        return 1 if (e > 0 or self._nodes[u, K.RSID] >= 0) else int(self._nodes[u, K.CNT])

    def speculate(self, context: Sequence[int], *, max_spec: int, alpha: float = 1.0, offset: float = 0.0,
                  min_prob: float = 0.1, tree: bool = True, max_pattern: int | None = None) -> Draft:
        """The best draft continuing `context`: Algorithm 1 over every match length p."""
        if max_spec <= 0 or self.num_tokens == 0:
            return Draft.empty()
        return self.speculate_cursors(self.cursors(context), max_spec=max_spec, alpha=alpha, offset=offset,
                                      min_prob=min_prob, tree=tree, max_pattern=max_pattern)

    def cursors(self, context: Sequence[int]) -> "Cursors":
        """Match cursors of every suffix of `context` that occurs (O(depth^2) hash lookups)."""
        cur = Cursors(self)
        ctx = _as_int32(context)[-self.max_depth:]
        cur.n = K.match_all(self._nodes, self._hkeys, self._hvals, self._store, self._seqs, ctx, self.max_depth,
                            cur.u, cur.e)
        return cur

    def active_cursors(self) -> "Cursors":
        """Cursors of the growing sequence's own repeated suffixes (free: kept up to date by extend).

        For a trie that holds the context itself (the per-request tree), these are exactly the
        suffixes with an earlier occurrence, i.e. every match that has a continuation."""
        # A read-only view of the live active list (ext is 0 for all: they are materialised).
        return Cursors(self, self._active, self._zeros, self._n_active)

    def speculate_cursors(self, cur: "Cursors", *, max_spec: int, alpha: float = 1.0, offset: float = 0.0,
                          min_prob: float = 0.1, tree: bool = True, max_pattern: int | None = None) -> Draft:
        if cur.version != self.version:
            raise SpecjaxError("stale suffix cursors: the trie changed since they were made")
        if max_spec <= 0 or cur.n == 0:
            return _EMPTY_DRAFT
        P = self.max_depth - 1 if not max_pattern else min(self.max_depth - 1, max_pattern)
        tok = np.empty(max_spec, np.int32)
        par = np.empty(max_spec, np.int32)
        prob = np.empty(max_spec, np.float64)
        # Fixed scalar types: numba compiles one specialisation per argument-type signature.
        n, score, p = K.speculate(self._nodes, self._store, self._seqs, cur.u, cur.e, cur.n, P, max_spec,
                                  float(alpha), float(offset), float(min_prob), bool(tree), self.max_depth,
                                  self._max_tok + 2, tok, par, prob)
        if n == 0:
            return _EMPTY_DRAFT
        return Draft(tok[:n], par[:n], prob[:n], score, p)

    def dump(self) -> dict[tuple[int, ...], int]:
        """Every stored string (materialised and implicit) with its count; for tests."""
        out: dict[tuple[int, ...], int] = {}
        nodes, store, seqs = self._nodes, self._store, self._seqs
        stack = [(int(c), ()) for c in self._child_ids(0)]
        while stack:
            u, prefix = stack.pop()
            path = prefix + (int(nodes[u, K.TOK]),)
            if nodes[u, K.RSID] >= 0:
                s, o, d = int(nodes[u, K.RSID]), int(nodes[u, K.ROFF]), int(nodes[u, K.DEP])
                start, length = int(seqs[s, 0]), int(seqs[s, 1])
                out[path] = 1
                while d < self.max_depth and o + 1 < length:
                    o += 1
                    d += 1
                    path = path + (int(store[start + o]),)
                    out[path] = 1
                continue
            out[path] = int(nodes[u, K.CNT])
            stack.extend((int(c), path) for c in self._child_ids(u))
        return out

    def _child_ids(self, u):
        c = self._nodes[u, K.FCH]
        while c >= 0:
            yield c
            c = self._nodes[c, K.NSIB]

    # ------------------------------------------------------------------ storage

    def _reserve(self, m: int) -> None:
        """Make room to append m tokens, then record how many more fit (checked cheaply per call)."""
        self._reserve_store(self._store_end + m)
        self._reserve_nodes((self.max_depth + 1) * m)
        per = self.max_depth + 1
        meta = self._meta
        self._headroom = int(min(len(self._store) - self._store_end,
                                 (len(self._nodes) - meta[K.M_NODES]) // per,
                                 (len(self._hkeys) // 2 - meta[K.M_HUSED] - meta[K.M_HTOMB]) // per))

    def _reserve_nodes(self, extra: int) -> None:
        need = int(self._meta[K.M_NODES]) + extra
        if need > len(self._nodes):
            cap = max(need, 2 * len(self._nodes))
            nodes = np.full((cap, K.NCOLS), -1, np.int32)
            nodes[: len(self._nodes)] = self._nodes
            free = np.zeros(cap, np.int32)
            free[: len(self._free)] = self._free
            self._nodes, self._free = nodes, free
        used = int(self._meta[K.M_HUSED] + self._meta[K.M_HTOMB]) + extra
        if 2 * used > len(self._hkeys):
            live = int(self._meta[K.M_HUSED]) + extra
            hcap = 1 << int(np.ceil(np.log2(max(16, 4 * live))))
            keys = np.full(hcap, K.EMPTY, np.int64)
            vals = np.zeros(hcap, np.int32)
            K.rehash(self._hkeys, self._hvals, keys, vals)
            self._hkeys, self._hvals = keys, vals
            self._meta[K.M_HTOMB] = 0

    def _reserve_store(self, need: int) -> None:
        if need > len(self._store):
            store = np.zeros(max(need, 2 * len(self._store)), np.int32)
            store[: self._store_end] = self._store[: self._store_end]
            self._store = store

    def _compact_store(self) -> None:
        # Lazy leaves address tokens as (sequence, offset), so moving sequences only
        # rewrites the sequence table.
        store = np.zeros(max(1024, 2 * self.num_tokens), np.int32)
        end = 0
        for sid in self._live:
            start, length = int(self._seqs[sid, 0]), int(self._seqs[sid, 1])
            store[end: end + length] = self._store[start: start + length]
            self._seqs[sid, 0] = end
            end += length
        self._store, self._store_end = store, end
