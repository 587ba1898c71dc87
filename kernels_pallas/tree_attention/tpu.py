"""TPU tree-attention kernel (Pallas, Mosaic TPU lowering).

Grid (batch row, KV head, prefix tile), the tile axis a sequential reduction. Lengths are
scalar-prefetched into SMEM so the K/V index maps can clamp every tile past a row's
length to the row's last needed tile: Mosaic skips the DMA when consecutive grid steps
ask for the same block, so a short row does not pay for the allocated slots. The tree
block is attended at tile 0; running max, denominator and accumulator live in VMEM
scratch; the output is written at the last tile.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES = 128  # m and l are kept lane-broadcast, the layout Mosaic keeps row statistics in


def _dot_nt(a, b):
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _kernel(lens_ref, q_ref, kb_ref, vb_ref, bias_ref, kc_ref, vc_ref, o_ref, m_ref, l_ref, acc_ref, *,
            block_kv: int, scale: float):
    b = pl.program_id(0)
    i = pl.program_id(2)
    R = q_ref.shape[0]

    @pl.when(i == 0)
    def _tree_block():
        vb = vb_ref[...]
        s = _dot_nt(q_ref[...], kb_ref[...]) * scale + bias_ref[...]
        m = jnp.max(s, axis=1, keepdims=True)
        p = jnp.exp(s - m)
        m_ref[...] = jnp.broadcast_to(m, (R, LANES))
        l_ref[...] = jnp.broadcast_to(jnp.sum(p, axis=1, keepdims=True), (R, LANES))
        acc_ref[...] = jnp.dot(p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)

    n = lens_ref[b]
    start = i * block_kv

    @pl.when(start < n)
    def _prefix_tile():
        v = vc_ref[...]
        s = _dot_nt(q_ref[...], kc_ref[...]) * scale
        cols = start + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where(cols < n, s, -1e30)
        m_prev = m_ref[:, :1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(s - m_new)
        l_ref[...] = jnp.broadcast_to(l_ref[:, :1] * alpha + jnp.sum(p, axis=1, keepdims=True), (R, LANES))
        m_ref[...] = jnp.broadcast_to(m_new, (R, LANES))
        acc_ref[...] = acc_ref[...] * alpha + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)

    @pl.when(i == pl.num_programs(2) - 1)
    def _write():
        o_ref[...] = (acc_ref[...] / l_ref[:, :1]).astype(o_ref.dtype)


def tree_attention_tpu(lengths, q_rows, kb, vb, bias, k_cache, v_cache, layer: int, *, block_kv: int,
                       interpret: bool):
    """Packed inputs (see layout.pack); k_cache, v_cache: [L, B, Hkv, S, hd]. Returns [B, Hkv, R, hd]."""
    B, Hkv, R, hd = q_rows.shape
    Np = kb.shape[2]
    S = k_cache.shape[3]
    kernel = functools.partial(_kernel, block_kv=block_kv, scale=1.0 / math.sqrt(hd))
    sq = pl.squeezed

    def kv_index(b, h, i, lens):
        last = jnp.maximum((lens[b] + block_kv - 1) // block_kv - 1, 0)
        return layer, b, h, jnp.minimum(i, last), 0

    cache_spec = pl.BlockSpec((sq, sq, sq, block_kv, hd), kv_index)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(B, Hkv, S // block_kv),
        in_specs=[
            pl.BlockSpec((sq, sq, R, hd), lambda b, h, i, lens: (b, h, 0, 0)),
            pl.BlockSpec((sq, sq, Np, hd), lambda b, h, i, lens: (b, h, 0, 0)),
            pl.BlockSpec((sq, sq, Np, hd), lambda b, h, i, lens: (b, h, 0, 0)),
            pl.BlockSpec((sq, R, Np), lambda b, h, i, lens: (b, 0, 0)),
            cache_spec,
            cache_spec,
        ],
        out_specs=pl.BlockSpec((sq, sq, R, hd), lambda b, h, i, lens: (b, h, 0, 0)),
        scratch_shapes=[pltpu.VMEM((R, LANES), jnp.float32), pltpu.VMEM((R, LANES), jnp.float32),
                        pltpu.VMEM((R, hd), jnp.float32)],
    )
    kwargs = {}
    if not interpret:
        kwargs["compiler_params"] = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((B, Hkv, R, hd), q_rows.dtype),
        interpret=interpret,
        name="tree_attention_tpu",
        **kwargs,
    )(lengths.astype(jnp.int32), q_rows, kb, vb, bias, k_cache, v_cache)
