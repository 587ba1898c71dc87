"""Token-tree verification: greedy and lossless stochastic (SpecInfer-style).

Block per row: N nodes of a proposal tree (specjax/tree.py), node 0 the pending root
token, ``parents[b]`` in topological order, ``node_valid[b]`` marking real nodes. The
target's logits at node i are its distribution for i's children (or, at the last accepted
node, for the correction/bonus token).

Greedy: from the root, move to the first child whose token equals the target argmax at the
current node; stop when none does and emit that argmax.

Stochastic (lossless): at the current node with warped target distribution p, try its
children in node order. Child j carries token x drawn from q_j (a sampled drafter's
distribution, or one-hot for deterministic drafters such as suffix trees): accept it with
probability min(1, p(x) / q_j(x)) and descend; on rejection replace p by
norm(max(p - q_j, 0)) and try the next sibling. If no child is accepted, sample the
correction from the current p; at a leaf that is the bonus token. Sampling i.i.d. siblings
from the same q, or deterministic distinct siblings, both give exactly the target
distribution; a deterministic sibling repeating a rejected token has p(x) = 0 by then
and is rejected.

Returns per row: ``path[B, N]`` node indices of the accepted path (path[0] = 0, entries
past n repeat the last accepted node), ``tokens[B, N]`` (accepted drafts, then the
correction/bonus at index n), ``n[B]`` accepted drafts, ``valid[B, N] = arange(N) <= n``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.sampling import SamplingArrays, argmax, probs_from_logits
from specjax.verify import SALT_ACCEPT, SALT_RESIDUAL, _sample_rows, stream_keys


def _greedy_row(g, tokens, parents, node_valid):
    N = tokens.shape[0]

    def step(_, c):
        cur, n, done, path, out = c
        cand = (parents == cur) & node_valid & (tokens == g[cur]) & ~done
        has = jnp.any(cand)
        nxt = jnp.argmax(cand).astype(jnp.int32)
        out = jnp.where(has, out.at[n].set(g[cur]), out)
        path = jnp.where(has, path.at[n + 1].set(nxt, mode="drop"), path)
        return jnp.where(has, nxt, cur), n + has, done | ~has, path, out

    z = jnp.zeros((N,), jnp.int32)
    cur, n, _, path, out = jax.lax.fori_loop(0, N, step, (jnp.int32(0), jnp.int32(0), jnp.bool_(False), z, z))
    out = out.at[n].set(g[cur])
    path = jnp.where(jnp.arange(N) <= n, path, cur)
    return path, out, n


def verify_tree_greedy(target_logits, tokens, parents, node_valid):
    g = argmax(target_logits)
    return jax.vmap(_greedy_row)(g, tokens, parents, node_valid)


def _sampled_row(p_all, q_all, tokens, parents, node_valid, u):
    """p_all [N, V] warped target probs per node; q_all [N, V] draft distribution of each
    node's token; u [N(depth), N(node)] uniforms. Returns path, out (without the final
    token), n, and the distribution to draw the final token from."""
    N = tokens.shape[0]

    def depth_step(_, c):
        cur, n, done, p, path, out = c

        def sibling(j, s):
            p, acc = s
            is_child = (parents[j] == cur) & node_valid[j] & (acc < 0) & ~done
            x = tokens[j]
            q = q_all[j]
            ok = is_child & (u[n, j] * q[x] < p[x])
            resid = jnp.maximum(p - q, 0.0)
            total = jnp.sum(resid)
            resid = jnp.where(total > 0, resid / jnp.where(total > 0, total, 1.0), p)
            p = jnp.where(is_child & ~ok, resid, p)
            return p, jnp.where(ok, j, acc)

        p, acc = jax.lax.fori_loop(1, N, sibling, (p, jnp.int32(-1)))
        has = acc >= 0
        nxt = jnp.where(has, acc, cur)
        out = jnp.where(has, out.at[n].set(tokens[nxt]), out)
        path = jnp.where(has, path.at[n + 1].set(nxt, mode="drop"), path)
        p = jnp.where(has, p_all[nxt], p)
        return nxt, n + has, done | ~has, p, path, out

    z = jnp.zeros((N,), jnp.int32)
    init = (jnp.int32(0), jnp.int32(0), jnp.bool_(False), p_all[0], z, z)
    cur, n, _, p, path, out = jax.lax.fori_loop(0, N, depth_step, init)
    path = jnp.where(jnp.arange(N) <= n, path, cur)
    return path, out, n, p


def verify_tree_sampled(target_logits, tokens, parents, node_valid, samp: SamplingArrays, first_pos,
                        draft_probs=None):
    """first_pos[b]: absolute position of row b's depth-1 nodes."""
    B, N, V = target_logits.shape
    p_all = probs_from_logits(target_logits, samp)
    q_all = jax.nn.one_hot(tokens, V, dtype=p_all.dtype) if draft_probs is None else draft_probs.astype(p_all.dtype)
    depth_pos = first_pos[:, None] + jnp.arange(N)[None, :]  # position of the child being decided at depth d
    keys = stream_keys(samp.seed, depth_pos, SALT_ACCEPT)  # [B, N]
    u = jax.vmap(jax.vmap(lambda k: jax.vmap(lambda j: jax.random.uniform(jax.random.fold_in(k, j)))(
        jnp.arange(N))))(keys)  # [B, N(depth), N(node)]
    path, out, n, p_final = jax.vmap(_sampled_row)(p_all, q_all, tokens, parents, node_valid, u)
    rkeys = stream_keys(samp.seed, (first_pos + n)[:, None], SALT_RESIDUAL)[:, 0]
    final = _sample_rows(rkeys, p_final)
    out = jax.vmap(lambda o, i, t: o.at[i].set(t))(out, n, final)
    return path, out, n


def verify_tree(target_logits, tokens, parents, node_valid, samp: SamplingArrays, first_pos, draft_probs=None,
                greedy_only: bool = False):
    """Greedy and sampled rows in one batch. Returns (path, tokens, n, valid), see module doc."""
    N = target_logits.shape[1]
    node_valid = node_valid & (jnp.arange(N)[None, :] > 0)
    g_path, g_out, g_n = verify_tree_greedy(target_logits, tokens, parents, node_valid)
    if greedy_only:
        path, out, n = g_path, g_out, g_n
    else:
        s_path, s_out, s_n = verify_tree_sampled(target_logits, tokens, parents, node_valid, samp, first_pos,
                                                 draft_probs)
        sampled = (samp.temperature > 0)[:, None]
        path = jnp.where(sampled, s_path, g_path)
        out = jnp.where(sampled, s_out, g_out)
        n = jnp.where(sampled[:, 0], s_n, g_n)
    valid = jnp.arange(N)[None, :] <= n[:, None]
    return path, out, n, valid
