#!/usr/bin/env python
"""This CPU's memory roofline for decode and verify, measured with XLA in one process.

  python benchmarks/roofline.py [--rows 1,2,5,9,16,32]

1. Read bandwidth: a jitted sum over a 540 MB float32 array (SmolLM2-135M's weight bytes) and one
   large matrix-vector product (212 MB of weights).
2. SmolLM2-135M's projections alone (30 layers of q, k, v, o, gate, up, down with the model's
   shapes, then the tied 49152 x 576 head; random weights, a dependent chain like the model's),
   for M activation rows: ms and the GB/s of weight reads. M = 1 is a decode step's dense part,
   M = K + 1 a K-draft verify's.
3. The same chain on SmolLM2's real weights through the CPU rows kernel (models.cpu.rows_dot),
   packed as float32 and in the GGUF's own Q4_1/Q8_0 blocks (skipped with --norows_kernel or
   where the kernel cannot be built here, which it says).

A decode step must read every weight once, so the read bandwidth bounds AR decode from above:
tokens/s <= bandwidth / weight bytes.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("rows", ["1", "2", "5", "9", "16", "32"], "Activation rows for the projection chain.")
flags.DEFINE_integer("reps", 15, "Timed calls per point (median).")
flags.DEFINE_bool("rows_kernel", True, "Also time the chain through the CPU rows kernel (part 3).")


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax.benchtime import median_seconds

    def ms(f, *args):
        f = jax.jit(f)  # (the harness's warm-up round compiles it)
        return median_seconds(lambda: jax.block_until_ready(f(*args)), FLAGS.reps)

    big = jnp.ones((135_000_000,), jnp.float32)
    t = ms(lambda a: a.sum(), big)
    print(f"read bandwidth: sum over {big.nbytes / 1e6:.0f} MB in {t * 1e3:.1f} ms = {big.nbytes / 1e9 / t:.1f} GB/s")
    del big
    w = jnp.ones((576, 1536 * 60), jnp.float32)
    v = jnp.ones((1, 576), jnp.float32)
    t = ms(lambda v, w: v @ w, v, w)
    print(f"read bandwidth: one [1, 576] @ [576, 92160] product ({w.nbytes / 1e6:.0f} MB) in {t * 1e3:.1f} ms = "
          f"{w.nbytes / 1e9 / t:.1f} GB/s")
    del w

    rng = np.random.default_rng(0)
    d, f, kv, L, V = 576, 1536, 192, 30, 49152

    def r(*s):
        return jnp.asarray(rng.standard_normal(s) * 0.02, jnp.float32)

    layers = [dict(wq=r(d, d), wk=r(d, kv), wv=r(d, kv), wo=r(d, d), g=r(d, f), u=r(d, f), dn=r(f, d)) for _ in range(L)]
    emb = r(V, d)
    nbytes = sum(a.nbytes for p in layers for a in p.values()) + emb.nbytes

    def chain(x, layers, emb):
        for p in layers:
            q, k, v = x @ p["wq"], x @ p["wk"], x @ p["wv"]
            x = x + (q + jnp.tile(k, (1, 3)) * 0.1 + jnp.tile(v, (1, 3)) * 0.1) @ p["wo"]
            x = x + (jax.nn.silu(x @ p["g"]) * (x @ p["u"])) @ p["dn"]
            x = x / jnp.sqrt((x * x).mean(-1, keepdims=True) + 1e-5)
        return x @ emb.T

    print(f"\nSmolLM2-135M's projections and head ({nbytes / 1e6:.0f} MB of float32 weights), XLA's dot, "
          f"median of {FLAGS.reps}")
    print("| rows | ms | GB/s of weights | x the 1-row chain |\n|---|---|---|---|")
    base = None
    for M in (int(m) for m in FLAGS.rows):
        t = ms(chain, r(M, d), layers, emb)
        base = base or t
        print(f"| {M} | {t * 1e3:.1f} | {nbytes / 1e9 / t:.1f} | {t / base:.2f} |")
    if FLAGS.rows_kernel:
        rows_chains(ms)


def rows_chains(ms):
    """Part 3: the projection chain on the real weights through the rows kernel, float32 packs
    against the GGUF's own blocks."""
    import jax
    import jax.numpy as jnp

    from specjax.errors import SpecjaxError
    from specjax.models import llama
    from specjax.models.cpu import rows_dot
    from specjax.models.loader import load_model
    from specjax.models.options import ForwardOptions

    try:
        rows_dot.ensure()
    except SpecjaxError as e:
        print(f"\n(rows kernel skipped: {e})")
        return
    m = load_model("smollm2-135m")
    d, V = m.cfg.hidden_size, m.cfg.vocab_size
    packs = {"float32": llama.pack_for_rows(m.params, m.cfg), "GGUF blocks": m.params_for(ForwardOptions(rows_kernel=32))}
    for label, p in packs.items():
        ws = [llama.layer_packs(p, i) for i in range(len(p["layers"]))]
        head = p["head" + llama.ROWS_SUFFIX]
        shapes = {n: llama.out_width(m.cfg, n) for n in ws[0]}  # (q/k/v and gate/up fused: llama.FUSED)
        wq, wk = llama.out_width(m.cfg, "wq"), llama.out_width(m.cfg, "wk")
        nbytes = sum(a.nbytes for a in jax.tree_util.tree_leaves((ws, head)))

        def chain(x, ws, head):
            def mm(a, name, w):
                return rows_dot.rows_dot(a, w, shapes[name])
            for w in ws:
                q, k, v = jnp.split(mm(x, "wqkv", w["wqkv"]), [wq, wq + wk], axis=-1)
                x = x + mm(q + jnp.tile(k, (1, 3)) * 0.1 + jnp.tile(v, (1, 3)) * 0.1, "wo", w["wo"])
                g, u = jnp.split(mm(x, "w_gate_up", w["w_gate_up"]), 2, axis=-1)
                x = x + mm(jax.nn.silu(g) * u, "w_down", w["w_down"])
                x = x / jnp.sqrt((x * x).mean(-1, keepdims=True) + 1e-5)
            return rows_dot.rows_dot(x, head, V)

        print(f"\nThe same chain on SmolLM2's weights through the rows kernel, {label} ({nbytes / 1e6:.0f} MB read)")
        print("| rows | ms | GB/s of weights | x the 1-row chain |\n|---|---|---|---|")
        base = None
        for M in (int(r) for r in FLAGS.rows):
            t = ms(chain, jnp.ones((M, d), jnp.float32) * 0.1, ws, head)
            base = base or t
            print(f"| {M} | {t * 1e3:.1f} | {nbytes / 1e9 / t:.1f} | {t / base:.2f} |")


if __name__ == "__main__":
    app.run(main)
