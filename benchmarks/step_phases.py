"""Host time per engine step, phase by phase: AR through the engine (K = 0) against a drafter
under the goodput policy, on the same Spec-Bench prompts, batch 1.

  python benchmarks/step_phases.py --drafter prompt_lookup --categories reasoning,roleplay --per_category 3

Wraps the loop's phases (propose, choose, the backend step and its result transfer, observe,
observe_time, shadow verification) with timers and prints milliseconds per step for both runs,
after ``--rounds`` alternating timed rounds (the last round's phases are printed).
"""

from __future__ import annotations

import collections
import copy
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Model name, .gguf or HF dir.")
flags.DEFINE_string("drafter", "prompt_lookup", "A host drafter (prompt_lookup, suffix, hybrid) or layer_skip.")
flags.DEFINE_string("question_file", "../shared/data/spec_bench/question.jsonl", "Spec-Bench questions.")
flags.DEFINE_string("categories", "reasoning,roleplay", "Comma list of categories.")
flags.DEFINE_integer("per_category", 3, "Prompts per category.")
flags.DEFINE_integer("max_new_tokens", 48, "New tokens per prompt.")
flags.DEFINE_integer("rounds", 3, "Timed rounds (AR then the drafter, each over every prompt).")


def main(argv):
    del argv
    from specjax import registry
    from specjax.engine import jax_backend, loop
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

    for cls, name, label in ((loop.ServingEngine, "_step", "whole step"), (loop.ServingEngine, "_shadow_verify", "shadow"),
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
    if FLAGS.drafter not in registry.DEVICE_DRAFTERS:
        g.share_compiled(ar)  # the same K = 0 executables as AR
    ar.generate([prompts[0]], max_new_tokens=FLAGS.max_new_tokens)
    g.generate([prompts[0]], max_new_tokens=FLAGS.max_new_tokens, policy=copy.deepcopy(pol), stats=SpecStats())

    def run(gen, **kw):
        acc.clear()
        t, steps = time.perf_counter(), 0
        for p in prompts:
            gen.generate([p], max_new_tokens=FLAGS.max_new_tokens, **kw)
            steps += len(gen.last_engine.steps)
        return time.perf_counter() - t, steps, dict(acc)

    for r in range(FLAGS.rounds):
        ta, na, pa = run(ar)
        tg, ng, pg = run(g, policy=copy.deepcopy(pol), stats=SpecStats())
        print(f"round {r}: AR {ta:.2f} s, {FLAGS.drafter} under {label} {tg:.2f} s, speedup {ta / tg:.3f}")
    print(f"| phase (ms per step, last round) | AR ({na} steps) | {FLAGS.drafter} {label} ({ng} steps) |")
    print("|---|---|---|")
    for k in sorted(set(pa) | set(pg)):
        print(f"| {k} | {pa.get(k, 0.0) / max(na, 1) * 1e3:.3f} | {pg.get(k, 0.0) / max(ng, 1) * 1e3:.3f} |")


if __name__ == "__main__":
    app.run(main)
