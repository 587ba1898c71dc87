"""Tree attention for speculative verification: N new tokens per row (a chain or a token
tree) attend their row's committed KV prefix plus the new block under the tree mask.

    tree_attention(q, k_blk, v_blk, k_cache, v_cache, lengths, block_mask, layer=...)

Backends: ``"gpu"`` (Pallas/Triton, gpu.py), ``"tpu"`` (Pallas/Mosaic TPU, tpu.py) and
``"reference"`` (plain jnp, reference.py). ``backend="auto"`` picks the kernel for the
default device; on CPU it runs the GPU kernel's body in Pallas interpret mode (for tests:
it is slow). Inputs are validated with clear errors before anything is traced.
"""

from __future__ import annotations

import jax
import numpy as np

from kernels_pallas.tree_attention import layout
from kernels_pallas.tree_attention.gpu import tree_attention_gpu
from kernels_pallas.tree_attention.masks import chain_mask, check_tree_mask, mask_from_parents
from kernels_pallas.tree_attention.reference import tree_attention_reference
from kernels_pallas.tree_attention.tpu import tree_attention_tpu
from kernels_pallas.tree_attention.tuning import (autotune_block_kv, pick_block_kv, pick_block_q, pick_num_splits,
                                                  target_programs)

__all__ = ["tree_attention", "tree_attention_reference", "check_tree_mask", "mask_from_parents", "chain_mask",
           "MAX_TREE_TOKENS", "gpu_config", "pick_block_kv", "pick_block_q", "pick_num_splits", "autotune_block_kv"]

# The largest tree (or chain) a compiled kernel variant takes. The packed query rows are
# N * G; 64 nodes x 8 query heads per KV head = 512 rows (the GPU kernel tiles them; the TPU
# kernel holds them in one VMEM tile). Larger blocks (prefill) use the XLA path.
MAX_TREE_TOKENS = 64


def _resolve_backend(backend: str, interpret: bool | None) -> tuple[str, bool]:
    platform = jax.default_backend()
    if backend == "auto":
        backend = platform if platform in ("gpu", "tpu") else "gpu"
    if backend not in ("gpu", "tpu", "reference"):
        raise ValueError(f"unknown tree-attention backend {backend!r} (expected auto, gpu, tpu or reference)")
    if interpret is None:
        interpret = backend != platform
    return backend, interpret


def _validate(q, k_blk, v_blk, k_cache, v_cache, lengths, block_mask, layer, max_tree_tokens):
    if q.ndim != 4:
        raise ValueError(f"q must be [B, N, H, head_dim], got shape {q.shape}")
    B, N, H, hd = q.shape
    if k_blk.shape != v_blk.shape or k_blk.ndim != 4:
        raise ValueError(f"k_blk and v_blk must both be [B, N, Hkv, head_dim], got {k_blk.shape} and {v_blk.shape}")
    Hkv = k_blk.shape[2]
    if k_blk.shape[:2] != (B, N) or k_blk.shape[3] != hd:
        raise ValueError(f"k_blk {k_blk.shape} does not match q {q.shape} (batch, tokens, head_dim)")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"query heads ({H}) must be a multiple of KV heads ({Hkv}) for grouped-query attention")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ")
    stacked = k_cache.ndim == 5
    if k_cache.ndim not in (4, 5):
        raise ValueError(f"the cache must be [B, Hkv, S, hd] or stacked [L, B, Hkv, S, hd], got {k_cache.shape}")
    cb, ch, _, cd = k_cache.shape[-4:]
    if (cb, ch, cd) != (B, Hkv, hd):
        raise ValueError(f"cache {k_cache.shape} does not match the block: batch {B}, KV heads {Hkv}, head_dim {hd}")
    if stacked and (layer is None or not 0 <= layer < k_cache.shape[0]):
        raise ValueError(f"a stacked cache with {k_cache.shape[0]} layers needs layer in [0, {k_cache.shape[0]}), got {layer}")
    if lengths.shape != (B,):
        raise ValueError(f"lengths must be [B] = [{B}], got {lengths.shape}")
    if block_mask.shape != (B, N, N):
        raise ValueError(f"block_mask must be [B, N, N] = [{B}, {N}, {N}], got {block_mask.shape}")
    if N < 1 or N > max_tree_tokens:
        raise ValueError(f"{N} new tokens per row is outside the kernel's compiled range 1..{max_tree_tokens} "
                         f"(raise max_tree_tokens, or use the XLA path for long blocks)")
    try:  # a concrete mask (not a tracer inside jit) is checked to really be a tree
        mask_np = np.asarray(block_mask)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        mask_np = None
    if mask_np is not None:
        check_tree_mask(mask_np)


def gpu_config(q_shape, kv_heads: int, num_slots: int, dtype, *, block_kv: int | None = None,
               block_q: int | None = None, num_splits: int | None = None, interpret: bool = False):
    """(block_kv, block_q, num_splits) the GPU kernel runs with for q of `q_shape` [B, N, H, hd]
    over a cache of `num_slots` slots in `dtype`: the given values, checked, else tuning's defaults
    (in interpret mode one split: there is no device to fill)."""
    B, N, H, hd = q_shape
    bk = block_kv or pick_block_kv(num_slots, "gpu")
    R, _ = layout.padded_sizes(N, H // kv_heads)
    bq = min(block_q or pick_block_q(R, hd, bk, dtype), R)
    if bq < layout.MIN_TILE or bq & (bq - 1):
        raise ValueError(f"block_q must be a power of two >= {layout.MIN_TILE}, got {block_q}")
    if num_splits is None:
        num_splits = 1 if interpret else pick_num_splits(B, kv_heads, R // bq, num_slots, bk, bq,
                                                         np.dtype(dtype).itemsize, target_programs())
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    return bk, bq, num_splits


def tree_attention(q, k_blk, v_blk, k_cache, v_cache, lengths, block_mask, *, layer: int | None = None,
                   backend: str = "auto", interpret: bool | None = None, block_kv: int | None = None,
                   block_q: int | None = None, num_splits: int | None = None,
                   max_tree_tokens: int = MAX_TREE_TOKENS):
    """q: [B, N, H, hd]; k_blk, v_blk: [B, N, Hkv, hd] (the new tokens' keys/values);
    k_cache, v_cache: [B, Hkv, S, hd], or the model's stacked [L, B, Hkv, S, hd] with
    `layer`; lengths: [B] committed prefix per row (slots at or past it are never read);
    block_mask: [B, N, N] ancestor mask. Returns [B, N, H, hd] in q's dtype.

    GPU kernel only: `block_q` query rows per program (a power of two >= 16; larger than the
    packed rows means one tile) and `num_splits` KV splits per row (flash-decoding); None picks
    tuning's defaults (see gpu_config)."""
    _validate(q, k_blk, v_blk, k_cache, v_cache, lengths, block_mask, layer, max_tree_tokens)
    backend, interpret = _resolve_backend(backend, interpret)
    if backend == "tpu" and (block_q is not None or num_splits is not None):
        raise ValueError("block_q and num_splits are the GPU kernel's (the TPU kernel tiles the prefix by its grid)")
    if k_cache.ndim == 4:
        k_cache, v_cache, layer = k_cache[None], v_cache[None], 0
    if backend == "reference":
        return tree_attention_reference(q, k_blk, v_blk, k_cache[layer], v_cache[layer], lengths, block_mask)
    bk = block_kv or pick_block_kv(k_cache.shape[3], backend)
    if k_cache.shape[3] % bk:
        raise ValueError(f"block_kv {bk} must divide the cache's {k_cache.shape[3]} slots")
    N, H = q.shape[1], q.shape[2]
    q_rows, kb, vb, bias = layout.pack(q, k_blk, v_blk, block_mask)
    kb, vb = kb.astype(k_cache.dtype), vb.astype(v_cache.dtype)
    q_rows = q_rows.astype(k_cache.dtype)
    if backend == "gpu":
        _, bq, splits = gpu_config(q.shape, k_blk.shape[2], k_cache.shape[3], k_cache.dtype, block_kv=bk,
                                   block_q=block_q, num_splits=num_splits, interpret=interpret)
        o_rows = tree_attention_gpu(lengths, q_rows, kb, vb, bias, k_cache, v_cache, layer, block_kv=bk,
                                    block_q=bq, num_splits=splits, interpret=interpret)
    else:
        o_rows = tree_attention_tpu(lengths, q_rows, kb, vb, bias, k_cache, v_cache, layer, block_kv=bk,
                                    interpret=interpret)
    return layout.unpack(o_rows, N, H).astype(q.dtype)
