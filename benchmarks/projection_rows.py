"""All of SmolLM2-135M's projections (30 layers) and its head for a few activation rows: one
GEMM per weight vs the per-row matrix-vector loop (``llama._rowwise_matvec``), jitted as one
dependent chain of the real shapes, random weights. Median of 15 rotated rounds per point
(specjax.benchtime).

  python benchmarks/projection_rows.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from specjax.benchtime import interleaved_medians  # noqa: E402
from specjax.models import llama  # noqa: E402

D, F, KV, LAYERS, VOCAB = 576, 1536, 192, 30, 49152
SHAPES = [(D, D), (D, KV), (D, KV), (D, D), (D, F), (D, F), (F, D)]


def chain(x, ws, head, loop):
    mm = (lambda a, w: llama._rowwise_matvec(a, w)) if loop else (lambda a, w: a @ w)
    for _ in range(LAYERS):
        for w in ws:
            xi = x if w.shape[0] == D else jnp.concatenate([x, x, x], -1)[:, :F]
            x = x + mm(xi, w)[:, :D].sum() * 1e-9  # keep the calls dependent
    return mm(x, head)


def main():
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.standard_normal(s, np.float32) * 0.02) for s in SHAPES]
    head = jnp.asarray(rng.standard_normal((D, VOCAB), np.float32) * 0.02)
    print("| rows | GEMM (ms) | row loop (ms) | loop / GEMM |\n|---|---|---|---|")
    for rows in (2, 3, 4, 6, 8):
        x = jnp.ones((rows, D), jnp.float32)
        fns = {loop: jax.jit(lambda x, loop=loop: chain(x, ws, head, loop)) for loop in (False, True)}
        ms = interleaved_medians({loop: lambda f=f: f(x).block_until_ready() for loop, f in fns.items()}, 15)
        t = [1e3 * ms[False], 1e3 * ms[True]]
        print(f"| {rows} | {t[0]:.1f} | {t[1]:.1f} | {t[1] / t[0]:.2f} |")


if __name__ == "__main__":
    main()
