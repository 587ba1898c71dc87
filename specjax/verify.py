"""Chain verification: greedy and lossless speculative sampling (Leviathan et al. / Chen et al.).

A verification block is ``[pending, d_1 .. d_K]`` for each row: the pending token
(sampled last step, not yet in the cache) followed by K draft tokens, of which
the first ``num_draft[b]`` are real. The target's logits at block index i are its
distribution for the token after block[i], i.e. for ``d_{i+1}`` (i < K) or for the
bonus token (i = K).

Rule per row: accept ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))`` while
all earlier drafts were accepted; at the first rejection sample the correction from
``norm(max(p - q, 0))``; if every real draft is accepted, sample the bonus from p.
p and q are the *warped* distributions (temperature, top-k, top-p applied
identically, see sampling.warp_logits). A deterministic drafter (prompt lookup)
has one-hot q. Greedy rows have one-hot p at the argmax, so the same rule reduces
to "accept while the draft equals the target argmax, then emit the argmax".

Outputs per row: ``tokens[B, K+1]`` (accepted drafts, then the correction/bonus
token at index n), ``n_accepted[B]`` and ``valid[B, K+1] = arange(K+1) <= n``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.sampling import SamplingArrays, argmax, probs_from_logits, row_keys

# Independent random streams derived from one (seed, position) key.
SALT_DRAFT = 1
SALT_ACCEPT = 2
SALT_RESIDUAL = 3


def stream_keys(seed: jax.Array, positions: jax.Array, salt: int) -> jax.Array:
    """Keys [B, T] for absolute positions [B, T] in stream `salt`."""
    B, T = positions.shape
    k = row_keys(jnp.repeat(seed, T), positions.reshape(-1))
    k = jax.vmap(lambda kk: jax.random.fold_in(kk, salt))(k)
    return k.reshape((B, T) + k.shape[1:])


def verify_greedy(target_logits, draft_tokens, num_draft):
    K = draft_tokens.shape[1]
    g = argmax(target_logits)  # [B, K+1]
    match = (draft_tokens == g[:, :K]) & (jnp.arange(K)[None, :] < num_draft[:, None])
    n = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)
    return g, n


def _sample_rows(keys, probs):
    """One categorical draw per row from unnormalised non-negative weights (exponential race)."""
    e = jax.vmap(lambda k: jax.random.exponential(k, probs.shape[-1:]))(keys)
    return argmax(probs / e)


def verify_sampled(target_logits, draft_tokens, num_draft, samp: SamplingArrays, first_pos, draft_probs=None):
    """first_pos[b]: absolute position of d_1 (block index 1) in row b."""
    B, K1, V = target_logits.shape
    K = K1 - 1
    p = probs_from_logits(target_logits, samp)  # [B, K+1, V]
    if draft_probs is None:
        q = jax.nn.one_hot(draft_tokens, V, dtype=p.dtype)
    else:
        q = draft_probs.astype(p.dtype)
    p_d = jnp.take_along_axis(p[:, :K], draft_tokens[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, draft_tokens[..., None], axis=-1)[..., 0]
    pos = first_pos[:, None] + jnp.arange(K)[None, :]
    u = jax.vmap(jax.vmap(jax.random.uniform))(stream_keys(samp.seed, pos, SALT_ACCEPT))
    accept = (u * q_d < p_d) & (jnp.arange(K)[None, :] < num_draft[:, None])
    n = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)  # [B]
    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]  # [B, V]
    q_pad = jnp.concatenate([q, jnp.zeros((B, 1, V), q.dtype)], axis=1)
    q_n = jnp.take_along_axis(q_pad, n[:, None, None], axis=1)[:, 0]
    rejected = n < num_draft
    resid = jnp.where(rejected[:, None], jnp.maximum(p_n - q_n, 0.0), p_n)
    # p == q exactly makes rejection impossible; guard the numerically empty residual anyway.
    resid = jnp.where(jnp.sum(resid, axis=-1, keepdims=True) > 0, resid, p_n)
    rkeys = stream_keys(samp.seed, (first_pos + n)[:, None], SALT_RESIDUAL)[:, 0]
    corr = _sample_rows(rkeys, resid)
    idx = jnp.arange(K1)[None, :]
    drafts_pad = jnp.concatenate([draft_tokens, jnp.zeros((B, 1), jnp.int32)], axis=1)
    tokens = jnp.where(idx < n[:, None], drafts_pad, corr[:, None])
    return tokens, n


def verify_chain(target_logits, draft_tokens, num_draft, samp: SamplingArrays, first_pos, draft_probs=None,
                 greedy_only: bool = False):
    """Returns (tokens [B, K+1], n_accepted [B], valid [B, K+1])."""
    K1 = target_logits.shape[1]
    g_tokens, g_n = verify_greedy(target_logits, draft_tokens, num_draft)
    if greedy_only:
        tokens, n = g_tokens, g_n
    else:
        s_tokens, s_n = verify_sampled(target_logits, draft_tokens, num_draft, samp, first_pos, draft_probs)
        sampled = samp.temperature > 0
        tokens = jnp.where(sampled[:, None], s_tokens, g_tokens)
        n = jnp.where(sampled, s_n, g_n)
    valid = jnp.arange(K1)[None, :] <= n[:, None]
    return tokens, n, valid
