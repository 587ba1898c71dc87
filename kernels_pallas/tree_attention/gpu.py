"""GPU tree-attention kernel (Pallas, Triton lowering).

Grid (batch row, KV head). Each program keeps its R query rows in registers, attends the
tree block once under the mask bias, then streams the row's committed cache prefix in
`block_kv`-slot tiles with an online softmax. The loop's trip count is the row's own
ceil(len / block_kv), read from memory, so cost follows real lengths, not allocated slots;
tiles are loaded straight out of the stacked [layers, B, Hkv, S, hd] cache (the layer is a
static block index), so no per-layer copy of the cache is made.

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


def _dot_nt(a, b):
    """a [M, D] . b[N, D]^T in float32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _kernel(len_ref, q_ref, kb_ref, vb_ref, bias_ref, kc_ref, vc_ref, o_ref, *, block_kv: int, scale: float):
    q = q_ref[...]
    vb = vb_ref[...]
    s = _dot_nt(q, kb_ref[...]) * scale + bias_ref[...]
    m = jnp.max(s, axis=1)
    p = jnp.exp(s - m[:, None])
    l = jnp.sum(p, axis=1)
    acc = jnp.dot(p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
    n = len_ref[0]

    def body(i, carry):
        m, l, acc = carry
        start = pl.multiple_of(i * block_kv, block_kv)
        k = kc_ref[pl.ds(start, block_kv), :]
        v = vc_ref[pl.ds(start, block_kv), :]
        s = _dot_nt(q, k) * scale
        cols = start + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where(cols < n, s, -1e30)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m_new, l, acc

    m, l, acc = jax.lax.fori_loop(0, (n + block_kv - 1) // block_kv, body, (m, l, acc))
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)


def tree_attention_gpu(lengths, q_rows, kb, vb, bias, k_cache, v_cache, layer: int, *, block_kv: int,
                       interpret: bool, num_warps: int = 4, num_stages: int = 2):
    """Packed inputs (see layout.pack); k_cache, v_cache: [L, B, Hkv, S, hd]. Returns [B, Hkv, R, hd]."""
    B, Hkv, R, hd = q_rows.shape
    Np = kb.shape[2]
    S = k_cache.shape[3]
    kernel = functools.partial(_kernel, block_kv=block_kv, scale=1.0 / math.sqrt(hd))
    sq = pl.squeezed
    cache_spec = pl.BlockSpec((sq, sq, sq, S, hd), lambda b, h: (layer, b, h, 0, 0))
    kwargs = {}
    if not interpret:
        from jax.experimental.pallas import triton as pltr
        kwargs["compiler_params"] = pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    return pl.pallas_call(
        kernel,
        grid=(B, Hkv),
        in_specs=[
            pl.BlockSpec((1,), lambda b, h: (b,)),
            pl.BlockSpec((sq, sq, R, hd), lambda b, h: (b, h, 0, 0)),
            pl.BlockSpec((sq, sq, Np, hd), lambda b, h: (b, h, 0, 0)),
            pl.BlockSpec((sq, sq, Np, hd), lambda b, h: (b, h, 0, 0)),
            pl.BlockSpec((sq, R, Np), lambda b, h: (b, 0, 0)),
            cache_spec,
            cache_spec,
        ],
        out_specs=pl.BlockSpec((sq, sq, R, hd), lambda b, h: (b, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, Hkv, R, hd), q_rows.dtype),
        interpret=interpret,
        name="tree_attention_gpu",
        **kwargs,
    )(lengths.astype(jnp.int32), q_rows, kb, vb, bias, k_cache, v_cache)
