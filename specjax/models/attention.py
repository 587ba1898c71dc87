"""Attention of a block of new tokens over (committed cache prefix + the block itself).

This is the plain-XLA reference path. The prefix part is masked by per-row
lengths only; the block part by the block mask (causal chain or tree ancestor
mask). Both parts share one softmax (scores are concatenated), which is exactly
the log-sum-exp merge of the two partial attentions a kernel would compute.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_NEG = -1e30


def block_attention_xla(q, k_blk, v_blk, k_cache, v_cache, lengths, block_mask, use_prefix=True):
    """q: [B,T,H,hd]; k_blk, v_blk: [B,T,Hkv,hd]; k_cache, v_cache: [B,Hkv,S,hd];
    lengths: [B]; block_mask: [B,T,T] bool. Returns [B,T,H,hd]."""
    B, T, H, hd = q.shape
    Hkv = k_blk.shape[2]
    G = H // Hkv
    scale = 1.0 / math.sqrt(hd)
    qg = q.reshape(B, T, Hkv, G, hd)
    s_blk = jnp.einsum("btkgd,bjkd->btkgj", qg, k_blk, preferred_element_type=jnp.float32) * scale
    s_blk = jnp.where(block_mask[:, :, None, None, :], s_blk, _NEG)
    if use_prefix:
        S = k_cache.shape[2]
        s_pre = jnp.einsum("btkgd,bksd->btkgs", qg, k_cache, preferred_element_type=jnp.float32) * scale
        pre_ok = jnp.arange(S)[None, :] < lengths[:, None]  # [B, S]
        s_pre = jnp.where(pre_ok[:, None, None, None, :], s_pre, _NEG)
        s = jnp.concatenate([s_pre, s_blk], axis=-1)
    else:
        S = 0
        s = s_blk
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("btkgj,bjkd->btkgd", p[..., S:].astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32)
    if use_prefix:
        o = o + jnp.einsum("btkgs,bksd->btkgd", p[..., :S].astype(v_cache.dtype), v_cache,
                           preferred_element_type=jnp.float32)
    return o.reshape(B, T, H, hd).astype(q.dtype)


def block_attention(q, k_blk, v_blk, k_cache, v_cache, lengths, block_mask, *, impl="xla", use_prefix=True):
    if impl == "xla":
        return block_attention_xla(q, k_blk, v_blk, k_cache, v_cache, lengths, block_mask, use_prefix)
    raise ValueError(f"unknown attention_impl {impl!r} (expected 'xla')")
