"""What a device drafter's backend and the goodput policy add to plain decoding (K = 0).

  python benchmarks/k0_overhead.py --prompt_len 300 --max_new_tokens 48 --rounds 6

1. The plain backend and the layer-skip backend, side by side in one process, both under a
   fixed K = 0 (the layer-skip requests skip their draft prefill, as under a closed prefill
   gate): median prefill ms and median engine step ms over rounds whose order alternates.
2. The host time of one GoodputPolicy step (choose + observe + observe_time) at batch 1 with
   the shipped layer-skip perf model, in microseconds.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Model name, .gguf or HF dir.")
flags.DEFINE_integer("draft_layers", 8, "Layer-skip draft layers.")
flags.DEFINE_integer("prompt_len", 300, "Prompt tokens (random ids).")
flags.DEFINE_integer("max_new_tokens", 48, "New tokens per request.")
flags.DEFINE_integer("rounds", 6, "Timed rounds (after one warm-up round).")


def main(argv):
    del argv
    import numpy as np

    from specjax import buckets as bk, registry
    from specjax.engine.jax_backend import JaxBackend
    from specjax.engine.loop import ServingEngine
    from specjax.engine.scheduler import Request
    from specjax.goodput.perf_model import load_model as load_perf
    from specjax.goodput.selector import BatchView, FixedK, GoodputPolicy
    from specjax.models.loader import load_model

    m = load_model(FLAGS.model)
    cfg, params = m.cfg, m.params
    P, new = FLAGS.prompt_len, FLAGS.max_new_tokens
    prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, P).tolist()
    slots = bk.slot_bucket(P + new + 10, cfg.max_position)
    bes = {"plain": JaxBackend(cfg, params, k_buckets=(0, 2), batch_buckets=(1,), slots=slots),
           "layer_skip": JaxBackend(cfg, params, **registry.drafter_parts(m, "layer_skip", k=2,
                                                                          draft_layers=FLAGS.draft_layers),
                                    k_buckets=(0, 2), batch_buckets=(1,), slots=slots)}
    for be in bes.values():
        be.warmup(prompt_lens=[P], execute=True)
    res = {k: ([], []) for k in bes}
    for rnd in range(FLAGS.rounds + 1):
        for name in (list(bes) if rnd % 2 else list(bes)[::-1]):
            be = bes[name]
            be.reset()
            eng = ServingEngine(be, FixedK(0))
            eng.run([Request("a", prompt, new, ignore_eos=True)])
            if rnd:
                res[name][0].append(eng.prefill_s)
                res[name][1].append(sum(s.wall for s in eng.steps) / len(eng.steps))
    print(f"| backend (K = 0, {P}-token prompt, {new} tokens) | prefill ms | step ms |")
    print("|---|---|---|")
    for k, (pf, st) in res.items():
        print(f"| {k} | {1e3 * statistics.median(pf):.1f} | {1e3 * statistics.median(st):.2f} |")

    from specjax.engine.spec import DrafterSpec, EngineSpec

    spec = EngineSpec(drafter=DrafterSpec("layer_skip", k=8, draft_layers=FLAGS.draft_layers))  # (the plain backends' code)
    pol = GoodputPolicy(load_perf(registry.default_perf_models(), registry.perf_key(spec, cfg.name)))
    view = BatchView(ctx_lens=[P], bucket=1, k_options=(0, 1, 2, 4, 8), request_ids=[1], draft_lens=[8],
                     token_options={k: () for k in (0, 1, 2, 4, 8)})
    n = 2000
    for i in range(n + 50):
        if i == 50:
            t0 = time.perf_counter()
        k = pol.choose(view)
        pol.observe(k, [0], [0], [1])
        pol.observe_time(view, k, view.bucket * (k + 1), 0.035)
    print(f"GoodputPolicy host time per step: {(time.perf_counter() - t0) / n * 1e6:.0f} us")


if __name__ == "__main__":
    app.run(main)
