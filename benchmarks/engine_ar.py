"""Autoregressive decoding through the serving engine (K = 0 of the speculative step table)
against the plain AR reference loop (``specjax.reference_ar``: one jitted decode step per token),
side by side in one process on the same prompts.

  python benchmarks/engine_ar.py --batches 1,8 --max_new_tokens 64 --repeats 5

Per batch size: decode ms per step of each (median over rounds; within a round both run, the
one going first alternating, so machine drift and order effects hit both), the ratio, and whether the greedy tokens are identical. The engine's
step time is the wall time of its whole loop iteration (host bookkeeping included) after the
prefill (mean over the run's steps); the reference's is its decode time over its decode steps.
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Model name, .gguf or HF dir.")
flags.DEFINE_list("batches", ["1", "8"], "Batch sizes.")
flags.DEFINE_integer("prompt_len", 100, "Prompt tokens (random ids).")
flags.DEFINE_integer("max_new_tokens", 64, "New tokens per request.")
flags.DEFINE_integer("repeats", 5, "Alternating timed runs of each side.")


def main(argv):
    del argv
    import numpy as np

    from specjax import buckets as bk
    from specjax.engine.jax_backend import JaxBackend
    from specjax.engine.loop import ServingEngine
    from specjax.engine.scheduler import Request
    from specjax.goodput.selector import FixedK
    from specjax.models.loader import load_model
    from specjax.reference_ar import reference_generate

    m = load_model(FLAGS.model)
    cfg, params = m.cfg, m.params
    rng = np.random.default_rng(0)
    new = FLAGS.max_new_tokens
    print(f"{cfg.name}: AR decode, engine (K = 0 step) vs reference loop; prompts of {FLAGS.prompt_len} random "
          f"tokens, {new} new tokens, greedy, median of {FLAGS.repeats} rounds, the order alternating")
    print("| batch | reference ms/step | engine ms/step | engine / reference | identical |")
    print("|---|---|---|---|---|")
    for B in map(int, FLAGS.batches):
        prompts = [rng.integers(3, cfg.vocab_size, FLAGS.prompt_len).tolist() for _ in range(B)]
        slots = bk.slot_bucket(FLAGS.prompt_len + new + 1, cfg.max_position)
        be = JaxBackend(cfg, params, k_buckets=(0,), batch_buckets=(B,), slots=slots, shrink_patience=10**9)
        be.warmup(prompt_lens=[FLAGS.prompt_len], execute=True)
        reqs = [Request(str(i), p, new, ignore_eos=True) for i, p in enumerate(prompts)]
        ref_tokens = None
        t_ref, t_eng, same = [], [], True
        for rep in range(FLAGS.repeats + 1):  # the first round warms both up (compiles the reference)
            # ABBA: the side that runs first alternates, so neither always follows the other
            for side in (("ref", "eng") if rep % 2 else ("eng", "ref")):
                if side == "ref":
                    res = reference_generate(cfg, params, prompts, max_new_tokens=new, ignore_eos=True)
                    ref_tokens = [r.tokens for r in res]
                    dec = max(r.decode_s for r in res) / (new - 1)
                else:
                    be.reset()
                    eng = ServingEngine(be, FixedK(0))
                    outs = eng.run(reqs)
                    eng_step = sum(s.wall for s in eng.steps) / len(eng.steps)
            same &= [o.tokens for o in outs] == ref_tokens
            if rep:
                t_ref.append(dec)
                t_eng.append(eng_step)
        r, e = 1e3 * statistics.median(t_ref), 1e3 * statistics.median(t_eng)
        print(f"| {B} | {r:.2f} | {e:.2f} | {e / r:.3f} | {'yes' if same else '**NO**'} |", flush=True)


if __name__ == "__main__":
    app.run(main)
