"""Tile sizes and grid splits for the tree-attention kernels: the defaults per backend, the GPU
kernel's shared-memory estimate, and a small autotuner that times candidates on the current
device for one shape.

Defaults: on GPU a 16-64 slot K/V tile; on TPU tiles of 128-512 slots amortise the
per-grid-step overhead and fill the MXU's 128 lanes. A tile must divide the cache's slot
count, so tiles never straddle the end of the cache and loads need no bounds masks.

The GPU kernel's grid is (row, KV head, query tile, KV split). Query tiles (`block_q` of the
R = N x G packed query rows) bound one program's shared memory; KV splits (flash-decoding)
give small batches enough programs to fill the device.
"""

from __future__ import annotations

import math
import time

import jax
import numpy as np

BLOCK_KV_CHOICES = {"gpu": (64, 32, 16), "tpu": (512, 256, 128)}

# GPU kernel launch defaults (gpu.py) and the shared memory one program may use: 232448 bytes
# is the H100's per-block limit, as its Triton compiler reported it.
GPU_NUM_WARPS = 4
GPU_NUM_STAGES = 2
GPU_SMEM_BYTES = 232448
# Largest query tile by element size: the tile's q rows and its float32 accumulator stay in
# the registers of GPU_NUM_WARPS warps; float32 q rows take twice the bytes of bf16 ones.
BLOCK_Q_MAX = {4: 64, 2: 128}
MIN_BLOCK_Q = 16  # the smallest M of a tensor-core dot (and layout.MIN_TILE)
# KV splits: each split reads at least MIN_TILES_PER_SPLIT K/V tiles and at least
# KV_BYTES_PER_PARTIAL times the bytes of the float32 partial output it writes (the merge reads
# them back), at most MAX_SPLITS; the target is about one program per SM.
MIN_TILES_PER_SPLIT = 4
KV_BYTES_PER_PARTIAL = 8
MAX_SPLITS = 32
DEFAULT_TARGET_PROGRAMS = 132  # an H100's SM count, where the device does not say its own


def pick_block_kv(num_slots: int, backend: str) -> int:
    """The largest default tile for `backend` that divides `num_slots`."""
    for bk in BLOCK_KV_CHOICES[backend]:
        if num_slots % bk == 0:
            return bk
    raise ValueError(f"cache slots ({num_slots}) must be a multiple of {BLOCK_KV_CHOICES[backend][-1]} "
                     f"for the {backend} tree-attention kernel")


def gpu_smem_bytes(block_q: int, block_kv: int, head_dim: int, itemsize: int,
                   num_stages: int = GPU_NUM_STAGES) -> int:
    """Shared memory the Triton compiler allots one program of the GPU kernel: the query tile (a
    dot operand, loaded once) plus num_stages + 1 K/V tiles (the pipelined K loads and the V
    operand). Fitted to the H100 run: fp32, 512 rows, 64-slot tiles, head_dim 128 asked for
    exactly 360448 bytes; fp32 at 256 rows (229376) and bf16 at 512 (180224) compiled."""
    return itemsize * head_dim * (block_q + (num_stages + 1) * block_kv)


def pick_block_q(rows: int, head_dim: int, block_kv: int, dtype, *, num_stages: int = GPU_NUM_STAGES,
                 smem_bytes: int = GPU_SMEM_BYTES) -> int:
    """The GPU kernel's default query tile for R = `rows` packed query rows (a power of two):
    the dtype's cap, halved while the shared-memory estimate exceeds the budget (never below
    MIN_BLOCK_Q; past that the K/V tile is what must shrink)."""
    itemsize = np.dtype(dtype).itemsize
    bq = min(rows, BLOCK_Q_MAX.get(itemsize, 128))
    while bq > MIN_BLOCK_Q and gpu_smem_bytes(bq, block_kv, head_dim, itemsize, num_stages) > smem_bytes:
        bq //= 2
    return bq


def target_programs() -> int:
    """About how many programs fill the default device: its SM (core) count where it reports one."""
    return int(getattr(jax.devices()[0], "core_count", 0) or DEFAULT_TARGET_PROGRAMS)


def pick_num_splits(batch: int, kv_heads: int, q_tiles: int, num_slots: int, block_kv: int, block_q: int,
                    itemsize: int, target: int) -> int:
    """KV splits per (row, KV head, query tile): enough programs to reach `target`, but no more
    than the cache's slots allow at the minimum split (MIN_TILES_PER_SPLIT tiles, and K/V bytes
    KV_BYTES_PER_PARTIAL times the split's partial output). The splits divide each row's own
    length at run time; the slot count only bounds how many are worth launching."""
    programs = batch * kv_heads * q_tiles
    want = math.ceil(target / programs)
    # K + V of a split: 2 * slots * hd * itemsize; its partial output: block_q * hd * 4
    min_slots = max(MIN_TILES_PER_SPLIT * block_kv, KV_BYTES_PER_PARTIAL * block_q * 4 // (2 * itemsize))
    cap = max(1, num_slots // min_slots)
    return max(1, min(want, cap, MAX_SPLITS))


def autotune_block_kv(run, num_slots: int, backend: str, reps: int = 10, candidates=None) -> tuple[int, dict]:
    """Time ``run(block_kv)`` (a callable returning device arrays) for each candidate tile that
    divides `num_slots`; return the fastest and all median timings in seconds."""
    cands = [c for c in (candidates or BLOCK_KV_CHOICES[backend]) if num_slots % c == 0]
    if not cands:
        raise ValueError(f"no candidate tile divides the cache's {num_slots} slots")
    timings = {}
    for bk in cands:
        jax.block_until_ready(run(bk))  # compile
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            jax.block_until_ready(run(bk))
            ts.append(time.perf_counter() - t)
        timings[bk] = sorted(ts)[len(ts) // 2]
    return min(timings, key=timings.get), timings
