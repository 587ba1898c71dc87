"""Host time per engine step, phase by phase: AR through the engine (K = 0) against a drafter
under the goodput policy, on the same Spec-Bench prompts, batch 1.

  python benchmarks/step_phases.py --drafter prompt_lookup --categories reasoning,roleplay --per_category 3

Wraps the loop's phases (propose, choose, the backend step and its result transfer, observe,
observe_time, shadow verification) with timers and prints milliseconds per step for both runs:
medians over ``--rounds`` rotated rounds of the harness (specjax.benchtime; one warm-up round).
"""

from __future__ import annotations

import collections
import copy
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from specjax import cli  # noqa: E402

FLAGS = flags.FLAGS
cli.define_model_flags()
cli.define_drafter_flags("prompt_lookup")
cli.define_question_flags(max_prompt_tokens=2048)
flags.DEFINE_string("categories", "reasoning,roleplay", "Comma list of categories.")
flags.DEFINE_integer("per_category", 3, "Prompts per category.")
flags.DEFINE_integer("max_new_tokens", 48, "New tokens per prompt.")
flags.DEFINE_integer("rounds", 3, "Timed rounds (AR and the drafter, each over every prompt, the order rotated).")
flags.DEFINE_string("json_out", None, "Write both sides' medians (seconds, steps, phase seconds) as JSON here.")


def main(argv):
    del argv
    from specjax import registry
    from specjax.benchtime import rounds, summarize
    from specjax.engine import jax_backend, loop, observers
    from specjax.generate import Generator
    from specjax.goodput import selector
    from specjax.models.loader import load_model
    from specjax.spec_generate import SpecStats
    from specjax.specbench import load_questions

    acc = collections.defaultdict(float)

    def timed(cls, name, label):
        f = getattr(cls, name)

        @functools.wraps(f)
        def g(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                acc[label] += time.perf_counter() - t
        setattr(cls, name, g)

    for cls, name, label in ((loop.ServingEngine, "_step", "whole step"), (observers.PolicyFeedback, "_shadow_verify", "shadow"),
                             (jax_backend.JaxBackend, "propose", "propose"), (jax_backend.JaxBackend, "step", "backend step"),
                             (jax_backend.JaxBackend, "_results", "result transfer"),
                             (selector.GoodputPolicy, "choose", "choose"), (selector.GoodputPolicy, "observe", "observe"),
                             (selector.GoodputPolicy, "observe_time", "observe_time")):
        timed(cls, name, label)
    m = load_model(FLAGS.model)
    cats = [c.strip() for c in FLAGS.categories.split(",") if c.strip()]
    qs, _ = load_questions(FLAGS.question_file, cats, FLAGS.per_category)
    prompts = [m.tokenizer.encode_chat(q["text"]) for q in qs]
    ar = Generator(m.cfg, m.params, eos_ids=m.tokenizer.eos_ids)
    from specjax.engine.spec import DrafterSpec, EngineSpec

    pol, label, note = registry.build_policy(EngineSpec(model=FLAGS.model, drafter=DrafterSpec(FLAGS.drafter, k=8)),
                                             m.cfg.name)
    if note:
        print(f"note: {note}", file=sys.stderr)
    g = registry.build_spec_generator(m, FLAGS.drafter, k=8, k_buckets=(0, 1, 2, 4, 8))
    if not registry.DRAFTERS[FLAGS.drafter].device:
        g.share_compiled(ar)  # the same K = 0 executables as AR

    def run(gen, kw=dict):
        def go():
            acc.clear()
            steps = 0
            for p in prompts:
                gen.generate([p], max_new_tokens=FLAGS.max_new_tokens, **kw())
                steps += len(gen.last_engine.steps)
            return {"steps": steps, **{f"phase {k}": v for k, v in acc.items()}}
        return go

    # (a fresh copy of the policy and statistics per run: every run starts from the same state)
    samples = rounds({"AR": run(ar), FLAGS.drafter: run(g, lambda: {"policy": copy.deepcopy(pol), "stats": SpecStats()})},
                     FLAGS.rounds)
    a, d = summarize(samples["AR"]), summarize(samples[FLAGS.drafter])
    print(f"AR {a['s']:.2f} s, {FLAGS.drafter} under {label} {d['s']:.2f} s, speedup {a['s'] / d['s']:.3f} "
          f"(medians of {FLAGS.rounds} rounds)")
    print(f"| phase (ms per step) | AR ({a['steps']:.0f} steps) | {FLAGS.drafter} {label} ({d['steps']:.0f} steps) |")
    print("|---|---|---|")
    for k in sorted({k for k in a | d if k.startswith("phase ")}):
        print(f"| {k[6:]} | {a.get(k, 0.0) / max(a['steps'], 1) * 1e3:.3f} | {d.get(k, 0.0) / max(d['steps'], 1) * 1e3:.3f} |")
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump({"AR": a, FLAGS.drafter: d, "policy": label}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
