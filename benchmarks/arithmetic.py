"""How far each activation arithmetic is from the float32 model: KL divergence and top-1 agreement
over teacher-forced public text, the way llama.cpp's ``llama-perplexity --kl-divergence`` measures a
quantisation against its full-precision model.

The text: the first turns of Spec-Bench questions, GSM8K test questions with their worked answers
and HumanEval prompts with their solutions (``--data_dir``), each cut to ``--seq_len`` tokens.
Each sequence's first ``--prefix`` tokens are prefilled as serving prefills in that mode, the rest
run in blocks of ``--block`` tokens through the mode's decode/verify forward (what a decode step
or a verify block computes), and the next-token distribution at every block position is compared
with the reference's there:

- ``float32 (XLA)``: the reference, XLA's float32 dot on the loader's dequantized weights;
- ``float32 (rows kernel)``: the launch scripts' default (the GGUF's blocks decoded in registers,
  float32 activations, the CPU attention);
- ``bfloat16 (rows kernel)``: ``--rows_activations bfloat16``, each activation rounded to
  bfloat16, the GGUF weights' integer codes (exact in bfloat16) multiplied in pairs with float32
  sums (``vdpbf16ps`` where the CPU has AVX512_BF16);
- ``int8 (rows kernel)``: ``--rows_activations int8``, each activation row rounded to int8 per group
  of 32 as llama.cpp rounds its activations for Q4_1 weights (its Q8_1).

``--llamacpp_logits FILE``: also score llama.cpp's own logits on the same token ids, from
``benchmarks/arithmetic_llamacpp.py`` run in the llama.cpp peer's venv.

  python benchmarks/arithmetic.py --data_dir ../shared/data --sequences 24 --out arithmetic.json
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("data_dir", os.path.join(ROOT, "..", "shared", "data"), "Public prompt sets (spec_bench, gsm8k, humaneval).")
flags.DEFINE_integer("sequences", 24, "Sequences of text (a third from each set).")
flags.DEFINE_integer("seq_len", 160, "Tokens per sequence.")
flags.DEFINE_integer("prefix", 32, "Tokens prefilled before the scored blocks.")
flags.DEFINE_integer("block", 8, "Tokens per scored block (a verify block's size).")
flags.DEFINE_string("modes", "f32_kernel,bf16,int8", "Modes to score against the XLA float32 reference.")
flags.DEFINE_string("tokens_out", None, "Write the token ids (for arithmetic_llamacpp.py) here as JSON.")
flags.DEFINE_string("llamacpp_logits", None, "An .npz of llama.cpp's logits on --tokens_out's ids, scored too.")
flags.DEFINE_string("out", None, "Write the table and numbers as JSON here.")


def texts(data_dir: str, n: int) -> list[str]:
    """n texts, a third each from Spec-Bench first turns, GSM8K test questions with answers and
    HumanEval prompts with solutions, in a fixed order."""
    def lines(*path):
        with open(os.path.join(data_dir, *path), encoding="utf-8") as f:
            return [json.loads(x) for x in f if x.strip()]

    sb = [q["turns"][0] for q in lines("spec_bench", "question.jsonl")][::7]
    gsm = [f"Question: {q['question']}\nAnswer: {q['answer']}" for q in lines("gsm8k", "test_shared_200.jsonl")]
    he = [q["prompt"] + q["canonical_solution"] for q in lines("humaneval", "HumanEval.jsonl")][::5]
    k = (n + 2) // 3
    return (sb[:k] + gsm[:k] + he[:k])[:n]


def block_logits(params, cfg, fwd, seqs, prefix: int, block: int):
    """Next-token logits [positions, V] at every position after ``prefix`` of each sequence: the
    prefix prefilled as serving prefills (``for_prefill``: int8 under int8, else float32), the rest in
    ``block``-token forwards on the cache (decode/verify)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax import cache as kv
    from specjax.models import llama

    pre = jax.jit(lambda p, t, c: llama.forward(p, t, jnp.arange(t.shape[1])[None], c, llama.causal_mask(1, t.shape[1]),
                                                 cfg=cfg, fwd=fwd.for_prefill(), use_prefix=False)[:2])

    @jax.jit
    def step(p, t, c):
        pos = c.lengths[:, None] + jnp.arange(t.shape[1])[None]
        lg, c = llama.forward(p, t, pos, c, llama.causal_mask(1, t.shape[1]), cfg=cfg, fwd=fwd)[:2]
        return lg, kv.advance(c, jnp.full((1,), t.shape[1], jnp.int32))

    out = []
    for s in seqs:
        c = llama.init_cache_for(cfg, 1, len(s) + block, jnp.float32)
        lg, c = pre(params, jnp.asarray([s[:prefix]], jnp.int32), c)
        c = kv.advance(c, jnp.asarray([prefix], jnp.int32))
        got = [np.asarray(lg[0, -1:], np.float32)]  # the distribution of the first scored token
        for a in range(prefix, len(s) - 1, block):  # (whole blocks: sequences are cut to fit, ``fit``)
            lg, c = step(params, jnp.asarray([s[a:a + block]], jnp.int32), c)
            got.append(np.asarray(lg[0], np.float32))
        out.append(np.concatenate(got))
    return np.concatenate(out)


def compare(ref, other) -> dict:
    """Mean and 99th-percentile KL(ref || other) in nats, and top-1 agreement."""
    import numpy as np

    def logp(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lr, lo = logp(ref.astype(np.float64)), logp(other.astype(np.float64))
    kl = (np.exp(lr) * (lr - lo)).sum(-1)
    return {"positions": int(len(kl)), "kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)),
            "top1": float((ref.argmax(-1) == other.argmax(-1)).mean())}


def run() -> int:
    import numpy as np

    from specjax import specbench
    from specjax.models import llama
    from specjax.models.loader import load_model
    from specjax.models.options import ForwardOptions

    m = load_model()
    cfg, tok = m.cfg, m.tokenizer
    def fit(ids):  # the prefix, whole blocks, and the token the last block position predicts
        n = (min(len(ids), FLAGS.seq_len) - FLAGS.prefix - 1) // FLAGS.block
        return ids[:FLAGS.prefix + FLAGS.block * n + 1]

    seqs = [fit(ids) for ids in (tok.encode(t) for t in texts(FLAGS.data_dir, FLAGS.sequences))
            if len(ids) >= FLAGS.prefix + 2 * FLAGS.block + 1]
    if FLAGS.tokens_out:
        with open(FLAGS.tokens_out, "w") as f:
            json.dump({"sequences": seqs, "prefix": FLAGS.prefix, "block": FLAGS.block}, f)
        if not FLAGS.modes and not FLAGS.llamacpp_logits:
            return 0  # (the ids for the llama.cpp run only)
    rows = m.auto_rows_kernel()
    kernel = ForwardOptions(rows_kernel=rows, attention="cpu")
    modes = {"f32_kernel": ("float32 (rows kernel; the default without AVX512_BF16)", kernel, m.params_for(kernel)),
             "bf16": ("bfloat16 (rows kernel; the default with AVX512_BF16)",
                      dataclasses.replace(kernel, rows_activations="bfloat16"),
                      m.params_for(dataclasses.replace(kernel, rows_activations="bfloat16"))),
             "int8": ("int8 (rows kernel, --rows_activations int8)", dataclasses.replace(kernel, rows_activations="int8"),
                      m.params_for(dataclasses.replace(kernel, rows_activations="int8")))}
    t0 = time.perf_counter()
    ref = block_logits(m.params, cfg, ForwardOptions(), seqs, FLAGS.prefix, FLAGS.block)
    print(f"[reference: {len(ref)} positions of {len(seqs)} sequences in {time.perf_counter() - t0:.0f} s]",
          file=sys.stderr)
    results = {}
    for name in filter(None, FLAGS.modes.split(",")):
        label, fwd, params = modes[name]
        results[label] = compare(ref, block_logits(params, cfg, fwd, seqs, FLAGS.prefix, FLAGS.block))
    if FLAGS.llamacpp_logits:
        lc = np.load(FLAGS.llamacpp_logits)
        got = np.concatenate([lc[f"s{i}"][FLAGS.prefix - 1:len(s) - 1] for i, s in enumerate(seqs)])
        results["llama.cpp (its own arithmetic: Q8_1 activations)"] = compare(ref, got[:len(ref)])
    lines = ["| arithmetic | positions | mean KL vs float32 (nats) | 99th pct KL | top-1 agreement |", "|---|---|---|---|---|"]
    lines += [f"| {k} | {v['positions']} | {v['kl_mean']:.5f} | {v['kl_p99']:.4f} | {100 * v['top1']:.2f}% |"
              for k, v in results.items()]
    table = "\n".join(lines)
    print(f"{specbench.cpu_description()}; {cfg.name}; {len(seqs)} sequences of public text, blocks of "
          f"{FLAGS.block} after a {FLAGS.prefix}-token prefill in the mode; reference: XLA float32\n\n{table}")
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump({"command": "python benchmarks/arithmetic.py " + " ".join(sys.argv[1:]), "results": results,
                       "table": table}, f, indent=1)
    return 0


def main(argv):
    from specjax import cli

    cli.run_job(run, argv)


if __name__ == "__main__":
    app.run(main)
