#!/usr/bin/env python
"""Autoregressive speed of specjax vs Hugging Face transformers (torch CPU) on the same prompts.

Greedy, batch 1, fp32 on both sides, the model's chat template applied. specjax runs
in this process; transformers runs as the ``hf`` peer (specjax.peers: benchmarks/hf_baseline.py
in the Python of --hf_python, a venv built from benchmarks/requirements-hf-peer.txt), because
specjax does not depend on torch. Both runs happen in one invocation so the ratio is measured under the
same machine conditions; they are run one after the other, never concurrently.

  python benchmarks/ar_speed.py --hf_python /work/hf-venv/bin/python --max_new_tokens 128

Reports per prompt and in aggregate: prefill tok/s (specjax: median of 3 prompt forwards after
warm-up; transformers: its greedy run's own prefill, logits of the last position only), decode
tok/s ((new tokens - 1) / decode time, both sides), peak RSS, and whether the greedy tokens are
identical.
"""

from __future__ import annotations

import json
import os
import resource
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("hf_python", None, "Python of a venv with torch CPU + transformers; omit to skip the HF column.")
flags.DEFINE_integer("max_new_tokens", 128, "New tokens per prompt (both sides stop at EOS).")
flags.DEFINE_integer("repeats", 3, "Timed repeats per prompt on the specjax side (median reported).")
flags.DEFINE_string("json_out", None, "Write all results as JSON here.")

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Summarise in two sentences: The Industrial Revolution began in Great Britain in the late "
    "18th century and spread to Europe and North America. It replaced hand production with "
    "machines, new chemical and iron processes, steam power and the factory system, and it "
    "changed how people lived and worked, moving many of them from farms into cities.",
    "List three tips for writing clear technical documentation.",
]


def run_specjax(prompts, max_new_tokens, repeats):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax import buckets as bk
    from specjax.benchtime import generate_sample, median_seconds, rounds, summarize
    from specjax.generate import Generator
    from specjax.reference_ar import prefill  # the same prefill computation as the engine's
    from specjax.models.loader import load_model
    from specjax.sampling import SamplingArrays, SamplingParams

    m = load_model("smollm2-135m", "float32")
    gen = Generator(m.cfg, m.params, eos_ids=m.tokenizer.eos_ids)
    rows = []
    for text in prompts:
        ids = m.tokenizer.encode_chat(text)
        # (the warm-up round compiles this prompt's buckets)
        runs = rounds({"": lambda: generate_sample(gen, ids, max_new_tokens)}, repeats)[""]
        dec = summarize(runs)["decode_s"]
        # Prefill alone, same bucket as generate used.
        Tp = bk.prompt_bucket(len(ids), m.cfg.max_position)
        slots = bk.slot_bucket(len(ids) + max_new_tokens, m.cfg.max_position)
        toks = np.zeros((1, Tp), np.int32)
        toks[0, : len(ids)] = ids
        samp = SamplingArrays.build([SamplingParams()], 1)
        args = (m.params, jnp.asarray(toks), jnp.asarray([len(ids)], jnp.int32), samp)
        kw = dict(cfg=m.cfg, slots=slots, greedy_only=True)
        pre = median_seconds(lambda: jax.block_until_ready(prefill(*args, **kw)), 3)
        out = runs[0]["tokens"]
        n = len(out)
        rows.append({"prompt": text, "prompt_tokens": len(ids), "new_tokens": n, "output_ids": out,
                     "prefill_s": pre, "prefill_tok_s": len(ids) / pre, "decode_s": dec,
                     "decode_tok_s": (n - 1) / dec if n > 1 else float("nan")})
    agg = {"prompt_tokens": sum(r["prompt_tokens"] for r in rows),
           "new_tokens": sum(r["new_tokens"] for r in rows),
           "prefill_tok_s": sum(r["prompt_tokens"] for r in rows) / sum(r["prefill_s"] for r in rows),
           "decode_tok_s": sum(r["new_tokens"] - 1 for r in rows) / sum(r["decode_s"] for r in rows),
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "load_s": m.load_seconds, "jax": jax.__version__}
    return {"rows": rows, "aggregate": agg}


def main(argv):
    del argv
    from specjax.models.loader import default_gguf_path
    from specjax.peers import run_peer

    # HF first: Linux carries a parent's peak RSS into an exec'd child, so the child must
    # start before this process has loaded anything big for its peak RSS to be its own.
    hf = run_peer("hf", FLAGS.hf_python, {"gguf": default_gguf_path(), "prompts": PROMPTS,
                                          "max_new_tokens": FLAGS.max_new_tokens}) if FLAGS.hf_python else None
    sj = run_specjax(PROMPTS, FLAGS.max_new_tokens, FLAGS.repeats)
    print(f"\nSmolLM2-135M-Instruct, fp32, greedy, batch 1, max_new_tokens={FLAGS.max_new_tokens}")
    print("| prompt | prompt tok | new tok | specjax prefill tok/s | specjax decode tok/s |"
          + (" HF prefill tok/s | HF decode tok/s | decode ratio | identical |" if hf else ""))
    print("|---|---|---|---|---|" + ("---|---|---|---|" if hf else ""))
    for i, r in enumerate(sj["rows"]):
        line = (f"| {i} | {r['prompt_tokens']} | {r['new_tokens']} | {r['prefill_tok_s']:.0f} | "
                f"{r['decode_tok_s']:.1f} |")
        if hf:
            h = hf["rows"][i]
            same = h["output_ids"] == r["output_ids"]
            line += (f" {h['prefill_tok_s']:.0f} | {h['decode_tok_s']:.1f} | "
                     f"{r['decode_tok_s'] / h['decode_tok_s']:.2f}x | {same} |")
        print(line)
    a = sj["aggregate"]
    print(f"\nspecjax: prefill {a['prefill_tok_s']:.0f} tok/s, decode {a['decode_tok_s']:.1f} tok/s, "
          f"peak RSS {a['peak_rss_mb']:.0f} MB, load {a['load_s']:.1f} s (jax {a['jax']})")
    if hf:
        h = hf["aggregate"]
        print(f"HF transformers: prefill {h['prefill_tok_s']:.0f} tok/s, decode {h['decode_tok_s']:.1f} tok/s, "
              f"peak RSS {h.get('peak_rss_mb', float('nan')):.0f} MB")
        print(f"ratio specjax/HF: decode {a['decode_tok_s'] / h['decode_tok_s']:.2f}x, "
              f"prefill {a['prefill_tok_s'] / h['prefill_tok_s']:.2f}x")
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump({"specjax": sj, "hf": hf}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
