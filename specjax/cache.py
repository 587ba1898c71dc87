"""Functional KV cache with per-row lengths.

Layout: ``k, v: [layers, batch, kv_heads, slots, head_dim]`` (head-major, so each
(row, KV head) is one contiguous [slots, head_dim] matrix for the attention dots;
measured 2x faster QK^T on XLA:CPU than slot-major) and ``lengths: [batch]``.
Slots ``[0, lengths[b])`` of row ``b`` are committed; everything at or past
``lengths[b]`` is scratch that attention never reads. A forward pass writes a
block of T new entries at slots ``lengths[b] .. lengths[b]+T-1`` without moving
``lengths``; the caller then advances each row by what it accepted. Rollback is
therefore "do not advance": rejected entries stay as scratch and are
overwritten by the next write.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array  # [L, B, Hkv, S, hd]
    v: jax.Array  # [L, B, Hkv, S, hd]
    lengths: jax.Array  # [B] int32

    @property
    def num_slots(self) -> int:
        return self.k.shape[3]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FeatureCache(KVCache):
    """A feature head's cache (drafters.eagle): its KV entries plus ``feat`` [B, D], the feature
    that goes with each row's next entry (the fused target feature of the last committed
    position), so the head's next forward needs nothing from outside the state; and the
    positions plain (K = 0) steps committed that the head has not caught up on yet: ``lag``
    [B] of them, their tokens ``lag_tok`` [B, W] and raw target features ``lag_feat`` [B, W, F]
    (the head's ``lengths`` trail the target's by ``lag``)."""

    feat: jax.Array
    lag_tok: jax.Array
    lag_feat: jax.Array
    lag: jax.Array


# FeatureCache fields of what plain steps deferred: empty after a prefill (a prefix-store
# segment leaves them out)
DEFERRED_FIELDS = ("lag_tok", "lag_feat", "lag")


def batch_axis(field: str) -> int:
    """The row axis of a cache field (k / v: [L, B, ...]; lengths, feat: [B, ...])."""
    return 1 if field in ("k", "v") else 0


def init_cache(num_layers: int, batch: int, slots: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32) -> KVCache:
    # zeros, never jnp.empty: uninitialised memory can hold NaN, and NaN * 0 survives masking.
    shape = (num_layers, batch, num_kv_heads, slots, head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths=jnp.zeros((batch,), jnp.int32))


def write_block(cache: KVCache, k_new: jax.Array, v_new: jax.Array) -> KVCache:
    """Write ``[L, B, T, Hkv, hd]`` new entries at slots ``lengths + arange(T)`` per row.

    Writes past the last slot are dropped (padding rows of a bucket may point there).
    Lengths are not changed.
    """
    L, B, T = k_new.shape[:3]
    slots = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
    rows = jnp.arange(B, dtype=jnp.int32)[:, None]
    # Advanced indices on axes 1 and 3 (split by a slice) put the index dims first:
    # the update is laid out [B, T, L, Hkv, hd].
    k = cache.k.at[:, rows, :, slots].set(k_new.transpose(1, 2, 0, 3, 4).astype(cache.k.dtype), mode="drop")
    v = cache.v.at[:, rows, :, slots].set(v_new.transpose(1, 2, 0, 3, 4).astype(cache.v.dtype), mode="drop")
    return dataclasses.replace(cache, k=k, v=v)


def write_layer_block(k_all: jax.Array, v_all: jax.Array, layer: int, lengths: jax.Array, k_new: jax.Array,
                      v_new: jax.Array):
    """Write one layer's block ``k_new, v_new: [B, T, Hkv, hd]`` at slots ``lengths + arange(T)``
    of the stacked ``[L, B, Hkv, S, hd]`` arrays (out-of-range writes dropped)."""
    B, T = k_new.shape[:2]
    slots = lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    rows = jnp.arange(B, dtype=jnp.int32)[:, None]
    # Index dims [B, T] come first in the update layout: [B, T, Hkv, hd] as given.
    k_all = k_all.at[layer, rows, :, slots].set(k_new.astype(k_all.dtype), mode="drop")
    v_all = v_all.at[layer, rows, :, slots].set(v_new.astype(v_all.dtype), mode="drop")
    return k_all, v_all


def advance(cache: KVCache, n: jax.Array) -> KVCache:
    """Commit ``n[b]`` more entries of row ``b`` (n may be 0: a full rollback)."""
    return dataclasses.replace(cache, lengths=cache.lengths + n.astype(jnp.int32))


def set_lengths(cache: KVCache, lengths: jax.Array) -> KVCache:
    return dataclasses.replace(cache, lengths=lengths.astype(jnp.int32))


def gather_block(cache: KVCache, src_offsets: jax.Array, dst_offsets: jax.Array, valid: jax.Array) -> KVCache:
    """Copy scratch entries ``lengths+src`` to ``lengths+dst`` (per row, where ``valid``).

    Used to compact an accepted tree path into contiguous slots.
    ``src_offsets, dst_offsets, valid: [B, P]``.
    """
    L, B = cache.k.shape[:2]
    rows = jnp.arange(B, dtype=jnp.int32)[:, None]
    src = cache.lengths[:, None] + src_offsets
    S = cache.num_slots
    dst = jnp.where(valid, cache.lengths[:, None] + dst_offsets, S)  # S is out of range -> dropped
    src = jnp.clip(src, 0, S - 1)
    k_sel = cache.k[:, rows, :, src]  # [B, P, L, Hkv, hd]
    v_sel = cache.v[:, rows, :, src]
    k = cache.k.at[:, rows, :, dst].set(k_sel, mode="drop")
    v = cache.v.at[:, rows, :, dst].set(v_sel, mode="drop")
    return dataclasses.replace(cache, k=k, v=v)
