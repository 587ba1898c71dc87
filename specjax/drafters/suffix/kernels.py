"""Compiled (numba) kernels of the suffix trie. Pure functions over flat arrays.

The trie stores every substring of length <= max_depth of the stored sequences;
the count of a node is the number of occurrences of its string. Two ideas keep it
small and fast:

* Lazy leaves. A node that only one occurrence has reached does not materialise
  its subtree: it holds a reference (sequence id, offset) into the token store and
  its descendants are read from there, each with count 1. Appending to a
  sequence therefore costs nothing for suffixes that are already unique; work is
  proportional to the number of suffixes that still repeat earlier text.
* Flat storage. Nodes are rows of one int32 array; children are found through one
  open-addressing hash table keyed (parent, token) and enumerated through a
  doubly linked sibling list (for best-first expansion and for deletion).

Invariant: a node with a reference (lazy) has count 1 and no materialised
children; every node with count >= 2 is materialised. Counts may drop back to 1
by eviction; such nodes stay materialised, which is still exact. MAXC, the largest
child count, is exact under insertion and an upper bound after eviction: it only
prunes speculation, so an upper bound keeps the result exact.

The Python wrapper (`trie.py`) owns the arrays and grows them before a call can
run out of room; these kernels never allocate node or hash storage.
"""

from __future__ import annotations

import numba as nb
import numpy as np

# Node columns.
TOK, CNT, PAR, DEP, FCH, NSIB, PSIB, RSID, ROFF, MAXC = range(10)
NCOLS = 10
# Meta slots.
M_NODES, M_FREE, M_HUSED, M_HTOMB = range(4)
EMPTY = np.int64(-1)
TOMB = np.int64(-2)

_jit = nb.njit(cache=True, nogil=True)


@_jit
def hkey(parent, tok):
    return (np.int64(parent) << 32) | np.int64(tok)


@_jit
def _slot(key, mask):
    h = np.uint64(key) * np.uint64(0x9E3779B97F4A7C15)
    return np.int64(h >> np.uint64(29)) & mask


@_jit
def hfind(hkeys, hvals, key):
    mask = hkeys.shape[0] - 1
    i = _slot(key, mask)
    while True:
        k = hkeys[i]
        if k == key:
            return hvals[i]
        if k == EMPTY:
            return -1
        i = (i + 1) & mask


@_jit
def _hput(hkeys, hvals, meta, key, val):
    # Caller guarantees the key is absent and the table has room.
    mask = hkeys.shape[0] - 1
    i = _slot(key, mask)
    while hkeys[i] >= 0:
        i = (i + 1) & mask
    if hkeys[i] == TOMB:
        meta[M_HTOMB] -= 1
    hkeys[i] = key
    hvals[i] = val
    meta[M_HUSED] += 1


@_jit
def _hdel(hkeys, meta, key):
    mask = hkeys.shape[0] - 1
    i = _slot(key, mask)
    while hkeys[i] != key:
        i = (i + 1) & mask
    hkeys[i] = TOMB
    meta[M_HUSED] -= 1
    meta[M_HTOMB] += 1


@_jit
def rehash(old_keys, old_vals, new_keys, new_vals):
    """Copy live entries into an empty table (drops tombstones); returns the entry count."""
    mask = new_keys.shape[0] - 1
    n = 0
    for j in range(old_keys.shape[0]):
        k = old_keys[j]
        if k >= 0:
            i = _slot(k, mask)
            while new_keys[i] != EMPTY:
                i = (i + 1) & mask
            new_keys[i] = k
            new_vals[i] = old_vals[j]
            n += 1
    return n


@_jit
def _new_node(nodes, hkeys, hvals, meta, free, tok, parent, depth, rsid, roff):
    if meta[M_FREE] > 0:
        meta[M_FREE] -= 1
        n = free[meta[M_FREE]]
    else:
        n = meta[M_NODES]
        meta[M_NODES] += 1
    nodes[n, TOK] = tok
    nodes[n, CNT] = 1
    nodes[n, PAR] = parent
    nodes[n, DEP] = depth
    nodes[n, FCH] = -1
    nodes[n, PSIB] = -1
    old = nodes[parent, FCH]
    nodes[n, NSIB] = old
    if old >= 0:
        nodes[old, PSIB] = n
    nodes[parent, FCH] = n
    nodes[n, RSID] = rsid
    nodes[n, ROFF] = roff
    nodes[n, MAXC] = 0
    if nodes[parent, MAXC] < 1:
        nodes[parent, MAXC] = 1
    _hput(hkeys, hvals, meta, hkey(parent, tok), n)
    return n


@_jit
def extend(nodes, hkeys, hvals, meta, free, store, seqs, sid, lo, hi, active, n_active, max_depth):
    """Count positions lo..hi-1 of sequence `sid` (already in the store) into the trie.

    `active[:n_active]` are the materialised nodes of the sequence's suffixes that
    end at lo-1 and still repeat earlier text (their occurrence is counted in
    them). Returns the new n_active. Needs room for (max_depth + 1) * (hi - lo)
    new nodes."""
    base = seqs[sid, 0]
    for i in range(lo, hi):
        t = store[base + i]
        nodes[0, CNT] += 1
        active[n_active] = 0  # the empty suffix starting at i
        n_active += 1
        w = 0
        for a in range(n_active):
            u = active[a]
            d = nodes[u, DEP]
            if d >= max_depth:
                continue
            c = hfind(hkeys, hvals, hkey(u, t))
            if c < 0:
                # First occurrence of this string: a lazy leaf on this very occurrence, which
                # from now on extends implicitly as the sequence grows.
                _new_node(nodes, hkeys, hvals, meta, free, t, u, d + 1, sid, i)
                continue
            if nodes[c, RSID] >= 0:
                # A lazy leaf of another occurrence: materialise it, and hand that occurrence's
                # continuation down one level as a new lazy leaf.
                s2 = nodes[c, RSID]
                o2 = nodes[c, ROFF] + 1
                nodes[c, RSID] = -1
                nodes[c, CNT] += 1
                if d + 1 < max_depth and o2 < seqs[s2, 1]:
                    _new_node(nodes, hkeys, hvals, meta, free, store[seqs[s2, 0] + o2], c, d + 2, s2, o2)
            else:
                nodes[c, CNT] += 1
            if nodes[u, MAXC] < nodes[c, CNT]:
                nodes[u, MAXC] = nodes[c, CNT]
            active[w] = c
            w += 1
        n_active = w
    return n_active


@_jit
def append(nodes, hkeys, hvals, meta, free, store, seqs, sid, toks, active, n_active, max_depth):
    """Write toks at the end of sequence `sid` (the last one in the store) and count them.

    Returns (n_active, max token), or (-1, 0) without changing anything if a token is
    negative. Needs room in the store for the tokens and (max_depth + 1) * len(toks) nodes."""
    mx = 0
    for t in toks:
        if t < 0:
            return -1, 0
        if t > mx:
            mx = t
    start, length = seqs[sid, 0], seqs[sid, 1]
    for j in range(toks.shape[0]):
        store[start + length + j] = toks[j]
    seqs[sid, 1] = length + toks.shape[0]
    n_active = extend(nodes, hkeys, hvals, meta, free, store, seqs, sid, length, length + toks.shape[0], active,
                      n_active, max_depth)
    return n_active, mx


@_jit
def _free_node(nodes, hkeys, meta, free, n):
    _hdel(hkeys, meta, hkey(nodes[n, PAR], nodes[n, TOK]))
    nodes[n, CNT] = 0
    nodes[n, DEP] = -1
    free[meta[M_FREE]] = n
    meta[M_FREE] += 1


@_jit
def _delete_subtree(nodes, hkeys, meta, free, c):
    # Unlink c from its parent's child list, then free its subtree leaf-first.
    p, nx, pv = nodes[c, PAR], nodes[c, NSIB], nodes[c, PSIB]
    if pv >= 0:
        nodes[pv, NSIB] = nx
    else:
        nodes[p, FCH] = nx
    if nx >= 0:
        nodes[nx, PSIB] = pv
    node = c
    while True:
        while nodes[node, FCH] >= 0:
            node = nodes[node, FCH]
        if node == c:
            _free_node(nodes, hkeys, meta, free, c)
            return
        par = nodes[node, PAR]
        nxt = nodes[node, NSIB]  # node is its parent's first child
        _free_node(nodes, hkeys, meta, free, node)
        nodes[par, FCH] = nxt
        if nxt >= 0:
            nodes[nxt, PSIB] = -1
            node = nxt
        else:
            node = par


@_jit
def remove(nodes, hkeys, hvals, meta, free, store, seqs, sid, max_depth):
    """Uncount every occurrence that starts in sequence `sid`; nodes reaching 0 are freed."""
    base, length = seqs[sid, 0], seqs[sid, 1]
    for j in range(length):
        nodes[0, CNT] -= 1
        u = 0
        for k in range(j, min(j + max_depth, length)):
            c = hfind(hkeys, hvals, hkey(u, store[base + k]))
            nodes[c, CNT] -= 1
            if nodes[c, CNT] == 0:
                _delete_subtree(nodes, hkeys, meta, free, c)
                break
            u = c


# ----------------------------------------------------------------------------------------------
# Queries. A cursor is (node, ext): ext == 0 is the node itself; ext > 0 is the ext-th implicit
# descendant of a lazy node (count 1).


@_jit
def match(nodes, hkeys, hvals, store, seqs, pat, lo, hi, max_depth):
    """Walk pat[lo:hi] from the root; returns (node, ext), node = -1 when it does not occur."""
    u = 0
    ext = 0
    for k in range(lo, hi):
        t = pat[k]
        if nodes[u, RSID] < 0:
            c = hfind(hkeys, hvals, hkey(u, t))
            if c < 0:
                return -1, 0
            u = c
        else:
            s = nodes[u, RSID]
            o = nodes[u, ROFF] + ext + 1
            if nodes[u, DEP] + ext >= max_depth or o >= seqs[s, 1] or store[seqs[s, 0] + o] != t:
                return -1, 0
            ext += 1
    return u, ext


@_jit
def _count(nodes, u, ext):
    return 1 if (ext > 0 or nodes[u, RSID] >= 0) else nodes[u, CNT]


@_jit
def _children(nodes, store, seqs, u, ext, max_depth, prob, min_prob, ctok, cnode, cext, cprob):
    """Children of cursor (u, ext) whose D = prob * C >= min_prob, sorted by token; returns how
    many. (The cut is applied here because a frequent node can have thousands of children.)"""
    denom = _count(nodes, u, ext)
    if ext > 0 or nodes[u, RSID] >= 0:
        s = nodes[u, RSID]
        o = nodes[u, ROFF] + ext + 1
        if nodes[u, DEP] + ext >= max_depth or o >= seqs[s, 1]:
            return 0
        p = prob * 1 / denom
        if p < min_prob:
            return 0
        ctok[0] = store[seqs[s, 0] + o]
        cnode[0] = u
        cext[0] = ext + 1
        cprob[0] = p
        return 1
    m = 0
    c = nodes[u, FCH]
    while c >= 0:
        p = prob * _count(nodes, c, 0) / denom
        if p >= min_prob:
            tk = nodes[c, TOK]
            j = m
            while j > 0 and ctok[j - 1] > tk:  # insertion sort by token: ties resolve the same way always
                ctok[j] = ctok[j - 1]
                cnode[j] = cnode[j - 1]
                cprob[j] = cprob[j - 1]
                j -= 1
            ctok[j] = tk
            cnode[j] = c
            cprob[j] = p
            m += 1
        c = nodes[c, NSIB]
    for j in range(m):
        cext[j] = 0
    return m


@_jit
def _best_child(nodes, store, seqs, u, ext, max_depth):
    """(token, node, ext, count) of the most frequent child, ties to the lower token; node -1 if none."""
    if ext > 0 or nodes[u, RSID] >= 0:
        s = nodes[u, RSID]
        o = nodes[u, ROFF] + ext + 1
        if nodes[u, DEP] + ext >= max_depth or o >= seqs[s, 1]:
            return 0, -1, 0, 0
        return store[seqs[s, 0] + o], u, ext + 1, 1
    bt, bn, bc = 0, -1, 0
    c = nodes[u, FCH]
    while c >= 0:
        cc = _count(nodes, c, 0)
        tk = nodes[c, TOK]
        if cc > bc or (cc == bc and tk < bt):
            bt, bn, bc = tk, c, cc
        c = nodes[c, NSIB]
    return bt, bn, 0, bc


@_jit
def _before(ep, a, b):
    # heap order of entries a, b: higher probability first, then the earlier push
    return ep[a] > ep[b] or (ep[a] == ep[b] and a < b)


@_jit
def _grow(a, cap):
    out = np.empty(cap, a.dtype)
    out[: a.shape[0]] = a
    return out


@_jit
def _expand(nodes, store, seqs, u0, e0, budget, min_prob, tree_mode, max_depth,
            out_tok, out_par, out_prob, ctok, cnode, cext, cprob):
    """Best-first expansion under cursor (u0, e0): Algorithm 1 with the min-probability cut.

    Returns (n, score). Path mode follows the most frequent child (ties: lower token)."""
    if budget <= 0:
        return 0, 0.0
    n = 0
    score = 0.0
    if not tree_mode:
        u, e, prob, par = u0, e0, 1.0, -1
        while n < budget:
            tk, cn, ce, cc = _best_child(nodes, store, seqs, u, e, max_depth)
            if cn < 0:
                break
            p = prob * cc / _count(nodes, u, e)
            if p < min_prob:
                break
            out_tok[n] = tk
            out_par[n] = par
            out_prob[n] = p
            score += p
            par = n
            n += 1
            u, e, prob = cn, ce, p
        return n, score
    # Tree mode: candidates are appended to entry arrays (never moved) and a binary heap orders
    # their indices by probability; ties go to the earlier push (the lower index).
    cap = 64
    ep = np.empty(cap, np.float64)
    en = np.empty(cap, np.int32)
    ee = np.empty(cap, np.int32)
    et = np.empty(cap, np.int32)
    eq = np.empty(cap, np.int32)
    heap = np.empty(cap, np.int32)
    size = 0
    pushes = 0
    u, e, prob, par = u0, e0, 1.0, -1
    while True:
        m = _children(nodes, store, seqs, u, e, max_depth, prob, min_prob, ctok, cnode, cext, cprob)
        for j in range(m):
            if pushes == cap:
                cap *= 2
                ep, en, ee, et = _grow(ep, cap), _grow(en, cap), _grow(ee, cap), _grow(et, cap)
                eq, heap = _grow(eq, cap), _grow(heap, cap)
            ep[pushes], en[pushes], ee[pushes], et[pushes], eq[pushes] = cprob[j], cnode[j], cext[j], ctok[j], par
            i = size
            heap[i] = pushes
            size += 1
            pushes += 1
            while i > 0:  # sift up
                pi = (i - 1) // 2
                if not _before(ep, heap[i], heap[pi]):
                    break
                heap[i], heap[pi] = heap[pi], heap[i]
                i = pi
        if n >= budget or size == 0:
            break
        top = heap[0]  # pop the best
        prob, u, e = ep[top], en[top], ee[top]
        out_tok[n] = et[top]
        out_par[n] = eq[top]
        out_prob[n] = prob
        score += prob
        par = n
        n += 1
        size -= 1
        if size > 0:
            heap[0] = heap[size]
            i = 0
            while True:  # sift down
                b = 2 * i + 1
                if b >= size:
                    break
                if b + 1 < size and _before(ep, heap[b + 1], heap[b]):
                    b += 1
                if not _before(ep, heap[b], heap[i]):
                    break
                heap[i], heap[b] = heap[b], heap[i]
                i = b
        if n >= budget:
            break
    return n, score


@_jit
def step_cursors(nodes, hkeys, hvals, store, seqs, cur_u, cur_e, n, tok, max_depth):
    """Advance the match cursors of a context by one token, in place; returns the new count.

    Cursors are the trie positions of the context's suffixes that occur (one per match
    length p, deepest first); this is the incremental form of `match` for every p."""
    w = 0
    for a in range(n):
        u, e = cur_u[a], cur_e[a]
        if e > 0 or nodes[u, RSID] >= 0:
            s = nodes[u, RSID]
            o = nodes[u, ROFF] + e + 1
            if nodes[u, DEP] + e < max_depth and o < seqs[s, 1] and store[seqs[s, 0] + o] == tok:
                cur_u[w], cur_e[w] = u, e + 1
                w += 1
        elif nodes[u, DEP] < max_depth:
            c = hfind(hkeys, hvals, hkey(u, tok))
            if c >= 0:
                cur_u[w], cur_e[w] = c, 0
                w += 1
    if max_depth >= 1:
        c = hfind(hkeys, hvals, hkey(0, tok))
        if c >= 0:
            cur_u[w], cur_e[w] = c, 0
            w += 1
    return w


@_jit
def step_cursors_many(nodes, hkeys, hvals, store, seqs, cur_u, cur_e, n, toks, max_depth):
    for t in toks:
        n = step_cursors(nodes, hkeys, hvals, store, seqs, cur_u, cur_e, n, t, max_depth)
    return n


@_jit
def match_all(nodes, hkeys, hvals, store, seqs, ctx, max_depth, cur_u, cur_e):
    """Cursors of every suffix of ctx (length <= max_depth) that occurs, deepest first."""
    L = ctx.shape[0]
    found = np.empty(max_depth + 1, np.int64)
    m = 0
    for p in range(1, min(max_depth, L) + 1):
        u, e = match(nodes, hkeys, hvals, store, seqs, ctx, L - p, L, max_depth)
        if u < 0:
            break  # a longer suffix contains this one, so it cannot occur either
        found[m] = (np.int64(u) << 16) | np.int64(e)
        m += 1
    for j in range(m):
        v = found[m - 1 - j]
        cur_u[j] = np.int32(v >> 16)
        cur_e[j] = np.int32(v & 0xFFFF)
    return m


@_jit
def speculate(nodes, store, seqs, cur_u, cur_e, n_cur, max_pattern, max_spec, alpha, offset, min_prob,
              tree_mode, max_depth, scratch_n, out_tok, out_par, out_prob):
    """Best draft over the match cursors (deepest first; match length p = cursor depth <= max_pattern).

    Budget per p: min(max_spec, floor(alpha * p + offset)); the highest score wins, ties to
    the longer match. A match whose bound budget * max child count / count is below the
    best score so far is skipped: exact, and it skips most short matches.
    Returns (n, score, match_len); the draft is in out_*[:n]."""
    best_n, best_score, best_p = 0, 0.0, 0
    tok = np.empty(max_spec, np.int32)
    par = np.empty(max_spec, np.int32)
    prob = np.empty(max_spec, np.float64)
    # Children scratch: at most 1/min_prob children pass the cut, and never more than the alphabet.
    cap = scratch_n if min_prob <= 0.0 else min(scratch_n, int(1.0 / min_prob) + 2)
    ctok = np.empty(cap, np.int32)
    cnode = np.empty(cap, np.int32)
    cext = np.empty(cap, np.int32)
    cprob = np.empty(cap, np.float64)
    for a in range(n_cur):
        u, e = cur_u[a], cur_e[a]
        p = nodes[u, DEP] + e
        if p > max_pattern or p < 1:
            continue
        budget = min(max_spec, int(np.floor(alpha * p + offset)))
        if budget <= 0:
            continue
        if e == 0 and nodes[u, RSID] < 0:
            bound = budget * (nodes[u, MAXC] / nodes[u, CNT])
        else:
            bound = float(budget)
        if bound * (1.0 + 1e-9) < best_score:
            continue
        n, s = _expand(nodes, store, seqs, u, e, budget, min_prob, tree_mode, max_depth, tok, par, prob,
                       ctok, cnode, cext, cprob)
        if n > 0 and (s > best_score or (s == best_score and p > best_p)):
            best_n, best_score, best_p = n, s, p
            out_tok[:n] = tok[:n]
            out_par[:n] = par[:n]
            out_prob[:n] = prob[:n]
    return best_n, best_score, best_p
