#!/usr/bin/env python
"""The CPU rows kernel built two ways on this machine, against XLA's dot: the default build
(-march=native: the AVX-512 path where the CPU has it) and a build for AVX2 only
(-march=haswell: the AVX2 + FMA + F16C path; before it had one, the portable loops). SmolLM2's 30
layers of projections and its head on the GGUF's own Q4_1/Q8_0 blocks, as a dependent chain;
XLA's dot on the float32 weights. Tells whether the kernel pays on a CPU without AVX-512
(LoadedModel.auto_rows_kernel turns it on where rows_dot.vectorized()). The int8 column is the
default build with int8 activations (ForwardOptions.rows_activations "int8", `--rows_activations int8`:
the codes in pairs, integer multiply-adds); the bfloat16 column reads the same packs with each
activation rounded to bfloat16 (``rows_dot(..., activations="bfloat16")``, vdpbf16ps where the CPU
has AVX512_BF16). ``--against REV``: also the default build of the
kernel's source at git revision REV (say HEAD, before a kernel change is committed), timed in turn
with the others, and the working tree's time over it.

  python benchmarks/rows_builds.py [--rows 1,5,9] [--against HEAD]
  python benchmarks/rows_builds.py --per_weight --rows 1,9,128,512
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("rows", ["1", "5", "9"], "Activation rows (1: decode, K + 1: a K-draft verify).")
flags.DEFINE_integer("reps", 11, "Timed calls per point (median).")
flags.DEFINE_string("against", None, "A git revision whose rows_dot.cc is built and timed beside the working tree's.")
flags.DEFINE_bool("per_weight", False, "Time each of layer 0's projections and the head alone (x [rows, K] @ w), "
                  "with its multiply-adds per second, instead of the whole chain.")


def build_at(rev: str) -> str:
    """The default build of the kernel's source at git revision ``rev`` (its FFI header beside it)."""
    import subprocess
    import tempfile

    from specjax.models.cpu import rows_dot as rd

    here, tmp = os.path.dirname(rd._SRC), tempfile.mkdtemp(prefix="rows_dot_")
    for name in ("rows_dot.cc", "rows_dot_ffi.h"):
        rel = os.path.relpath(os.path.join(here, name), ROOT)
        with open(os.path.join(tmp, name), "wb") as f:
            f.write(subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{rel}"], check=True, capture_output=True).stdout)
    return rd._build(rd._compiler(), src_path=os.path.join(tmp, "rows_dot.cc"))


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp

    from specjax.benchtime import interleaved_medians
    from specjax.models import llama
    from specjax.models.cpu import rows_dot as rd
    from specjax.models.loader import load_model
    from specjax.models.options import ForwardOptions

    rd.ensure()
    rd.register(rd._build(rd._compiler(), march="haswell"), "_avx2")
    if FLAGS.against:
        rd.register(build_at(FLAGS.against), "_against")
    m = load_model("smollm2-135m")
    p = m.params_for(ForwardOptions(rows_kernel=32))
    p8 = m.params_for(ForwardOptions(rows_kernel=32, rows_activations="int8", attention="cpu"))
    # each weight the kernel reads, per layer: a projection, or a group read as one (llama.FUSED)
    dense = [{n: jnp.concatenate([lp[x] for x in llama.FUSED.get(n, (n,))], axis=1) for n in p[llama.LAYER_PACKS]}
             for lp in m.params["layers"]]
    width = {n: w.shape for n, w in dense[0].items()}

    def kernel(x, w, n, suffix):
        ops = (w["codes"], w["scales"])
        target = f"specjax_rows_{rd.packed_format(w)}{suffix}"
        return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))(x, *ops)

    def chain(x, layers, head, dot):
        for lp in layers:
            for n in width:
                K, N = width[n]
                xin = jnp.tile(x, (1, K // x.shape[1] + 1))[:, :K]
                x = x + 0.01 * dot(xin, lp, n, N).sum(-1, keepdims=True)
        return dot(x, {"head": head}, "head", m.cfg.vocab_size)

    def call(f, *args):
        f = jax.jit(f)
        return lambda: jax.block_until_ready(f(*args))

    def kernel_dot(suffix):
        def dot(a, lp, n, N):
            return kernel(a, lp[n], N, suffix)
        return dot

    if FLAGS.per_weight:
        print("| weight (K x N) | rows | XLA's dot (float32) | kernel, default build | kernel, AVX2-only build | "
              "kernel, int8 activations | kernel, bfloat16 activations |\n|---|---|---|---|---|---|---|")
        weights = {n: (p[llama.LAYER_PACKS][n], p8[llama.LAYER_PACKS][n], dense[0][n]) for n in width}
        weights["head"] = (p["head" + llama.ROWS_SUFFIX], p8["head" + llama.ROWS_SUFFIX], m.params["embed"].T)
        for n, (wp, wp8, w) in weights.items():
            K, N = w.shape
            for M in (int(r) for r in FLAGS.rows):
                x = jnp.ones((M, K), jnp.float32) * 0.1
                pk, pk8 = (rd.layer_of(wp, 0), rd.layer_of(wp8, 0)) if n != "head" else (wp, wp8)
                variants = {"xla": call(lambda x, w: x @ w, x, w)}
                for suffix, pack in (("", pk), ("_avx2", pk), ("_i8", pk8), ("_bf16", pk8)):
                    variants[suffix] = call(lambda x, w, s=suffix: kernel(x, w, N, s), x, pack)
                t = interleaved_medians(variants, FLAGS.reps)
                cells = [f"{1e6 * t[k]:.0f} us ({M * K * N / t[k] / 1e9:.0f} GMAC/s)" for k in ("xla", "", "_avx2", "_i8", "_bf16")]
                print(f"| {n} ({K} x {N}) | {M} | " + " | ".join(cells) + " |", flush=True)
        return
    against = f" | kernel, {FLAGS.against}'s source" if FLAGS.against else ""
    print(f"| rows | XLA's dot (float32) | kernel, default build | kernel, AVX2-only build | kernel, int8 activations"
          f" | kernel, bfloat16 activations{against} |\n|---|---|---|---|---|---|{'---|' if against else ''}")
    for M in (int(r) for r in FLAGS.rows):
        x = jnp.ones((M, m.cfg.hidden_size), jnp.float32) * 0.1
        variants = {"xla": call(lambda x, ls, h: chain(x, ls, h, lambda a, lp, n, N: a @ lp[n]), x,
                                dense, m.params["embed"].T)}
        for suffix, packs in (("", p), ("_avx2", p), ("_i8", p8), ("_bf16", p8)) + ((("_against", p),) if against else ()):
            variants[suffix] = call(lambda x, ls, h, dot=kernel_dot(suffix): chain(x, ls, h, dot), x,
                                    [llama.layer_packs(packs, i) for i in range(len(packs["layers"]))],
                                    packs["head" + llama.ROWS_SUFFIX])
        t = {k: 1e3 * v for k, v in interleaved_medians(variants, FLAGS.reps).items()}
        print(f"| {M} | {t['xla']:.1f} ms | {t['']:.1f} ms | {t['_avx2']:.1f} ms | {t['_i8']:.1f} ms "
              f"({t[''] / t['_i8']:.2f}x the default build) | {t['_bf16']:.1f} ms ({t[''] / t['_bf16']:.2f}x) |" +
              (f" {t['_against']:.1f} ms (the default build {t[''] / t['_against']:.2f}x it) |" if against else ""),
              flush=True)


if __name__ == "__main__":
    app.run(main)
