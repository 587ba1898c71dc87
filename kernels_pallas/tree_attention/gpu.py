"""GPU tree-attention kernel (Pallas, Triton lowering).

Grid (batch row, KV head, query tile, KV split). A program holds `block_q` of its KV head's R
packed query rows in registers and streams a slice of the row's committed cache prefix in
`block_kv`-slot tiles with an online softmax. The row's ceil(len / block_kv) tiles, read
from memory, are dealt evenly over the `num_splits` splits, so cost follows real lengths, not
allocated slots, and a split past a row's last tile runs no iteration and reads nothing. The
tree block is attended once, by split 0. With one split the program writes the normalized
output; with more (flash-decoding: small batches get enough programs to fill the device) each
writes its unnormalized accumulator with its running max and sum, and `merge_splits` combines
them exactly. Tiles are loaded straight out of the stacked [layers, B, Hkv, S, hd] cache (the
layer is a static block index), so no per-layer copy of the cache is made. Query tiles bound
a program's shared memory (tuning.pick_block_q): fp32 trees of 64 nodes under 8 query heads
per KV head, in one 512-row tile, asked an H100 for 360 KB of shared memory (232 KB is the
limit).

Why Triton and not Mosaic GPU: this kernel is a per-program loop over tiles with
data-dependent bounds, which the Triton lowering expresses directly, and it is the path
that runs on both jax 0.10 (this project's CPU stack) and 0.11+ (where it is deprecated but
still supported). A Mosaic GPU version (warpgroup MMA, TMA pipelining) is the follow-up for
Hopper-specific throughput; see kernels_pallas/README.md.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.tree_attention.reference import NEG_INF
from kernels_pallas.tree_attention.tuning import GPU_NUM_STAGES, GPU_NUM_WARPS


def _dot_nt(a, b):
    """a [M, D] . b[N, D]^T in float32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _kernel(len_ref, q_ref, kb_ref, vb_ref, bias_ref, kc_ref, vc_ref, *out_refs, block_kv: int, scale: float,
            num_splits: int):
    q = q_ref[...]
    rows, hd = q.shape

    def tree_block():
        vb = vb_ref[...]
        s = _dot_nt(q, kb_ref[...]) * scale + bias_ref[...]
        m = jnp.max(s, axis=1)
        p = jnp.exp(s - m[:, None])
        return m, jnp.sum(p, axis=1), jnp.dot(p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)

    def nothing_yet():
        return (jnp.full((rows,), NEG_INF, jnp.float32), jnp.zeros((rows,), jnp.float32),
                jnp.zeros((rows, hd), jnp.float32))

    n = len_ref[0]
    num_tiles = (n + block_kv - 1) // block_kv
    if num_splits == 1:
        carry, lo, hi = tree_block(), 0, num_tiles
    else:
        split = pl.program_id(3)
        carry = jax.lax.cond(split == 0, tree_block, nothing_yet)
        per_split = (num_tiles + num_splits - 1) // num_splits
        lo = split * per_split
        hi = jnp.minimum(lo + per_split, num_tiles)  # <= lo past the row's last tile: no iteration

    def body(i, carry):
        m, l, acc = carry
        start = pl.multiple_of(i * block_kv, block_kv)
        k = kc_ref[pl.ds(start, block_kv), :]
        v = vc_ref[pl.ds(start, block_kv), :]
        s = _dot_nt(q, k) * scale
        cols = start + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where(cols < n, s, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m_new, l, acc

    m, l, acc = jax.lax.fori_loop(lo, hi, body, carry)
    if num_splits == 1:
        (o_ref,) = out_refs
        o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    else:
        o_ref, m_ref, l_ref = out_refs
        o_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l


def merge_splits(o_parts, m, l, dtype):
    """Combine the splits' partial softmaxes exactly: o_parts [B, Hkv, splits, R, hd] (unnormalized),
    m, l [B, Hkv, splits, R] (running max and sum). A split that saw nothing has m = NEG_INF and
    l = 0, so its weight is 0; split 0 always holds the tree block's root, so the sum is > 0."""
    m_all = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - m_all)
    o = jnp.sum(o_parts * w[..., None], axis=2) / jnp.sum(l * w, axis=2)[..., None]
    return o.astype(dtype)


def tree_attention_gpu(lengths, q_rows, kb, vb, bias, k_cache, v_cache, layer: int, *, block_kv: int,
                       block_q: int, num_splits: int, interpret: bool, num_warps: int = GPU_NUM_WARPS,
                       num_stages: int = GPU_NUM_STAGES):
    """Packed inputs (see layout.pack); k_cache, v_cache: [L, B, Hkv, S, hd]; block_q divides R.
    Returns [B, Hkv, R, hd]."""
    B, Hkv, R, hd = q_rows.shape
    Np = kb.shape[2]
    S = k_cache.shape[3]
    kernel = functools.partial(_kernel, block_kv=block_kv, scale=1.0 / math.sqrt(hd), num_splits=num_splits)
    sq = pl.squeezed
    cache_spec = pl.BlockSpec((sq, sq, sq, S, hd), lambda b, h, qi, j: (layer, b, h, 0, 0))
    q_spec = pl.BlockSpec((sq, sq, block_q, hd), lambda b, h, qi, j: (b, h, qi, 0))
    if num_splits == 1:
        out_specs = q_spec
        out_shape = jax.ShapeDtypeStruct((B, Hkv, R, hd), q_rows.dtype)
    else:
        stat_spec = pl.BlockSpec((sq, sq, sq, block_q), lambda b, h, qi, j: (b, h, j, qi))
        out_specs = [pl.BlockSpec((sq, sq, sq, block_q, hd), lambda b, h, qi, j: (b, h, j, qi, 0)), stat_spec,
                     stat_spec]
        out_shape = [jax.ShapeDtypeStruct((B, Hkv, num_splits, R, hd), jnp.float32),
                     jax.ShapeDtypeStruct((B, Hkv, num_splits, R), jnp.float32),
                     jax.ShapeDtypeStruct((B, Hkv, num_splits, R), jnp.float32)]
    kwargs = {}
    if not interpret:
        from jax.experimental.pallas import triton as pltr
        kwargs["compiler_params"] = pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    out = pl.pallas_call(
        kernel,
        grid=(B, Hkv, R // block_q, num_splits),
        in_specs=[
            pl.BlockSpec((1,), lambda b, h, qi, j: (b,)),
            q_spec,
            pl.BlockSpec((sq, sq, Np, hd), lambda b, h, qi, j: (b, h, 0, 0)),
            pl.BlockSpec((sq, sq, Np, hd), lambda b, h, qi, j: (b, h, 0, 0)),
            pl.BlockSpec((sq, block_q, Np), lambda b, h, qi, j: (b, qi, 0)),
            cache_spec,
            cache_spec,
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        name="tree_attention_gpu",
        **kwargs,
    )(lengths.astype(jnp.int32), q_rows, kb, vb, bias, k_cache, v_cache)
    return out if num_splits == 1 else merge_splits(*out, q_rows.dtype)
