#!/usr/bin/env python
"""Which XLA:CPU dot path runs SmolLM2's steps fastest on this machine: each candidate setting of
XLA_FLAGS in a fresh process (the flags are read once, when XLA starts), timing the engine's own
compiled executables (StepTable): the K = 0 step and K-draft verify steps at a short and a long
context, and a 512-token prefill chunk after 512 cached tokens. A candidate whose flags this jaxlib
does not know is reported as such instead of aborting the run.

  python benchmarks/dot_paths.py [--ks 0,1,2,4,8,16] [--contexts 128,1024]
  python benchmarks/dot_paths.py --candidates default --attn_chunks 256,1024   # prefix-attention chunk
  python benchmarks/dot_paths.py --candidates default --rows_kernels 0,32      # the CPU rows kernel
  python benchmarks/dot_paths.py --candidates default --rows_kernels 0,32 --rows_weights f32,native

Per candidate and shape it prints ms per call (median of --reps) and, for steps, the GB/s of
weight reads that implies (every step reads every weight once), and each K's cost over the same
candidate's K = 0 step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("ks", ["0", "1", "2", "4", "8", "16"], "Drafts per verify step.")
flags.DEFINE_list("contexts", ["128", "1024"], "Committed context lengths.")
flags.DEFINE_integer("reps", 15, "Timed calls per point (median).")
flags.DEFINE_list("candidates", None, "Names of CANDIDATES to run (default: all).")
flags.DEFINE_list("attn_chunks", ["256"], "ForwardOptions.attn_chunk values (prefix-attention chunk) to run each "
                  "candidate with; a candidate with a non-default chunk is named name@chunk.")
flags.DEFINE_list("rows_kernels", ["0"], "ForwardOptions.rows_kernel values (the CPU rows kernel up to this many "
                  "activation rows; 0 = XLA's dot) to run each candidate with.")
flags.DEFINE_list("rows_weights", ["native"], "Weight formats the rows kernel reads: native (the GGUF's Q4_1/Q8_0 "
                  "blocks, as the engine packs them), f32 (float32 copies).")
flags.DEFINE_string("json_out", None, "Write all results as JSON here.")
flags.DEFINE_string("child", None, "Internal: run one candidate's measurement with these settings (JSON).")

# name -> XLA_FLAGS. The library fusions hand whole dot(+elementwise) clusters to XNNPACK / YNNPACK /
# oneDNN instead of XLA's own (Eigen) dot emitter.
CANDIDATES = {
    "default": "",
    "xnn_dot": "--xla_cpu_experimental_xnn_fusion_type=LIBRARY_FUSION_TYPE_DOT",
    "ynn_dot": "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_DOT",
    "onednn_dot": "--xla_cpu_experimental_onednn_fusion_type=LIBRARY_FUSION_TYPE_DOT",
    "use_xnnpack": "--xla_cpu_use_xnnpack=true",
    "use_onednn": "--xla_cpu_use_onednn=true",
}


def child(settings: dict) -> dict:
    import jax
    import numpy as np

    from specjax.benchtime import interleaved_medians, median_seconds, steady_chunk, steady_step
    from specjax.engine.table import StepTable
    from specjax.models.loader import load_model
    from specjax.models.options import ForwardOptions

    from specjax.models import llama

    m = load_model("smollm2-135m")
    cfg, params = m.cfg, m.params
    S, reps = 2048, settings["reps"]
    fwd = ForwardOptions(attn_chunk=settings["attn_chunk"], rows_kernel=settings["rows_kernel"])
    if fwd.rows_kernel:
        params = m.params_for(fwd) if settings["rows_weights"] == "native" else llama.pack_for_rows(params, cfg)
        # the bytes a step reads: the packed copies (the projections' and the head's)
        read = [params[llama.LAYER_PACKS], params["head" + llama.ROWS_SUFFIX]]
    else:
        read = [params["layers"], params["embed"]]  # the (tied) head
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(read))
    table = StepTable(cfg, params, params, fwd=fwd)
    rng = np.random.default_rng(0)
    out = {"steps": {}, "chunk_ms": None}
    for ctx in settings["contexts"]:
        # every K of one context in rotated rounds: their ratios survive the machine's drift
        times = interleaved_medians({K: steady_step(table, 1, K, ctx, S, rng) for K in settings["ks"]}, reps)
        for K, t in times.items():
            out["steps"][f"{ctx}:{K}"] = t * 1e3
    run_chunk = steady_chunk(table, 1, 512, 512, S, rng)
    out["chunk_ms"] = median_seconds(run_chunk, max(3, reps // 3)) * 1e3
    out["weight_gb"] = weight_bytes / 1e9
    return out


def main(argv):
    del argv
    if FLAGS.child is not None:
        print("RESULT " + json.dumps(child(json.loads(FLAGS.child))))
        return
    settings = {"ks": [int(k) for k in FLAGS.ks], "contexts": [int(c) for c in FLAGS.contexts], "reps": FLAGS.reps}
    results = {}
    runs = [(c, int(a), int(rk), rw) for c in (FLAGS.candidates or CANDIDATES) for a in FLAGS.attn_chunks
            for rk in FLAGS.rows_kernels for rw in (FLAGS.rows_weights if int(rk) else ["-"])]
    for cand, chunk, rk, rw in runs:
        name = (cand if chunk == 256 else f"{cand}@{chunk}") + (f"+rows{rk}:{rw}" if rk else "")
        env = dict(os.environ, XLA_FLAGS=CANDIDATES[cand])
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                            json.dumps(dict(settings, attn_chunk=chunk, rows_kernel=rk, rows_weights=rw))],
                           capture_output=True, text=True, env=env)
        line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            err = (r.stderr.strip().splitlines() or ["no output"])[-1]
            results[name] = {"error": err[:200]}
            print(f"{name}: failed ({err[:160]})", file=sys.stderr)
            continue
        results[name] = json.loads(line[7:])
        print(f"[{name} done]", file=sys.stderr)
    ok = {n: r for n, r in results.items() if "error" not in r}
    for ctx in settings["contexts"]:
        print(f"\nstep ms at context {ctx} (x = over the same setting's K = 0 step; GB/s of weight reads)")
        print("| setting | " + " | ".join(f"K={k}" for k in settings["ks"]) + " |")
        print("|---|" + "---|" * len(settings["ks"]))
        for n, r in ok.items():
            base = r["steps"][f"{ctx}:0"]
            cells = []
            for k in settings["ks"]:
                t = r["steps"][f"{ctx}:{k}"]
                cells.append(f"{t:.1f} ({t / base:.2f}x, {r['weight_gb'] / (t / 1e3):.0f} GB/s)")
            print(f"| {n} | " + " | ".join(cells) + " |")
    print("\n| setting | 512-token prefill chunk after 512 cached (ms) | prefill tok/s |\n|---|---|---|")
    for n, r in ok.items():
        print(f"| {n} | {r['chunk_ms']:.0f} | {512 / (r['chunk_ms'] / 1e3):.0f} |")
    print("\n| setting | weights read per step (GB) |\n|---|---|")
    for n, r in ok.items():
        print(f"| {n} | {r['weight_gb']:.3f} |")
    for n, r in results.items():
        if "error" in r:
            print(f"| {n} | failed: {r['error'][:80]} | |")
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump({"settings": settings, "candidates": CANDIDATES, "results": results}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
