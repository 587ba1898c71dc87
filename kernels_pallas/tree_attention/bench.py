"""Kernel benchmark sweep behind notebooks/kernel_bench.ipynb: Pallas tree attention vs the
jitted XLA reference over context length x tree size x batch, with achieved bandwidth
against the bytes that must move and against a measured device copy bandwidth.

Bytes that must move per call: the K and V prefix of every (row, KV head) once, plus the
queries, the new block's K/V, the mask bias and the output. At verification sizes the
prefix dominates, so attention is bandwidth-bound and "fraction of copy bandwidth" is the
honest efficiency figure. `variants` times further kernel configurations beside the default
one (e.g. the grid before split-KV and query tiles: ``dict(num_splits=1, block_q=512)``).
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.tree_attention import gpu_config, mask_from_parents, tree_attention, tree_attention_reference

SIZES = {
    # tiny: runs on CPU in interpret mode in the test suite; full: for a GPU/TPU.
    "tiny": dict(contexts=(128, 256), tree_sizes=(1, 8), batches=(1, 2), heads=(4, 2), head_dim=32, reps=2),
    "full": dict(contexts=(1024, 8192, 16384, 32768), tree_sizes=(1, 8, 32, 64), batches=(1, 8),
                 heads=(32, 8), head_dim=128, reps=20),
}


def timeit(fn, *args, reps: int) -> float:
    """Median wall seconds of fn(*args) after one warm-up call (which compiles)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def copy_bandwidth(nbytes: int, reps: int = 5) -> float:
    """Device copy bandwidth in GB/s (read + write of an nbytes buffer)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 2.0)
    return 2 * x.nbytes / timeit(f, x, reps=reps) / 1e9


def bytes_moved(B, N, H, Hkv, hd, ctx, itemsize) -> int:
    prefix = 2 * B * Hkv * ctx * hd * itemsize
    block = 2 * B * N * Hkv * hd * itemsize + B * N * N * Hkv * (H // Hkv) * 4
    return prefix + block + 2 * B * N * H * hd * itemsize


def sweep(contexts, tree_sizes, batches, heads, head_dim, reps, dtype="bfloat16", backend="auto",
          interpret=None, seed=0, progress=None, variants=None):
    """One row per (context, N, batch): kernel and XLA-reference times, speedup, achieved GB/s
    and the kernel's max abs error against the reference; on the GPU kernel also the block_q and
    num_splits its defaults chose. `variants` ({name: tree_attention keyword arguments}) adds
    <name>_ms, <name>_err and <name>_speedup (the variant's time / the default kernel's)."""
    H, Hkv = heads
    dt = jnp.dtype(dtype)
    rng = np.random.default_rng(seed)
    kernel = jax.jit(lambda *a: tree_attention(*a, backend=backend, interpret=interpret))
    others = {name: jax.jit(lambda *a, kw=kw: tree_attention(*a, backend=backend, interpret=interpret, **kw))
              for name, kw in (variants or {}).items()}
    reference = jax.jit(tree_attention_reference)
    platform = jax.default_backend()
    on_gpu_kernel = backend == "gpu" or (backend == "auto" and platform != "tpu")
    rows = []
    grid = [(c, n, b) for c in contexts for n in tree_sizes for b in batches]
    for ctx, N, B in (progress(grid) if progress else grid):
        def r(*shape):
            return jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dt)

        parents = [-1] + [int(rng.integers(0, i)) for i in range(1, N)]
        mask = jnp.asarray(np.broadcast_to(mask_from_parents(parents), (B, N, N)))
        args = (r(B, N, H, head_dim), r(B, N, Hkv, head_dim), r(B, N, Hkv, head_dim), r(B, Hkv, ctx, head_dim),
                r(B, Hkv, ctx, head_dim), jnp.full((B,), ctx, jnp.int32), mask)
        want = reference(*args).astype(jnp.float32)
        err = float(jnp.max(jnp.abs(kernel(*args).astype(jnp.float32) - want)))
        t_k = timeit(kernel, *args, reps=reps)
        t_x = timeit(reference, *args, reps=reps)
        nb = bytes_moved(B, N, H, Hkv, head_dim, ctx, dt.itemsize)
        row = dict(context=ctx, tree_size=N, batch=B, kernel_ms=1e3 * t_k, xla_ms=1e3 * t_x,
                   speedup=t_x / t_k, kernel_gbps=nb / t_k / 1e9, xla_gbps=nb / t_x / 1e9, max_abs_err=err)
        if on_gpu_kernel:
            _, row["block_q"], row["num_splits"] = gpu_config(
                (B, N, H, head_dim), Hkv, ctx, dt, interpret=platform != "gpu" if interpret is None else interpret)
        for name, fn in others.items():
            row[f"{name}_err"] = float(jnp.max(jnp.abs(fn(*args).astype(jnp.float32) - want)))
            row[f"{name}_ms"] = 1e3 * timeit(fn, *args, reps=reps)
            row[f"{name}_speedup"] = row[f"{name}_ms"] / row["kernel_ms"]
        rows.append(row)
    return rows


def markdown_table(rows, copy_gbps: float) -> str:
    variants = [k[:-3] for k in rows[0] if k.endswith("_ms") and k not in ("kernel_ms", "xla_ms")] if rows else []
    tiles = bool(rows) and "num_splits" in rows[0]
    cols = ["context", "N", "batch"] + (["block_q / splits"] if tiles else []) + [
        "kernel ms", "XLA ms", "kernel/XLA speedup"] + [f"{v} ms ({v} / kernel, err)" for v in variants] + [
        "kernel GB/s", "% of copy BW", "max abs err"]
    out = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
    for r in rows:
        cells = [r["context"], r["tree_size"], r["batch"]] + ([f"{r['block_q']} / {r['num_splits']}"] if tiles else [])
        cells += [f"{r['kernel_ms']:.3f}", f"{r['xla_ms']:.3f}", f"{r['speedup']:.2f}x"]
        cells += [f"{r[v + '_ms']:.3f} ({r[v + '_speedup']:.2f}x, {r[v + '_err']:.0e})" for v in variants]
        cells += [f"{r['kernel_gbps']:.1f}", f"{100 * r['kernel_gbps'] / copy_gbps:.0f}%", f"{r['max_abs_err']:.1e}"]
        out += "| " + " | ".join(map(str, cells)) + " |\n"
    return out


def plot(rows, copy_gbps: float, path: str | None = None):
    """Two panels: kernel/XLA speedup and achieved bandwidth vs context, one line per N
    (largest batch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bmax = max(r["batch"] for r in rows)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for n in sorted({r["tree_size"] for r in rows}):
        sel = sorted((r for r in rows if r["tree_size"] == n and r["batch"] == bmax), key=lambda r: r["context"])
        ctx = [r["context"] for r in sel]
        a1.plot(ctx, [r["speedup"] for r in sel], marker="o", label=f"N={n}")
        a2.plot(ctx, [r["kernel_gbps"] for r in sel], marker="o", label=f"N={n}")
    a1.axhline(1.0, color="gray", ls="--", lw=1)
    a1.set(xscale="log", xlabel="context (tokens)", ylabel="XLA time / kernel time",
           title=f"tree attention: kernel vs XLA (batch {bmax})")
    a2.axhline(copy_gbps, color="gray", ls="--", lw=1, label="copy bandwidth")
    a2.set(xscale="log", xlabel="context (tokens)", ylabel="GB/s", title="achieved bandwidth")
    for a in (a1, a2):
        a.legend()
        a.grid(alpha=0.3)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig


def save(rows, copy_gbps: float, path: str, **meta) -> None:
    with open(path, "w") as f:
        json.dump(dict(meta, copy_gbps=copy_gbps, rows=rows), f, indent=1)
