#!/usr/bin/env python
"""Prefill and decode speed by prompt length: specjax against transformers + torch CPU, in one run.

Random-token prompts (ids 100..vocab-1), SmolLM2-135M fp32, batch 1, greedy. specjax runs through
``Generator`` (the engine's K = 0 path), so a prefill is what a user waits for: every chunk call,
the insert into the live batch and the first token's trip to the host. Per length:

- prefill tok/s, best of --reps, with chunked prefill (--prefill_chunk) and, up to
  --whole_max tokens, with the whole prompt as one padded chunk (the path before chunking: its
  [T, T] scores at 8k tokens would be 2.4 GB per layer);
- decode tok/s at --decode_contexts: (new tokens - 1) / decode seconds over --decode_tokens tokens,
  for each --rows_kernels setting (0: XLA's dot; N: the CPU rows kernel on the GGUF's own
  Q4_1/Q8_0 blocks up to N rows, ForwardOptions.rows_kernel).

transformers runs first, as the ``hf`` peer (specjax.peers) in --hf_python (a venv built from
benchmarks/requirements-hf-peer.txt), one after the other, never concurrently; its prefill computes
logits for the last position only and its decode is timed from its own KV-cache steps
(benchmarks/hf_baseline.py):

  python benchmarks/prefill_speed.py --hf_python /work/hf-venv/bin/python
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("lengths", ["128", "512", "1024", "2048", "4096", "8000"], "Prompt lengths to prefill.")
flags.DEFINE_list("decode_contexts", ["64", "1024"], "Contexts to time decode at.")
flags.DEFINE_integer("decode_tokens", 32, "Decode steps timed per context.")
flags.DEFINE_integer("reps", 3, "Timed repeats (best taken) per length.")
flags.DEFINE_integer("prefill_chunk", 512, "Largest prefill chunk of the chunked path.")
flags.DEFINE_integer("whole_max", 2048, "Also time the one-chunk (whole prompt) path up to this length; 0: never.")
flags.DEFINE_list("rows_kernels", ["0", "32"], "ForwardOptions.rows_kernel settings to time decode with.")
flags.DEFINE_string("hf_python", None, "Python of a venv with torch CPU + transformers; omit to skip HF.")
flags.DEFINE_string("json_out", None, "Write all results as JSON here.")


def run_hf(python, lengths, contexts, decode_tokens, reps):
    from specjax.models.loader import default_gguf_path
    from specjax.peers import run_peer

    res = run_peer("hf", python, {"gguf": default_gguf_path(), "prefill_lens": lengths, "decode_contexts": contexts,
                                  "decode_tokens": decode_tokens, "reps": reps})
    res["decode"] = {int(k): v for k, v in res["decode"].items()}
    res["prefill"] = {int(k): v for k, v in res["prefill"].items()}
    return res


def run_specjax(lengths, contexts, decode_tokens, reps, chunk, whole_max, rows_kernels):
    import jax
    import numpy as np
    from tqdm import tqdm

    from specjax.benchtime import generate_sample, rounds, summarize
    from specjax.generate import Generator
    from specjax.models.loader import load_model
    from specjax.models.options import ForwardOptions

    m = load_model("smollm2-135m", "float32")
    rng = np.random.default_rng(0)
    prompt = {n: [int(x) for x in rng.integers(100, m.cfg.vocab_size, n)] for n in set(lengths) | set(contexts)}
    gens = {"chunked": Generator(m.cfg, m.params, prefill_chunk=chunk)}
    if whole_max:
        gens["whole"] = Generator(m.cfg, m.params, prefill_chunk=8192)
    out = {name: {} for name in gens}
    out["decode"] = {}
    jobs = [(name, n) for n in lengths for name in gens if name == "chunked" or n <= whole_max]
    for name, n in tqdm(jobs, desc="specjax prefill", disable=None):
        # (the warm-up round compiles this length's chunks)
        runs = rounds({"": lambda: generate_sample(gens[name], prompt[n], 1)}, reps)[""]
        out[name][n] = summarize(runs, min)["prefill_s"]
    for rk in rows_kernels:
        fwd = ForwardOptions(rows_kernel=rk)
        g = gens["chunked"] if not rk else Generator(m.cfg, m.params_for(fwd), prefill_chunk=chunk, fwd=fwd)
        for c in contexts:
            runs = rounds({"": lambda: generate_sample(g, prompt[c], decode_tokens + 1, ignore_eos=True)}, reps)[""]
            out["decode"][f"{rk}:{c}"] = summarize(runs, min)["decode_step_s"]
    out["env"] = {"jax": jax.__version__, "prefill_chunk": chunk}
    return out


def main(argv):
    del argv
    lengths = [int(x) for x in FLAGS.lengths]
    contexts = [int(x) for x in FLAGS.decode_contexts]
    hf = run_hf(FLAGS.hf_python, lengths, contexts, FLAGS.decode_tokens, FLAGS.reps) if FLAGS.hf_python else None
    rks = [int(x) for x in FLAGS.rows_kernels]
    sj = run_specjax(lengths, contexts, FLAGS.decode_tokens, FLAGS.reps, FLAGS.prefill_chunk, FLAGS.whole_max, rks)
    print(f"\nSmolLM2-135M fp32, batch 1, random-token prompts; prefill tok/s, best of {FLAGS.reps}; "
          f"chunked = chunks of <= {FLAGS.prefill_chunk}, whole = one padded chunk (the path before chunking)")
    print("| prompt tokens | specjax chunked | specjax whole | transformers | chunked / transformers | chunked / whole |")
    print("|---|---|---|---|---|---|")
    for n in lengths:
        c = n / sj["chunked"][n]
        w = n / sj["whole"][n] if n in sj.get("whole", {}) else None
        h = n / hf["prefill"][n] if hf else None
        print(f"| {n} | {c:.0f} | {w:.0f} |" if w else f"| {n} | {c:.0f} | - |", end="")
        print(f" {h:.0f} | {c / h:.2f}x |" if h else " - | - |", end="")
        print(f" {c / w:.2f}x |" if w else " - |")
    print("\n| decode context | specjax rows_kernel | specjax tok/s | transformers tok/s | ratio |\n|---|---|---|---|---|")
    for c in contexts:
        for rk in rks:
            s = 1 / sj["decode"][f"{rk}:{c}"]
            h = 1 / hf["decode"][c] if hf else None
            print(f"| {c} | {rk} | {s:.1f} | {h:.1f} | {s / h:.2f}x |" if h else f"| {c} | {rk} | {s:.1f} | - | - |")
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump({"specjax": sj, "hf": hf}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
