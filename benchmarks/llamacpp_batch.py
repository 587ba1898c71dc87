"""llama.cpp's batch mode on a batch job's records: the ``llamacpp`` peer (benchmarks/llamacpp_peer.py,
parallel sequences through llama.h) on the same GGUF, the same prompt token ids (the chat template
specjax's batch job applies) and the same new-token budget and EOS ids as launch/batch.py.

  python benchmarks/llamacpp_batch.py --input_jsonl prompts.jsonl --llamacpp_python /work/llamacpp-venv/bin/python \\
      --batch_sizes 8,16,32 --max_new_tokens 96 [--ar_jsonl specjax_ar_output.jsonl]

Prints one Markdown row per (parallel sequences, prefill mode): serving tok/s (new tokens over the
wall time of the whole batch, prefills included, as launch/batch.py's serving figure), the steps, and
with ``--ar_jsonl`` (launch/batch.py's output of the same records) how many outputs equal specjax
AR's (informational: llama.cpp's int8 activations round differently). An optional peer: nothing
here is a dependency of specjax (the peer runs in its own venv).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("input_jsonl", None, "Records with a 'prompt' (and an 'id'), as launch/batch.py reads them.")
flags.DEFINE_string("model", "smollm2-135m", "A GGUF target (a named model shipped as GGUF, or a .gguf file).")
flags.DEFINE_bool("chat", True, "Apply the model's chat template (launch/batch.py --chat).")
flags.DEFINE_integer("max_new_tokens", 96, "New tokens per record.")
flags.DEFINE_string("llamacpp_python", None, "Python of a venv with llama-cpp-python (benchmarks/requirements-llamacpp-peer.txt).")
flags.DEFINE_integer("threads", 2, "llama.cpp threads (n_threads and n_threads_batch).")
flags.DEFINE_string("omp_wait_policy", None, "OMP_WAIT_POLICY for llama.cpp (unset: libgomp's default, spinning; "
                    "PASSIVE only on a loaded machine: it costs llama.cpp ~3x when idle, BENCHMARKS.md).")
flags.DEFINE_list("batch_sizes", ["8"], "Parallel sequences (n_seq_max), one run each.")
flags.DEFINE_list("prefill", ["mixed"], "mixed (prompts ride in the decode calls, llama-server's continuous batching) "
                  "and/or alone (each prompt chunk in a call of its own).")
flags.DEFINE_string("ar_jsonl", None, "launch/batch.py's output of the same records: count equal outputs.")
flags.DEFINE_string("json_out", None, "Write the peer's result here.")


def main(argv):
    from specjax import specbench
    from specjax.errors import SpecjaxError
    from specjax.models.loader import load_model
    from specjax.peers import run_peer

    try:
        if not FLAGS.input_jsonl or not FLAGS.llamacpp_python:
            raise SpecjaxError("--input_jsonl and --llamacpp_python are required")
        bad = [p for p in FLAGS.prefill if p not in ("mixed", "alone")]
        if bad:
            raise SpecjaxError(f"--prefill takes mixed and/or alone, not {bad}")
        sizes = [int(b) for b in FLAGS.batch_sizes]
        if min(sizes) < 1:
            raise SpecjaxError("--batch_sizes must be >= 1")
        gguf = specbench.hf_gguf_path(FLAGS.model)
        tok = load_model(FLAGS.model).tokenizer
        with open(FLAGS.input_jsonl) as f:
            recs = [json.loads(line) for line in f if line.strip()]
        ids = [tok.encode_chat(r["prompt"]) if FLAGS.chat else tok.encode(r["prompt"]) for r in recs]
        job = {"gguf": gguf, "threads": FLAGS.threads, "max_new_tokens": FLAGS.max_new_tokens,
               "eos_ids": list(tok.eos_ids), "modes": ["batch"], "batch_sizes": sizes, "batch_prefill": FLAGS.prefill,
               "batch_outputs": bool(FLAGS.ar_jsonl), "omp_wait_policy": FLAGS.omp_wait_policy,
               "prompts": [{"key": str(r.get("id", i)), "input_ids": x} for i, (r, x) in enumerate(zip(recs, ids))]}
        res = run_peer("llamacpp", FLAGS.llamacpp_python, job)
    except SpecjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ar = None
    if FLAGS.ar_jsonl:
        with open(FLAGS.ar_jsonl) as f:
            got = {str(r["id"]): r.get("output_ids") for r in map(json.loads, f)}
        ar = [got.get(str(r.get("id", i))) for i, r in enumerate(recs)]
    env = res["env"]
    print(f"llama.cpp (llama-cpp-python {env['llama_cpp_python']}, {env['threads']} threads, OMP_WAIT_POLICY "
          f"{env['omp_wait_policy']}): {len(recs)} records, {FLAGS.max_new_tokens} new tokens")
    print("| parallel sequences | prefill | serving tok/s | new tokens | wall s | steps |"
          + (" outputs equal specjax AR's |" if ar else ""))
    print("|---|---|---|---|---|---|" + ("---|" if ar else ""))
    for r in res["batch"]:
        same = f" {sum(o == a for o, a in zip(r['output_ids'], ar))}/{len(ar)} |" if ar else ""
        print(f"| {r['batch_size']} | {r['prefill']} | {r['tok_s']:.1f} | {r['new_tokens']} | {r['wall_s']:.1f} | "
              f"{r['steps']} |{same}")
    if FLAGS.json_out:
        for r in res["batch"]:
            r.pop("output_ids", None)
        with open(FLAGS.json_out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    app.run(lambda argv: sys.exit(main(argv)))
