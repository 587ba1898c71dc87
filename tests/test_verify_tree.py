"""Token trees (specjax/tree.py) and tree verification (specjax/verify_tree.py).

Greedy tree verification is checked exactly against a plain-Python walk and against chain
verification on path trees. Stochastic tree verification is checked statistically like the
chain rule (tests/test_verify_lossless.py): a Markov target P and draft Q over V=6 tokens,
speculative generation simulated over 120k rows with a tree proposal per step, and the joint
distribution of the first three generated tokens compared with the exact target chain by a
chi-square test. Trees: i.i.d. sampled siblings (with their q), deterministic siblings that
share a token, and a depth-1 star with many leaves. A local copy of the rule that forgets
the residual update between siblings must fail the same test.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chi2

from specjax import tree
from markov_tables import P_TABLE, Q_TABLE, V, X0
from suite_xla import run_time_options
from specjax.sampling import SamplingArrays, probs_from_logits
from specjax.verify import verify_chain
from specjax.verify_tree import _sampled_row, verify_tree

# ---------------------------------------------------------------- tree utilities


def test_tree_structure_helpers():
    parents = [-1, 0, 0, 1, 1, 2, 5]
    assert tree.depths(parents).tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert tree.children(parents) == [[1, 2], [3, 4], [5], [], [], [6], []]
    assert tree.children_table(parents).tolist() == [[1, 2], [3, 4], [5, -1], [-1, -1], [-1, -1], [6, -1], [-1, -1]]
    assert sorted(tree.root_to_leaf_paths(parents)) == [[0, 1, 3], [0, 1, 4], [0, 2, 5, 6]]
    m = tree.ancestor_mask(parents)
    assert np.flatnonzero(m[6]).tolist() == [0, 2, 5, 6]
    p, t, v = tree.pad_tree(parents, [9, 8, 7, 6, 5, 4, 3], 8)
    assert p.tolist() == parents + [0] and t.tolist()[-1] == 0 and v.tolist() == [True] * 7 + [False]
    assert tree.chain_parents(4).tolist() == [-1, 0, 1, 2]
    with pytest.raises(ValueError, match="before its child"):
        tree.depths([-1, 2, 0])
    with pytest.raises(ValueError, match="does not fit"):
        tree.pad_tree(parents, [0] * 7, 4)


# ---------------------------------------------------------------- greedy


def _greedy_walk(logits, tokens, parents, valid):
    g = np.argmax(logits, -1)
    cur, path, out = 0, [0], []
    while True:
        nxt = [j for j in range(1, len(parents)) if parents[j] == cur and valid[j] and tokens[j] == g[cur]]
        if not nxt:
            return path, out + [int(g[cur])]
        out.append(int(g[cur]))
        cur = nxt[0]
        path.append(cur)


def _samp(temps, seeds=None):
    B = len(temps)
    return SamplingArrays(temperature=jnp.asarray(temps, jnp.float32), top_k=jnp.zeros((B,), jnp.int32),
                          top_p=jnp.ones((B,), jnp.float32),
                          seed=jnp.asarray(np.arange(B) if seeds is None else seeds, jnp.uint32))


def test_greedy_tree_matches_reference_walk():
    rng = np.random.default_rng(0)
    V, N, B = 4, 12, 64  # a small vocabulary makes long accepted paths likely
    parents = np.stack([np.array([-1] + [int(rng.integers(0, i)) for i in range(1, N)]) for _ in range(B)])
    tokens = rng.integers(0, V, (B, N)).astype(np.int32)
    valid = rng.random((B, N)) < 0.9
    logits = rng.standard_normal((B, N, V)).astype(np.float32)
    path, out, n, ok = verify_tree(jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(parents, jnp.int32),
                                   jnp.asarray(valid), _samp([0.0] * B), jnp.zeros((B,), jnp.int32))
    lengths = []
    for b in range(B):
        ref_path, ref_out = _greedy_walk(logits[b], tokens[b], parents[b], valid[b])
        k = len(ref_out)
        assert int(n[b]) == k - 1
        assert np.asarray(path[b, :k]).tolist() == ref_path and np.asarray(out[b, :k]).tolist() == ref_out
        assert np.asarray(ok[b]).tolist() == [i < k for i in range(N)]
        lengths.append(k)
    assert max(lengths) >= 3  # the test exercised multi-level acceptance


def test_greedy_path_tree_equals_chain_verification():
    rng = np.random.default_rng(1)
    V, K, B = 3, 6, 32
    drafts = rng.integers(0, V, (B, K)).astype(np.int32)
    logits = rng.standard_normal((B, K + 1, V)).astype(np.float32)
    tokens = np.concatenate([np.zeros((B, 1), np.int32), drafts], axis=1)
    parents = np.broadcast_to(tree.chain_parents(K + 1), (B, K + 1))
    s = _samp([0.0] * B)
    _, t_out, t_n, _ = verify_tree(jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(parents),
                                   jnp.ones((B, K + 1), bool), s, jnp.ones((B,), jnp.int32), greedy_only=True)
    c_out, c_n, _ = verify_chain(jnp.asarray(logits), jnp.asarray(drafts), jnp.full((B,), K), s,
                                 jnp.ones((B,), jnp.int32), greedy_only=True)
    assert np.array_equal(np.asarray(t_n), np.asarray(c_n))
    idx = np.arange(K + 1)[None, :] <= np.asarray(c_n)[:, None]
    assert np.array_equal(np.where(idx, np.asarray(t_out), -1), np.where(idx, np.asarray(c_out), -1))


# ---------------------------------------------------------------- stochastic (statistical)

N_GEN = 3
ROWS = 120_000



SAMPLED, SHARED, STAR = 0, 1, 2
PARENTS = {SAMPLED: [-1, 0, 0, 0, 1, 2, 3], SHARED: [-1, 0, 0, 0, 1, 2, 3], STAR: [-1, 0, 0, 0, 0, 0, 0]}


def _no_residual_row(p_all, q_all, tokens, parents, node_valid, u):
    """WRONG (local copy of verify_tree._sampled_row): a rejected sibling does not turn p
    into the residual norm(max(p - q, 0)) for the next sibling."""
    N = tokens.shape[0]

    def depth_step(_, c):
        cur, n, done, p, path, out = c

        def sibling(j, s):
            p, acc = s
            is_child = (parents[j] == cur) & node_valid[j] & (acc < 0) & ~done
            ok = is_child & (u[n, j] * q_all[j][tokens[j]] < p[tokens[j]])
            return p, jnp.where(ok, j, acc)

        p, acc = jax.lax.fori_loop(1, N, sibling, (p, jnp.int32(-1)))
        has = acc >= 0
        nxt = jnp.where(has, acc, cur)
        out = jnp.where(has, out.at[n].set(tokens[nxt]), out)
        path = jnp.where(has, path.at[n + 1].set(nxt, mode="drop"), path)
        # after all siblings failed, still (wrongly) sample from the residual of the last one
        p = jnp.where(has, p_all[nxt], jnp.maximum(p - q_all[jnp.maximum(acc, 0)], 0) + 1e-9 * p)
        return nxt, n + has, done | ~has, p, path, out

    z = jnp.zeros((N,), jnp.int32)
    cur, n, _, p, path, out = jax.lax.fori_loop(0, N, depth_step, (jnp.int32(0), jnp.int32(0), jnp.bool_(False),
                                                                   p_all[0], z, z))
    return jnp.where(jnp.arange(N) <= n, path, cur), out, n, p


@partial(jax.jit, static_argnames=("mode", "wrong"),
         compiler_options=run_time_options())  # run time dominates here (suite_xla)
def simulate(P, Q, samp, key, *, mode: int, wrong: bool):
    import specjax.verify_tree as vt

    B = samp.temperature.shape[0]
    parents_1 = jnp.asarray(PARENTS[mode], jnp.int32)
    N = parents_1.shape[0]
    parents = jnp.broadcast_to(parents_1, (B, N))
    out = jnp.zeros((B, N_GEN * N + 1), jnp.int32)
    count = jnp.zeros((B,), jnp.int32)
    pending = jnp.full((B,), X0, jnp.int32)
    first_pos = jnp.ones((B,), jnp.int32)
    for step in range(N_GEN):
        key, k1, k2 = jax.random.split(key, 3)
        q0 = probs_from_logits(Q[pending], samp)
        draft_probs = None
        if mode == SAMPLED:
            d1 = jnp.stack([jax.random.categorical(jax.random.fold_in(k1, i), jnp.log(q0)) for i in range(3)], 1)
            q1 = jnp.stack([probs_from_logits(Q[d1[:, i]], samp) for i in range(3)], 1)  # [B, 3, V]
            d2 = jnp.stack([jax.random.categorical(jax.random.fold_in(k2, i), jnp.log(q1[:, i])) for i in range(3)], 1)
            tokens = jnp.concatenate([pending[:, None], d1, d2], 1).astype(jnp.int32)
            draft_probs = jnp.concatenate([q0[:, None], jnp.repeat(q0[:, None], 3, 1), q1], 1)
        elif mode == SHARED:
            order = jnp.argsort(-Q[pending], axis=-1)
            d1 = jnp.stack([order[:, 0], order[:, 0], order[:, 1]], 1)  # two siblings share a token
            d2 = jnp.argmax(Q[d1], axis=-1)
            tokens = jnp.concatenate([pending[:, None], d1, d2], 1).astype(jnp.int32)
        else:
            order = jnp.argsort(-Q[pending], axis=-1)
            d1 = jnp.concatenate([order[:, :5], order[:, :1]], 1)  # 6 leaves, the last repeats the first
            tokens = jnp.concatenate([pending[:, None], d1], 1).astype(jnp.int32)
        target_logits = P[tokens]
        valid = jnp.ones((B, N), bool).at[:, 0].set(False)
        if wrong:
            p_all = probs_from_logits(target_logits, samp)
            q_all = jax.nn.one_hot(tokens, V) if draft_probs is None else draft_probs
            u = jax.random.uniform(jax.random.fold_in(key, 99), (B, N, N))
            _, toks, n, p_fin = jax.vmap(_no_residual_row)(p_all, q_all, tokens, parents, valid, u)
            fin = jax.random.categorical(jax.random.fold_in(key, 98), jnp.log(p_fin / p_fin.sum(-1, keepdims=True)))
            toks = jax.vmap(lambda o, i, t: o.at[i].set(t))(toks, n, fin.astype(jnp.int32))
        else:
            _, toks, n, _ = vt.verify_tree(target_logits, tokens, parents, valid, samp, first_pos,
                                           draft_probs=draft_probs)
        out = jax.vmap(lambda o, t, c: jax.lax.dynamic_update_slice(o, t, (c,)))(out, toks, count)
        count = count + n + 1
        first_pos = first_pos + n + 1
        pending = jnp.take_along_axis(toks, n[:, None], axis=1)[:, 0]
    return out[:, :N_GEN], count


def _exact_joint(temp, top_k, top_p):
    s = SamplingArrays(temperature=jnp.full((V,), temp), top_k=jnp.full((V,), top_k, jnp.int32),
                       top_p=jnp.full((V,), top_p), seed=jnp.zeros((V,), jnp.uint32))
    T = np.asarray(probs_from_logits(jnp.asarray(P_TABLE), s), np.float64)
    T /= T.sum(-1, keepdims=True)
    return np.einsum("a,ab,bc->abc", T[X0], T, T).reshape(-1)


def _chi2_p(tokens, probs):
    cell = tokens[:, 0] * V * V + tokens[:, 1] * V + tokens[:, 2]
    obs = np.bincount(cell, minlength=V ** 3).astype(np.float64)
    assert obs[probs == 0].sum() == 0, "samples in zero-probability cells"
    exp = probs * len(tokens)
    big = exp >= 5
    o = np.append(obs[big], obs[~big & (probs > 0)].sum())
    e = np.append(exp[big], exp[~big & (probs > 0)].sum())
    if e[-1] < 5:
        o, e = o[:-1], e[:-1]
        o[-1] += obs[~big & (probs > 0)].sum()
        e[-1] += exp[~big & (probs > 0)].sum()
    stat = float(((o - e) ** 2 / e).sum())
    return float(chi2.sf(stat, len(o) - 1))


CASES = [(SAMPLED, 1.0, 0, 1.0), (SAMPLED, 0.7, 4, 0.9), (SHARED, 1.0, 0, 1.0), (SHARED, 1.3, 5, 0.8),
         (STAR, 1.0, 0, 1.0), (STAR, 0.8, 0, 0.7)]


@pytest.mark.parametrize("mode,temp,top_k,top_p", CASES)
def test_tree_speculative_sampling_is_lossless(mode, temp, top_k, top_p):
    samp = SamplingArrays(temperature=jnp.full((ROWS,), temp, jnp.float32), top_k=jnp.full((ROWS,), top_k, jnp.int32),
                          top_p=jnp.full((ROWS,), top_p, jnp.float32), seed=jnp.arange(ROWS, dtype=jnp.uint32) + 7)
    toks, count = simulate(jnp.asarray(P_TABLE), jnp.asarray(Q_TABLE), samp, jax.random.PRNGKey(mode), mode=mode,
                           wrong=False)
    assert int(jnp.min(count)) >= N_GEN
    assert float(jnp.mean(count)) > N_GEN + 0.5  # the trees did get accepted past the root
    p = _chi2_p(np.asarray(toks), _exact_joint(temp, top_k, top_p))
    assert p > 0.01, p


@pytest.mark.parametrize("mode", [SHARED, STAR])
def test_forgetting_the_sibling_residual_fails(mode):
    samp = SamplingArrays(temperature=jnp.ones((ROWS,), jnp.float32), top_k=jnp.zeros((ROWS,), jnp.int32),
                          top_p=jnp.ones((ROWS,), jnp.float32), seed=jnp.arange(ROWS, dtype=jnp.uint32))
    toks, _ = simulate(jnp.asarray(P_TABLE), jnp.asarray(Q_TABLE), samp, jax.random.PRNGKey(5), mode=mode, wrong=True)
    assert _chi2_p(np.asarray(toks), _exact_joint(1.0, 0, 1.0)) < 1e-6
