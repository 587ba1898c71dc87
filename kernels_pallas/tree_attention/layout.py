"""Packing between the model's layout and the kernels' row layout.

A kernel program handles one (row b, KV head h): the N new tokens times the G query heads
that share head h become R = N*G query rows (row r = token r // G, head r % G), padded to a
power of two >= 16 so the same shapes suit tensor-core dots (GPU) and sublane tiles (TPU), and
so that the GPU kernel's power-of-two query tiles divide them.
The tree mask becomes an additive float bias per query row. Padding rows see only node 0,
so they stay finite; they are cut off on the way out.
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas.tree_attention.reference import NEG_INF

MIN_TILE = 16


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def padded_sizes(n: int, groups: int) -> tuple[int, int]:
    """(R, Np): padded query rows and padded tree nodes."""
    return max(MIN_TILE, next_pow2(n * groups)), max(MIN_TILE, next_pow2(n))


def pack(q, k_blk, v_blk, block_mask):
    B, N, H, hd = q.shape
    Hkv = k_blk.shape[2]
    G = H // Hkv
    R, Np = padded_sizes(N, G)
    q_rows = q.reshape(B, N, Hkv, G, hd).transpose(0, 2, 1, 3, 4).reshape(B, Hkv, N * G, hd)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, R - N * G), (0, 0)))
    kb = jnp.pad(k_blk.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, Np - N), (0, 0)))
    vb = jnp.pad(v_blk.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, Np - N), (0, 0)))
    rows = jnp.repeat(block_mask.astype(bool), G, axis=1)  # [B, N*G, N]
    rows = jnp.pad(rows, ((0, 0), (0, 0), (0, Np - N)))
    pad_row = jnp.zeros((Np,), bool).at[0].set(True)
    rows = jnp.concatenate([rows, jnp.broadcast_to(pad_row, (B, R - N * G, Np))], axis=1)
    bias = jnp.where(rows, 0.0, NEG_INF).astype(jnp.float32)
    return q_rows, kb, vb, bias


def unpack(o_rows, n: int, num_heads: int):
    """[B, Hkv, R, hd] -> [B, N, H, hd]."""
    B, Hkv, _, hd = o_rows.shape
    G = num_heads // Hkv
    return o_rows[:, :, :n * G].reshape(B, Hkv, n, G, hd).transpose(0, 2, 1, 3, 4).reshape(B, n, num_heads, hd)
