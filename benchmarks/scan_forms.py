"""The decoder's layers as the unrolled per-layer list against one loop over the rows kernel's
stacked packs (``ForwardOptions.scan_layers`` = layers per loop iteration): compile time and
step time of one decode (or verify-shaped: ``--tokens``) forward on the real model, and whether the
logits have the same bits.

  python benchmarks/scan_forms.py --unrolls 1,2,5,10,30 --batch 1 --slots 512 --attention cpu
  # the launch default (loop of 5, CPU attention) against the earlier one (list, XLA's attention)
  python benchmarks/scan_forms.py --unrolls 5 --tokens 1,5,9 --list_attention xla

Per loop form, in one process: the list's forward and the loop's are compiled (seconds), then
timed in ``--rounds`` alternating rounds of ``--steps`` decode steps each (a 100-token cache
prefix, the cache donated and carried); the median ms per step of each side, and whether one
step's logits are bit-identical. Times are this process's; the list is re-measured beside every
loop form, so each row's ratio is from one run.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Model name or .gguf (weights in Q4_1/Q8_0 blocks: the rows kernel).")
flags.DEFINE_list("unrolls", ["1", "5", "10"], "Layers per loop iteration, one loop form each.")
flags.DEFINE_integer("batch", 1, "Rows.")
flags.DEFINE_integer("slots", 512, "KV slots per row.")
flags.DEFINE_enum("attention", "cpu", ["xla", "cpu"], "Decode attention (ForwardOptions.attention).")
flags.DEFINE_string("list_attention", "", "The list side's attention (default: --attention; another one compares "
                    "the two settings whole, and bits are then not compared).")
flags.DEFINE_list("tokens", ["1"], "Block tokens per row (a chain, as a verify step of K = tokens - 1), one table row each.")
flags.DEFINE_integer("rounds", 6, "Alternating timed rounds.")
flags.DEFINE_integer("steps", 30, "Decode steps per round.")


def main(argv):
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax.models import llama
    from specjax.models.loader import load_model
    from specjax.models.options import ForwardOptions

    m = load_model(FLAGS.model)
    cfg, B, S = m.cfg, FLAGS.batch, FLAGS.slots
    base = ForwardOptions(rows_kernel=32, attention=FLAGS.attention)
    listed = dataclasses.replace(base, attention=FLAGS.list_attention or FLAGS.attention)
    print(f"{cfg.name}: one forward, batch {B}, {S} slots, the loop with {base.attention} attention, the list with "
          f"{listed.attention}; median ms/step of {FLAGS.rounds} alternating rounds of {FLAGS.steps} steps")
    print("| layers per iteration | block tokens | loop compile s | list compile s | loop ms/step | list ms/step | "
          "loop / list | same bits |")
    print("|---|---|---|---|---|---|---|---|")

    def side(fwd, T):
        p = m.params_for(fwd)
        cache = llama.init_cache_for(cfg, B, S)
        cache = dataclasses.replace(cache, lengths=jnp.full((B,), 100, jnp.int32))
        tok = jnp.zeros((B, T), jnp.int32)
        pos = 100 + jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        step = jax.jit(lambda p, c: llama.forward(p, tok, pos, c, llama.causal_mask(B, T), cfg=cfg, fwd=fwd)[:2],
                       donate_argnums=1)
        t = time.perf_counter()
        exe = step.lower(p, cache).compile()
        compile_s = time.perf_counter() - t
        # (the cache's written slot stays at 100: every step rewrites it, the same work each time)
        logits, cache = exe(p, cache)
        return {"exe": exe, "p": p, "cache": cache, "compile_s": compile_s, "logits": np.asarray(logits), "ms": []}

    for n, T in ((int(n), int(T)) for n in FLAGS.unrolls for T in FLAGS.tokens):
        sides = {"list": side(listed, T), "loop": side(dataclasses.replace(base, scan_layers=n), T)}
        for _ in range(FLAGS.rounds):
            for s in sides.values():
                t = time.perf_counter()
                for _ in range(FLAGS.steps):
                    out, s["cache"] = s["exe"](s["p"], s["cache"])
                jax.block_until_ready(out)
                s["ms"].append((time.perf_counter() - t) / FLAGS.steps * 1e3)
        lo, li = sides["loop"], sides["list"]
        ml, mi = float(np.median(lo["ms"])), float(np.median(li["ms"]))
        same = "-" if listed.attention != base.attention else (
            "yes" if np.array_equal(lo["logits"], li["logits"]) else "**NO**")
        print(f"| {n} | {T} | {lo['compile_s']:.2f} | {li['compile_s']:.2f} | {ml:.2f} | {mi:.2f} | {ml / mi:.2f} | "
              f"{same} |", flush=True)


if __name__ == "__main__":
    app.run(main)
