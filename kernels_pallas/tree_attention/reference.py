"""Plain-jnp tree attention: the reference every kernel is tested against, and the CPU path.

One softmax over [prefix slots 0..len-1 of the row's cache] + [the N new tokens under the
tree mask], computed in float32 whatever the input dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

NEG_INF = -1e30


def tree_attention_reference(q, k_blk, v_blk, k_cache, v_cache, lengths, block_mask):
    """q: [B, N, H, hd]; k_blk, v_blk: [B, N, Hkv, hd]; k_cache, v_cache: [B, Hkv, S, hd];
    lengths: [B] (prefix slots committed per row); block_mask: [B, N, N] bool ancestor mask.
    Returns [B, N, H, hd] in q's dtype."""
    B, N, H, hd = q.shape
    Hkv = k_blk.shape[2]
    G = H // Hkv
    S = k_cache.shape[2]
    f32 = jnp.float32
    qg = q.astype(f32).reshape(B, N, Hkv, G, hd) / math.sqrt(hd)
    s_pre = jnp.einsum("bnkgd,bksd->bnkgs", qg, k_cache.astype(f32))
    s_pre = jnp.where((jnp.arange(S)[None, :] < lengths[:, None])[:, None, None, None, :], s_pre, NEG_INF)
    s_blk = jnp.einsum("bnkgd,bjkd->bnkgj", qg, k_blk.astype(f32))
    s_blk = jnp.where(block_mask[:, :, None, None, :], s_blk, NEG_INF)
    p = jax.nn.softmax(jnp.concatenate([s_pre, s_blk], axis=-1), axis=-1)
    o = (jnp.einsum("bnkgs,bksd->bnkgd", p[..., :S], v_cache.astype(f32))
         + jnp.einsum("bnkgj,bjkd->bnkgd", p[..., S:], v_blk.astype(f32)))
    return o.reshape(B, N, H, hd).astype(q.dtype)
