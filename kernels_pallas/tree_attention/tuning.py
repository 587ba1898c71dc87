"""Tile sizes for the tree-attention kernels: the defaults per backend, and a small autotuner
that times the candidates on the current device for one shape.

Defaults: on GPU a 16-64 slot K/V tile keeps the R x tile score block in registers for
R up to 512 query rows (64 nodes x 8 heads); on TPU tiles of 128-512 slots amortise the
per-grid-step overhead and fill the MXU's 128 lanes. A tile must divide the cache's slot
count, so tiles never straddle the end of the cache and loads need no bounds masks.
"""

from __future__ import annotations

import time

import jax

BLOCK_KV_CHOICES = {"gpu": (64, 32, 16), "tpu": (512, 256, 128)}


def pick_block_kv(num_slots: int, backend: str) -> int:
    """The largest default tile for `backend` that divides `num_slots`."""
    for bk in BLOCK_KV_CHOICES[backend]:
        if num_slots % bk == 0:
            return bk
    raise ValueError(f"cache slots ({num_slots}) must be a multiple of {BLOCK_KV_CHOICES[backend][-1]} "
                     f"for the {backend} tree-attention kernel")


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
