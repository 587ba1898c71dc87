"""Llama-family decoder as pure functions over a params pytree.

Covers Llama 1/2/3 (incl. Llama-3 RoPE scaling), SmolLM2 (tied embeddings) and
Qwen2 (q/k/v bias). Layers are a Python list of per-layer dicts (unrolled at
trace time; see ``forward``), so a layer-skip draft is just ``layers[:n]``.

The forward pass takes a block of T new tokens per row, their RoPE positions
(per row, so rows may be at different lengths and tree nodes at
``seq_len + depth``) and a boolean mask over the new block ``[B, T, T]`` (a
causal chain or any tree's ancestor mask). Every new token also sees the row's
committed cache prefix ``[0, lengths[b])``. The block's K/V are written to the
cache at slots ``lengths + arange(T)``; lengths are left for the caller to
advance (see cache.py).

Params layout (activations are ``x @ W``)::

    embed [V, D]; final_norm [D]; lm_head [D, V] (absent when tied)
    layers: list of L dicts: attn_norm [D]; wq [D, H*hd]; wk, wv [D, Hkv*hd];
            bq [H*hd], bk, bv [Hkv*hd] (qwen2 only); wo [H*hd, D];
            mlp_norm [D]; w_gate, w_up [D, F]; w_down [F, D]
"""

from __future__ import annotations


import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from specjax import cache as kv
from specjax.config import ModelConfig
from specjax.models.options import ForwardOptions
from specjax.models import attention as attn_lib


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse RoPE frequencies [hd/2] (numpy; a trace-time constant)."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    s = cfg.rope_scaling
    if s is not None:
        wavelen = 2 * math.pi / inv
        low_wl = s.original_max_position / s.low_freq_factor
        high_wl = s.original_max_position / s.high_freq_factor
        smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        scaled = np.where(wavelen > low_wl, inv / s.factor, inv)
        mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        inv = np.where(mid, (1 - smooth) * inv / s.factor + smooth * inv, scaled)
    return inv.astype(np.float32)


# A position p is split as hi * ROPE_LO + lo, and its angles' cos and sin are put together from
# two small tables of exact values (cos(a + b) = cos a cos b - sin a sin b): a gather and a few
# multiplies per element instead of transcendentals.
ROPE_LO = 64


@functools.lru_cache(maxsize=16)
def _rope_parts(inv_freq: bytes, n_hi: int) -> tuple[np.ndarray, ...]:
    """cos and sin of the angles of positions hi * ROPE_LO (hi < n_hi) and lo (< ROPE_LO), each
    [n, hd/2], computed in float64 and rounded once to float32."""
    inv = np.frombuffer(inv_freq, np.float32).astype(np.float64)
    hi = np.arange(n_hi, dtype=np.float64)[:, None] * ROPE_LO * inv
    lo = np.arange(ROPE_LO, dtype=np.float64)[:, None] * inv
    return tuple(f(a).astype(np.float32) for a in (hi, lo) for f in (np.cos, np.sin))


def rope_tables(positions: jax.Array, cfg: ModelConfig, barrier: bool = False) -> tuple[jax.Array, jax.Array]:
    """cos and sin [B, T, 1, hd/2] of every position's RoPE angles, computed once per forward.

    A position's values do not depend on the block it is in: they are gathered from exact tables
    (``_rope_parts``) and combined with plain multiplies and adds. XLA:CPU's own cos and sin
    vectorise differently for different block shapes, so a token's rotation differed in the
    last bit between a one-token decode step and a verify block (and, with int8 activations,
    that became another code and another token). With these tables, the rows kernel and the CPU
    attention kernel, a decode step and a verify block compute every token's logits with the same
    bits (tests/test_rows_dot.py). Positions past ``cfg.max_position`` (padding) are clipped.

    ``barrier`` (ForwardOptions.rope_once): compute them inside a conditional, so that XLA:CPU
    does not fuse them into (and evaluate them again in) every layer's rotation, 60 fusions a
    SmolLM2 step; ``optimization_barrier`` does not stop that fusion there, a conditional does.
    Both branches compute the same tables, so the (data-dependent) predicate never matters."""
    inv = rope_inv_freq(cfg)
    parts = [jnp.asarray(a) for a in _rope_parts(inv.tobytes(), cfg.max_position // ROPE_LO + 1)]

    def tables(p):
        take = lambda t, i: jnp.take(t, i, axis=0, mode="clip")  # noqa: E731
        hi, lo = p // ROPE_LO, p % ROPE_LO
        ch, sh, cl, sl = take(parts[0], hi), take(parts[1], hi), take(parts[2], lo), take(parts[3], lo)
        return (ch * cl - sh * sl)[:, :, None, :], (sh * cl + ch * sl)[:, :, None, :]

    if not barrier:
        return tables(positions)
    return jax.lax.cond(positions[0, 0] >= 0, tables, tables, positions)


def apply_rope(x: jax.Array, tables) -> jax.Array:
    """Rotate-half RoPE. x: [B, T, H, hd]; ``tables``: rope_tables of its positions (``forward``
    shares them across layers)."""
    cos, sin = tables
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def sum_fixed_order(a: jax.Array, widths: tuple[int, ...] = (64, 8, 1)) -> jax.Array:
    """Sum over the last axis (kept, size 1) in one order whatever the array's shape: the row cut
    into pieces of 64 (zero-padded to whole pieces) added in turn, then the 64 lanes as 8 pieces
    of 8 in turn, then the 8 in turn. Every intermediate is read once, so XLA:CPU fuses the whole
    sum into one or two loops (a halving tree, each half read twice, took 6 fusions per norm:
    12 of a SmolLM2 layer's 29 element-wise calls, step_breakdown.py)."""
    for w in widths:
        n = a.shape[-1]
        if n % w:
            a = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, w - n % w)])
            n = a.shape[-1]
        s = a[..., :w]
        for i in range(1, n // w):
            s = s + a[..., i * w:(i + 1) * w]
        a = s
    return a


def rms_norm(x: jax.Array, w: jax.Array, eps: float, fixed_order: bool = False) -> jax.Array:
    """``fixed_order``: sum the squares with ``sum_fixed_order``, so a row's norm has the same bits
    in any block. XLA:CPU's own reduce sums a row in another order once the block is large enough
    (from 8 rows 576 wide, 16 rows 256 wide): a SmolLM2 token's norm differed in the last bit
    between a decode step and a 9-token verify block, and int8 rounding made that another code."""
    xf = x.astype(jnp.float32)
    sq = xf * xf
    ms = sum_fixed_order(sq) / xf.shape[-1] if fixed_order else jnp.mean(sq, axis=-1, keepdims=True)
    y = xf * jax.lax.rsqrt(ms + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def causal_mask(batch: int, t: int) -> jax.Array:
    """Chain mask over a block of t new tokens: [B, t, t]."""
    m = jnp.tril(jnp.ones((t, t), bool))
    return jnp.broadcast_to(m, (batch, t, t))


# From 2 up to `small_rows` activation rows (batch x block), a projection can run as one
# matrix-vector product per row in a fori_loop instead of one skinny GEMM. Whether that pays
# depends on the CPU's GEMM kernels, so it is a setting (ForwardOptions.small_rows), off by default:
# - on the machine of the first benchmarks (CPU model not recorded), Eigen's 2-8 row GEMM
#   streamed weights at about half the GEMV rate (30 layers of 576x1536 weights, 5 rows:
#   14.9 ms as GEMMs, 10.2 ms as loops);
# - on the AVX-512 box of the SmartSpec sweeps, GEMMs won at every row count (all SmolLM2
#   projections + head, benchmarks/projection_rows.py: 2 rows 21.8 vs 59.7 ms, 8 rows 42.9 vs
#   126.9 ms), and the loop made a batch-8 decode step (8 rows) cost more than a batch-8 K=1
#   verify (16 rows, GEMM).
# A loop, not an unrolled list: one dot kernel per weight (an unrolled version exhausted the
# process's memory maps after a few dozen compiled variants).


def _rowwise_matvec(flat: jax.Array, w: jax.Array) -> jax.Array:
    def body(i, out):
        row = jax.lax.dynamic_slice_in_dim(flat, i, 1, 0)
        return jax.lax.dynamic_update_slice_in_dim(out, row @ w, i, 0)

    init = jnp.zeros((flat.shape[0], w.shape[-1]), jnp.result_type(flat, w))
    return jax.lax.fori_loop(0, flat.shape[0], body, init)


ROWS_SUFFIX = ":rows"  # weights packed for the CPU rows kernel (pack_for_rows)
LAYER_PACKS = "layers" + ROWS_SUFFIX  # {projection: its packs of every layer as one stack}
PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


# Projections of one input that the rows kernel runs as one call: their stacks' column blocks
# concatenated (fuse_packs). A decode step made 7 kernel calls a layer, the smaller ones bound by
# the call's fixed cost (q/o/k/v read at 12-19 GB/s, gate/up at 28: step_breakdown.py); fused, 4.
# Each output column is summed as in its own call, so the bits are the same.
FUSED = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}


def out_width(cfg: ModelConfig, name: str) -> int:
    """A projection's output columns (what its packed blocks, padded to 16, no longer say)."""
    if name in FUSED:
        return sum(out_width(cfg, n) for n in FUSED[name])
    q, kv_ = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"wq": q, "wk": kv_, "wv": kv_, "wo": cfg.hidden_size, "w_gate": cfg.intermediate_size,
            "w_up": cfg.intermediate_size, "w_down": cfg.hidden_size}[name]


def fuse_packs(packs: dict, widths: dict) -> dict:
    """``packs`` ({projection: stack}) with each ``FUSED`` group whose stacks concatenate
    (rows_dot.concat_stacks: one format and layout, the same inputs, ``widths`` [name] columns
    filling whole blocks) replaced by its one stack."""
    from specjax.models.cpu import rows_dot

    out = dict(packs)
    for fused, names in FUSED.items():
        if not all(n in packs and rows_dot.stack_width(packs[n]) == widths[n] for n in names):
            continue
        stack = rows_dot.concat_stacks([packs[n] for n in names])
        if stack is not None:
            out[fused] = stack
            for n in names:
                del out[n]
    return out


def pack_for_rows(params, cfg: ModelConfig, native: dict | None = None):
    """``params`` plus each projection and the vocab head packed for the CPU rows kernel
    (models.cpu.rows_dot), which ``ForwardOptions.rows_kernel`` uses for decode and verify blocks;
    prefill keeps the originals. A projection's packs of every layer are one stack
    (``LAYER_PACKS``: ``{name: [L, ...]}``, rows_dot.stack_packs) that the kernel reads layer i of
    in place, so the per-layer list and a scan over layers (``scan_layers``) read the same
    arrays; the head is ``head:rows``. ``native``: weights already packed in their file's
    quantized blocks (weights.gguf_row_packs: ``{"layers": {name: stack}, "head": pack}``; the same
    values in a fraction of the bytes), used where given; the rest are packed from float32, which
    adds their size again (the originals are shared)."""
    from specjax.models.cpu import rows_dot

    # (Packing does not need the kernel built: its registration is the compile's or the trace's,
    # engine.table.StepTable._compile, so a cold build runs beside the model load and the prefill.)
    if "head" + ROWS_SUFFIX in params:
        return params
    native = native or {"layers": {}}
    out = dict(params)
    out[LAYER_PACKS] = fuse_packs({n: native["layers"][n] if n in native["layers"] else
                                   rows_dot.stack_packs([rows_dot.pack(lp[n]) for lp in params["layers"]])
                                   for n in PROJECTIONS}, {n: out_width(cfg, n) for n in PROJECTIONS})
    out["head" + ROWS_SUFFIX] = native.get("head")
    if out["head" + ROWS_SUFFIX] is None:
        out["head" + ROWS_SUFFIX] = rows_dot.pack(params["embed"].T if cfg.tie_embeddings else params["lm_head"])
    return out


def layer_packs(params, i: int) -> dict:
    """Layer ``i``'s packs from params of ``pack_for_rows`` as arrays of their own ({name: pack},
    copies): what a benchmark timing the kernel layer by layer reads."""
    from specjax.models.cpu import rows_dot

    return {n: rows_dot.layer_of(w, i) for n, w in params[LAYER_PACKS].items()}


def stack_layers(params):
    """``params`` with ``layers`` as one dict of stacked [L, ...] arrays, the form
    ``ForwardOptions.scan_layers`` runs (idempotent)."""
    layers = params["layers"]
    if isinstance(layers, dict):
        return params
    return dict(params, layers={k: jnp.stack([lp[k] for lp in layers]) for k in layers[0]})


def dense(x: jax.Array, w: jax.Array | None, fwd: ForwardOptions = ForwardOptions(), packed=None, layer=None,
          n: int | None = None) -> jax.Array:
    """``x @ w`` for x [..., K], w [K, N], in the form ``fwd`` picks for the row count: the CPU
    rows kernel on ``packed`` (pack_for_rows; with ``layer``, layer ``layer`` of a stack; ``n``
    the output columns, and then ``w`` may be None) up to ``fwd.rows_kernel`` rows (every row
    count with a low-precision ``fwd.rows_activations``), per-row matvecs from 2 to ``fwd.small_rows``, else XLA's dot."""
    lead = x.shape[:-1]
    rows = int(np.prod(lead)) if lead else 1
    if fwd.kernel_rows(rows):
        if packed is None:
            raise ValueError("ForwardOptions.rows_kernel needs params from llama.pack_for_rows")
        from specjax.models.cpu import rows_dot

        return rows_dot.rows_dot(x, packed, w.shape[-1] if n is None else n, activations=fwd.rows_activations, layer=layer)
    if 1 < rows <= fwd.small_rows:
        return _rowwise_matvec(x.reshape(rows, x.shape[-1]), w).reshape(*lead, w.shape[-1])
    return x @ w


def pack_rows(a: jax.Array, pack: jax.Array) -> jax.Array:
    """[B, T, ...] block -> [P, ...] rows of the packed tokens (index B*T: padding, zeros)."""
    flat = a.reshape((-1,) + a.shape[2:])
    return jnp.take(flat, pack, axis=0, mode="fill", fill_value=0)


def unpack_rows(a: jax.Array, pack: jax.Array, B: int, T: int) -> jax.Array:
    """[P, ...] packed rows -> the [B, T, ...] block (zeros where no token; padding dropped)."""
    out = jnp.zeros((B * T,) + a.shape[1:], a.dtype).at[pack].set(a, mode="drop")
    return out.reshape((B, T) + a.shape[1:])


def _layer(cfg: ModelConfig, rope, fwd: ForwardOptions, use_prefix: bool, x, lp, k_all, v_all, layer, lengths,
           positions, block_mask, pack=None, layout=None, embed_in=None, kv_before=None, packs=None, pack_layer=None):
    """One decoder layer. Writes this layer's block K/V into the stacked cache *before*
    attention reads it: XLA:CPU updates the donated cache in place only when no read of
    the old buffer is pending (reading first measured two full-cache copies per step).
    ``pack``: x holds only the block's real tokens ([P, D], see ``forward``); the projections
    and the MLP run on those rows, attention on the [B, T] block. ``embed_in``: token
    embeddings [B, T, D] of a feature head's layer (drafters.eagle, EAGLE-3): q/k/v then read
    [norm(embedding), norm(x)] (wq/wk/wv of 2D rows) while the residual stream stays x.
    ``kv_before``: (k, v) [B, S', Hkv, hd] of earlier entries the block's queries also see, before
    its own (``block_mask`` [B, T, S' + T]); the feature head's training-time test
    (distill.eagle_train) attends to its earlier unroll steps this way. ``packs``: the rows
    kernel's stacks (``LAYER_PACKS``), read at ``layer`` (or ``pack_layer``: a feature head's
    upper layers, whose stacks hold them alone); ``lp`` then needs no projections."""
    B, T = positions.shape
    H, Hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    block = (lambda a: a) if pack is None else (lambda a: unpack_rows(a, pack, B, T))
    at = layer if pack_layer is None else pack_layer

    def proj(a, name):
        return dense(a, lp.get(name), fwd, None if packs is None else packs.get(name), at, out_width(cfg, name))

    def projs(a, fused):  # FUSED[fused]'s projections of a: one kernel call where their stacks are one
        names = FUSED[fused]
        if packs is None or fused not in packs or not fwd.kernel_rows(int(np.prod(a.shape[:-1]))):
            return tuple(proj(a, n) for n in names)
        widths = [out_width(cfg, n) for n in names]
        y = dense(a, None, fwd, packs[fused], at, sum(widths))
        return tuple(jnp.split(y, np.cumsum(widths)[:-1].tolist(), axis=-1))

    def norm(a, name):
        return rms_norm(a, lp[name], cfg.rms_eps, fwd.exact_blocks)

    h = norm(x, "attn_norm")
    if embed_in is not None:
        h = jnp.concatenate([norm(embed_in, "embed_norm"), h], axis=-1)
    q, k, v = projs(h, "wqkv")
    if cfg.qkv_bias:
        q = q + lp["bq"]
        k = k + lp["bk"]
        v = v + lp["bv"]
    q = apply_rope(block(q).reshape(B, T, H, hd), rope)
    k = apply_rope(block(k).reshape(B, T, Hkv, hd), rope)
    v = block(v).reshape(B, T, Hkv, hd)
    k_all, v_all = kv.write_layer_block(k_all, v_all, layer, lengths, k, v)
    if kv_before is not None:
        k, v = jnp.concatenate([kv_before[0], k], axis=1), jnp.concatenate([kv_before[1], v], axis=1)
    o = attn_lib.block_attention(
        q, k, v, k_all, v_all, layer, lengths, block_mask, fwd=fwd, use_prefix=use_prefix, layout=layout
    )
    o = o.reshape(B, T, H * hd)
    x = x + proj(o if pack is None else pack_rows(o, pack), "wo")
    h = norm(x, "mlp_norm")
    g, u = projs(h, "w_gate_up")
    x = x + proj(jax.nn.silu(g) * u, "w_down")
    return x, k_all, v_all


def forward(
    params,
    tokens: jax.Array,
    positions: jax.Array,
    cache: kv.KVCache,
    block_mask: jax.Array,
    *,
    cfg: ModelConfig,
    num_layers: int | None = None,
    fwd: ForwardOptions = ForwardOptions(),
    use_prefix: bool = True,
    logits_at: jax.Array | None = None,
    return_hidden: bool = False,
    pack: jax.Array | None = None,
    layout=None,
    features: tuple[int, ...] = (),
):
    """Run T new tokens per row; returns ``(logits, cache_with_block_written[, hidden][, features])``.

    tokens, positions: [B, T] int32. block_mask: [B, T, T] bool.
    num_layers: run only the first n layers (layer-skip draft); the cache must
      then have n layers too.
    use_prefix: False when every row's cache is known to be empty (prefill),
      which skips reading the cache.
    logits_at: optional [B, M] indices into the block; only those positions get
      logits (saves the vocab projection for long prefills).
    pack: optional [P] indices into the flattened [B*T] block of the tokens that matter (index
      B*T pads). Embedding, projections, MLP and the vocab head then run on P rows instead of
      B*T (a verify block whose rows carry different draft counts costs its real tokens); only
      attention and the cache write see the [B, T] block. Logits come back as [B, T, V] with
      zeros at the positions not packed, whose cache entries are written but meaningless.
    layout: a sharded engine's sharding.Layout (the Pallas attention kernel runs under shard_map).
    features: layer indices whose inputs (the residual stream entering them) come back too, as
      one [B, T, len(features) * D] array after the others (a feature head's drafting signal,
      ``feature_layers``; every block position, packed ones unpacked); index ``num_layers`` is
      the last layer's output (Medusa's heads read it). Empty (the default) adds nothing to the
      traced program.
    """
    layers = params["layers"]
    stacked = isinstance(layers, dict)
    if stacked != fwd.scan_stacked:
        raise ValueError("ForwardOptions.scan_layers without the rows kernel needs params from llama.stack_layers "
                         "(and every other form the per-layer list)")
    if features and stacked:
        raise ValueError("target features (a feature head) are taken from the per-layer list, not scan_layers")
    if num_layers is not None:
        layers = jax.tree_util.tree_map(lambda a: a[:num_layers], layers) if stacked else layers[:num_layers]
    n_layers = next(iter(layers.values())).shape[0] if stacked else len(layers)
    if cache.k.shape[0] != n_layers:
        raise ValueError(f"cache has {cache.k.shape[0]} layers, model slice has {n_layers}")
    rope = rope_tables(positions, cfg, barrier=fwd.rope_barrier())
    B, T = tokens.shape
    packs = params.get(LAYER_PACKS)
    # scan_layers with the rows kernel: a block the kernel takes whole runs the layers as one
    # loop whose counter picks each layer's packs in place (a larger one, unrolled on the list)
    scan_packs = (fwd.scan_layers and not stacked and packs is not None
                  and fwd.kernel_rows(B * T if pack is None else pack.shape[0]))
    if pack is not None and (logits_at is not None or return_hidden):
        raise ValueError("pack does not combine with logits_at / return_hidden")
    x = params["embed"][tokens if pack is None else pack_rows(tokens[..., None], pack)[:, 0]]
    # a sharded engine's activations between layers: rows over ``data``, the hidden size whole on
    # every model shard (the rules' "batch" / "embed"); packed rows mix the batch, so GSPMD places them
    pin = (lambda a: a) if layout is None or pack is not None else (
        lambda a: jax.lax.with_sharding_constraint(a, layout.rows(a.shape)))
    x = pin(x)
    # By default layers are unrolled over a Python list of per-layer dicts: on XLA:CPU both
    # lax.scan over stacked weights and static slices of a stacked array copy the
    # weights every step (measured 1.6x-10x slower for decode). fwd.scan_layers: one scan, over
    # stacked weights (stack_layers) or, with the rows kernel, over the packs' stacks in place.
    k_all, v_all = cache.k, cache.v
    if stacked:
        # The whole cache rides in the carry, written in place at the loop counter's layer (as
        # scan inputs/outputs it would be sliced out and stacked again: two cache copies a step).
        def body(carry, xs):
            x, k_all, v_all = carry
            lp, i = xs
            x, k_all, v_all = _layer(cfg, rope, fwd, use_prefix, x, lp, k_all, v_all, i, cache.lengths, positions,
                                     block_mask, pack, layout)
            return (pin(x), k_all, v_all), None

        (x, k_all, v_all), _ = jax.lax.scan(body, (x, k_all, v_all), (layers, jnp.arange(n_layers, dtype=jnp.int32)),
                                            unroll=int(fwd.scan_layers))
    elif scan_packs:
        # Only the small per-layer vectors (norms, biases) are stacked, in the program; the
        # projections are the packs' stacks, read in place at the counter. Feature layers' inputs
        # ride in the carry.
        small = {k: jnp.stack([lp[k] for lp in layers]) for k in layers[0] if k not in PROJECTIONS}

        def body(carry, xs):
            x, k_all, v_all, taken = carry
            lp, i = xs
            taken = tuple(jnp.where(i == f, x, t) for f, t in zip(features, taken))
            x, k_all, v_all = _layer(cfg, rope, fwd, use_prefix, x, lp, k_all, v_all, i, cache.lengths, positions,
                                     block_mask, pack, layout, packs=packs)
            return (x, k_all, v_all, taken), None

        carry = (x, k_all, v_all, tuple(jnp.zeros_like(x) for _ in features))
        (x, k_all, v_all, got), _ = jax.lax.scan(body, carry, (small, jnp.arange(n_layers, dtype=jnp.int32)),
                                                 unroll=int(fwd.scan_layers))
        taken = dict(zip(features, got))
    else:
        taken = {}
        for i, lp in enumerate(layers):
            if i in features:
                taken[i] = x
            x, k_all, v_all = _layer(cfg, rope, fwd, use_prefix, x, lp, k_all, v_all, i,
                                     cache.lengths, positions, block_mask, pack, layout, packs=packs)
            x = pin(x)
    if n_layers in features:  # (index n_layers: the last layer's output, before the final norm)
        taken[n_layers] = x
    new_cache = dataclasses.replace(cache, k=k_all, v=v_all)
    logits, hidden = final_logits(params, x, cfg=cfg, fwd=fwd, logits_at=logits_at)
    if pack is not None:
        logits = unpack_rows(logits, pack, B, T)
    out = (logits, new_cache) + ((hidden,) if return_hidden else ())
    if features:
        feats = jnp.concatenate([taken[i] for i in features], axis=-1)
        out += (feats if pack is None else unpack_rows(feats, pack, B, T),)
    return out


def final_logits(params, x, *, cfg: ModelConfig, fwd: ForwardOptions, logits_at: jax.Array | None = None):
    """The last layer's output ``x`` [..., D] through the final norm and the vocab head (only at
    ``logits_at`` [B, M] block indices, if given): (logits, the normed hidden states of every
    position). ``forward``'s end, and a layered prefill's last call (engine.step)."""
    x = rms_norm(x, params["final_norm"], cfg.rms_eps, fwd.exact_blocks)
    hidden = x
    if logits_at is not None:
        x = jnp.take_along_axis(x, logits_at[..., None], axis=1)
    head = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
    if fwd.kernel_rows(int(np.prod(x.shape[:-1]))):
        return dense(x, head, fwd, params.get("head" + ROWS_SUFFIX)), hidden
    return jnp.dot(x, head, preferred_element_type=jnp.float32), hidden


def layer_params(params, i: int) -> dict:
    """Layer ``i``'s params as ``decoder_layer`` takes them: its dict, with the rows kernel's
    stacks (``LAYER_PACKS``, read at the run-time layer index) where the params have them."""
    lp = params["layers"][i]
    return dict(lp, **{LAYER_PACKS: params[LAYER_PACKS]}) if LAYER_PACKS in params else lp


def decoder_layer(lp, x, cache: kv.KVCache, layer, *, cfg: ModelConfig, fwd: ForwardOptions, use_prefix: bool):
    """One decoder layer over a causal block of new tokens at each row's cache length (a prefill
    chunk): ``forward``'s layer body on its own, with ``layer`` (a traced index into the stacked
    cache and the rows kernel's stacks) chosen at run time, so one compiled program serves every
    layer of the same shapes (engine.step's layered prefill; ``lp`` from ``layer_params``).
    Returns (x, the cache with the layer's block written)."""
    B, T = x.shape[:2]
    positions = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    rope = rope_tables(positions, cfg, barrier=fwd.rope_barrier())
    x, k_all, v_all = _layer(cfg, rope, fwd, use_prefix, x, lp, cache.k, cache.v, layer, cache.lengths, positions,
                             causal_mask(B, T), packs=lp.get(LAYER_PACKS))
    return x, dataclasses.replace(cache, k=k_all, v=v_all)


def feature_layers(num_layers: int) -> tuple[int, int, int]:
    """The layers whose inputs an EAGLE-3 head reads: a low, a middle and a high one (2, N/2 and
    N - 3, the common convention), clamped into 0..N-1 for tiny models (repeats allowed: the
    head always fuses three)."""
    return tuple(sorted(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)))


def init_cache_for(cfg: ModelConfig, batch: int, slots: int, dtype=jnp.float32, num_layers: int | None = None) -> kv.KVCache:
    return kv.init_cache(num_layers or cfg.num_layers, batch, slots, cfg.num_kv_heads, cfg.head_dim, dtype)


def init_random_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32, on_device: bool = False):
    """Random weights for tests and shape-only benchmarks (the main job never uses these).

    ``on_device``: draw with jax.random on the default device instead of numpy on the host
    (other values, same structure and scales): a 7B-shaped model is drawn in seconds on an
    accelerator, while the host path would spend minutes and twice the model in host memory."""
    D, F, H, Hkv, hd, L, V = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                              cfg.head_dim, cfg.num_layers, cfg.vocab_size)
    if on_device:
        keys = iter(jax.random.split(jax.random.PRNGKey(seed), 16 * L + 8))
        normal = jax.jit(lambda k, shape, scale: (jax.random.normal(k, shape, jnp.float32) * scale).astype(dtype),
                         static_argnums=1)

        def draw(*shape, scale):
            return normal(next(keys), shape, scale)
    else:
        rng = np.random.default_rng(seed)

        def draw(*shape, scale):
            return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * scale, dtype)

    def w(*shape, scale=None):
        return draw(*shape, scale=scale if scale is not None else 1.0 / math.sqrt(shape[-2]))

    def layer():
        lp = {
            "attn_norm": 1.0 + draw(D, scale=0.1),
            "wq": w(D, H * hd), "wk": w(D, Hkv * hd), "wv": w(D, Hkv * hd), "wo": w(H * hd, D),
            "mlp_norm": 1.0 + draw(D, scale=0.1),
            "w_gate": w(D, F), "w_up": w(D, F), "w_down": w(F, D),
        }
        if cfg.qkv_bias:
            lp.update(bq=w(1, H * hd, scale=0.1)[0], bk=w(1, Hkv * hd, scale=0.1)[0], bv=w(1, Hkv * hd, scale=0.1)[0])
        return lp

    layers = [layer() for _ in range(L)]
    params = {"embed": w(V, D, scale=1.0), "layers": layers, "final_norm": jnp.ones((D,), dtype)}
    if not cfg.tie_embeddings:
        # A larger head scale gives peaked next-token distributions, like a trained model.
        params["lm_head"] = w(D, V, scale=4.0 / math.sqrt(D))
    return params
