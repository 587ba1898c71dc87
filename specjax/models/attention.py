"""Attention of a block of new tokens over (committed cache prefix + the block itself).

``block_attention_xla`` is the plain-XLA reference: the prefix part is masked by
per-row lengths only, the block part by the block mask (causal chain or tree
ancestor mask), and both share one softmax (scores concatenated), which is
exactly the log-sum-exp merge of the two partial attentions a kernel computes.
``block_attention_chunked`` is the path the model runs (``fwd.attn_chunk`` > 0):
the same attention with the prefix read chunk by chunk under an online softmax,
in the cache's own layout; ``fwd.attention="pallas"`` dispatches decode/verify
blocks to the Pallas kernel.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from specjax.models.options import ForwardOptions

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


def block_attention_chunked(q, k_blk, v_blk, k_all, v_all, layer: int, lengths, block_mask, chunk: int = 256):
    """Same result as block_attention_xla over ``k_all[layer]``, but the prefix is read in chunks
    of `chunk` slots with a *dynamic* trip count of ceil(max(lengths) / chunk), so the cost
    follows the rows' real lengths rather than the allocated slots (online softmax across
    chunks). Chunks are sliced straight out of the stacked ``[L, B, Hkv, S, hd]`` cache:
    on XLA:CPU a static ``k_all[layer]`` copies the whole layer every step (measured 5x slower
    at 2048 slots). Queries are laid out once as ``[B, Hkv, G*T, hd]``, the cache's own order,
    so every dot in the loop runs without transposing its operands or its result."""
    B, T, H, hd = q.shape
    Hkv = k_blk.shape[2]
    G = H // Hkv
    S = k_all.shape[3]
    scale = 1.0 / math.sqrt(hd)
    qk = q.reshape(B, T, Hkv, G, hd).transpose(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, hd)
    kb = k_blk.transpose(0, 2, 1, 3)  # [B, Hkv, T, hd]
    vb = v_blk.transpose(0, 2, 1, 3)
    s_blk = jnp.einsum("bkqd,bkjd->bkqj", qk, kb, preferred_element_type=jnp.float32) * scale  # q = g*T + t
    mask = jnp.tile(block_mask, (1, G, 1))[:, None]  # [B, 1, G*T, T]
    s_blk = jnp.where(mask, s_blk, _NEG)
    m0 = jnp.max(s_blk, axis=-1)  # every query sees itself, so m0 is finite
    p_blk = jnp.exp(s_blk - m0[..., None])
    l0 = jnp.sum(p_blk, axis=-1)
    acc0 = jnp.einsum("bkqj,bkjd->bkqd", p_blk.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
    n_chunks = (jnp.max(lengths) + chunk - 1) // chunk

    def body(i, carry):
        m, l, acc = carry
        start = i * chunk
        kc = jax.lax.dynamic_slice(k_all, (layer, 0, 0, start, 0), (1, B, Hkv, chunk, hd))[0]
        vc = jax.lax.dynamic_slice(v_all, (layer, 0, 0, start, 0), (1, B, Hkv, chunk, hd))[0]
        s = jnp.einsum("bkqd,bksd->bkqs", qk, kc, preferred_element_type=jnp.float32) * scale
        ok = (start + jnp.arange(chunk))[None, :] < lengths[:, None]
        s = jnp.where(ok[:, None, None, :], s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])
        l = l * alpha + jnp.sum(p, axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("bkqs,bksd->bkqd", p.astype(vc.dtype), vc,
                                                  preferred_element_type=jnp.float32)
        return m_new, l, acc

    if S % chunk:
        raise ValueError(f"cache slots {S} must be a multiple of the chunk {chunk}")
    m, l, acc = jax.lax.fori_loop(0, n_chunks, body, (m0, l0, acc0))
    o = acc / l[..., None]  # [B, Hkv, G*T, hd]
    return o.reshape(B, Hkv, G, T, hd).transpose(0, 3, 1, 2, 4).reshape(B, T, H, hd).astype(q.dtype)


def _pallas_sharded(q, k_blk, v_blk, k_all, v_all, layer: int, lengths, block_mask, layout):
    """The Pallas kernel under ``jax.shard_map`` on a sharded engine's mesh: each device runs it on
    its rows (``data``) and its query heads (``model``), with the KV heads and cache in the
    layout's own shardings (a custom kernel is opaque to GSPMD, which would gather everything).
    KV heads fewer than the model shards are replicated: a shard's query heads then all belong
    to one KV head, which it slices out of this layer's cache."""
    from kernels_pallas import tree_attention as ta
    from specjax.errors import SpecjaxError
    from jax.sharding import PartitionSpec as P

    mesh = layout.mesh
    B, T, H, hd = q.shape
    Hkv = k_blk.shape[2]
    G = H // Hkv
    dp, tp = mesh.shape.get("data", 1), mesh.shape.get("model", 1)
    b = "data" if dp > 1 and B % dp == 0 else None
    h = "model" if tp > 1 and H % tp == 0 else None
    kvh = "model" if h and Hkv % tp == 0 else None
    H_loc = H // tp if h else H
    if h and not kvh and G % H_loc:
        raise SpecjaxError(f"the Pallas kernel on {layout.describe()}: {H} heads in {Hkv} KV groups do not split "
                           f"over {tp} model shards (each shard's heads must share one KV head)")

    def local(q, kb, vb, kc, vc, lens, mask):
        if h and not kvh:
            j = jax.lax.axis_index("model") * H_loc // G
            kb, vb = (jax.lax.dynamic_slice_in_dim(a, j, 1, axis=2) for a in (kb, vb))
            kc, vc = (jax.lax.dynamic_slice(a, (layer, 0, j, 0, 0), (1, a.shape[1], 1) + a.shape[3:]) for a in (kc, vc))
            return ta.tree_attention(q, kb, vb, kc, vc, lens, mask, layer=0)
        return ta.tree_attention(q, kb, vb, kc, vc, lens, mask, layer=layer)

    qs, kbs, cs = P(b, None, h, None), P(b, None, kvh, None), P(None, b, kvh, None, None)
    return jax.shard_map(local, mesh=mesh, in_specs=(qs, kbs, kbs, cs, cs, P(b), P(b, None, None)), out_specs=qs,
                         check_vma=False)(q, k_blk, v_blk, k_all, v_all, lengths, block_mask)


def block_attention(q, k_blk, v_blk, k_all, v_all, layer: int, lengths, block_mask, *,
                    fwd: ForwardOptions = ForwardOptions(), use_prefix=True, layout=None):
    """k_all, v_all: the whole stacked cache [L, B, Hkv, S, hd]; `layer` selects this layer's part.

    fwd.attention: "xla" or "pallas" (kernels_pallas.tree_attention: the Triton kernel on GPU,
    the Mosaic kernel on TPU, interpret mode on CPU). Blocks longer than the kernel's
    MAX_TREE_TOKENS (prefill) always take the XLA path, chunked by fwd.attn_chunk. ``layout``: a
    sharded engine's (sharding.Layout): the kernel then runs per device under shard_map."""
    if fwd.attention == "pallas":
        from kernels_pallas import tree_attention as ta  # imported lazily: Pallas is not needed for "xla"

        if q.shape[1] <= ta.MAX_TREE_TOKENS:
            lens = lengths if use_prefix else jnp.zeros_like(lengths)
            if layout is not None:
                return _pallas_sharded(q, k_blk, v_blk, k_all, v_all, layer, lens, block_mask, layout)
            return ta.tree_attention(q, k_blk, v_blk, k_all, v_all, lens, block_mask, layer=layer)
    if fwd.attention == "cpu":
        if layout is not None:
            raise ValueError("attention 'cpu' runs on one device, not on a mesh")
        from specjax.models.cpu import rows_dot

        return rows_dot.block_attention(q, k_blk, v_blk, k_all, v_all, layer,
                                        lengths if use_prefix else jnp.zeros_like(lengths), block_mask)
    T = q.shape[1]
    if T * (q.shape[2] // k_blk.shape[2]) == 1:  # one query row per KV head: an MHA decode step
        q, k_blk, v_blk, block_mask = _two_positions(q, k_blk, v_blk, block_mask)
    return _xla_attention(q, k_blk, v_blk, k_all, v_all, layer, lengths, block_mask, fwd, use_prefix)[:, :T]


def _two_positions(q, k_blk, v_blk, block_mask):
    """A one-token block as a two-position block: the second position is a copy of the token that
    only sees itself and that the real token does not see, so the real token's output is unchanged
    (its score against the copy is masked to exp(-1e30) = 0). A copy, not zeros: zeros lower to a
    ``pad`` op that no K >= 1 program has.

    Why: with one query row per KV head (T = 1 under MHA, e.g. Llama-2-7B's decode step) every
    attention dot is a matrix-vector product, which XLA rewrites as multiply + reduce. On the GPU,
    layout assignment then gives the reduces' cache operands a reduction-friendly layout and,
    through the chunk's dynamic slice, the whole stacked cache the prefix loop carries: two
    transposed copies of the whole [L, B, Hkv, S, hd] cache per layer (an H100 K = 0 step took
    2.7-10.9x a K = 2 step). With two rows the K = 0 step lowers to the op kinds of K >= 1
    (profiling.step_op_kinds; tested). Under GQA a decode step already has G >= 2 query rows per
    KV head: its prefix dots stay matrix-matrix and it is left as it is (compiled for the CPU or
    an H100 it has no whole-cache transpose or copy; padding it too cost 6-9% of tiny-random's
    CPU K = 0 step)."""
    pad = lambda a: jnp.concatenate([a, a], axis=1)  # noqa: E731
    return pad(q), pad(k_blk), pad(v_blk), jnp.tile(block_mask, (1, 2, 2)) & jnp.eye(2, dtype=bool)


def _xla_attention(q, k_blk, v_blk, k_all, v_all, layer: int, lengths, block_mask, fwd: ForwardOptions, use_prefix):
    chunk = fwd.attn_chunk
    if chunk and k_all.shape[3] % chunk == 0:
        # (also without a prefix, a first prefill chunk: its loop then runs no iteration, and the
        # block part's layout is faster than block_attention_xla's; measured in dot_paths.py)
        return block_attention_chunked(q, k_blk, v_blk, k_all, v_all, layer,
                                       lengths if use_prefix else jnp.zeros_like(lengths), block_mask, chunk)
    L, B, Hkv, S, hd = k_all.shape
    kc = jax.lax.dynamic_slice(k_all, (layer, 0, 0, 0, 0), (1, B, Hkv, S, hd))[0]
    vc = jax.lax.dynamic_slice(v_all, (layer, 0, 0, 0, 0), (1, B, Hkv, S, hd))[0]
    return block_attention_xla(q, k_blk, v_blk, kc, vc, lengths, block_mask, use_prefix)
