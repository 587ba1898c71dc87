"""A device drafter's fixed-K steps run alone (a device call per step) against in calls (the
engine's default: ``JaxBackend.fused_steps``, a committed run of steps as one ``spec_decode``
call), beside AR in calls, on a few chat prompts, the arms in rotated order each round.

  python benchmarks/calls_vs_alone.py --drafter eagle --ks 1,2,4 --rounds 3

Per arm: tokens per verify step (bonus included), wall ms per step (prefill included, so a K > 0
step's cost over AR's reads a little high: fewer steps share the prefill) and its ratio to AR's
in calls, ms per token and the speed against AR in calls. Every arm's greedy tokens are checked
against AR's.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from absl import app, flags

from specjax import cli, registry
from specjax.goodput import FixedK

PROMPTS = ("Write a short story about a lighthouse keeper who finds a message in a bottle.",
           "Explain why the sky is blue to a ten year old.",
           "What are the main causes of the French Revolution?")


def define_flags():
    cli.define_model_flags()
    cli.define_drafter_flags("eagle")
    cli.define_forward_flags()
    cli.define_engine_flags()
    cli.define_policy_flags()
    flags.DEFINE_string("ks", "1,2,4", "Fixed K values to time (each a compiled K bucket).")
    flags.DEFINE_integer("rounds", 3, "Rounds over the prompts (each round every arm, rotated order).")
    flags.DEFINE_integer("max_new_tokens", 96, "New tokens per prompt.")


def _policy(k: int, alone: bool) -> FixedK:
    pol = FixedK(k)
    if alone:
        pol.call_steps = 1  # a decision due every step: each step its own device call
    return pol


def run():
    FLAGS = flags.FLAGS
    ks = registry.number_list("ks", FLAGS.ks, minimum=1)
    spec = cli.engine_spec_from_flags(policy="auto")
    model, spec = cli.load_target(spec)
    gen = registry.build_generator(spec, model)
    prompts = [model.tokenizer.encode_chat(p) for p in PROMPTS]
    registry.warm_spec(gen, [registry.spec_shapes(gen, len(p), FLAGS.max_new_tokens) for p in prompts], max(ks),
                       execute=True)
    arms = [(0, False), (0, True)] + [(k, alone) for k in ks for alone in (True, False)]
    res = {a: [] for a in arms}
    ref = {}
    for rnd in range(FLAGS.rounds):
        order = arms[rnd % len(arms):] + arms[:rnd % len(arms)]
        for i, p in enumerate(prompts):
            for a in order:
                t0 = time.perf_counter()
                out = gen.generate([p], max_new_tokens=FLAGS.max_new_tokens, num_spec_tokens=a[0], policy=_policy(*a))
                dt = time.perf_counter() - t0
                if ref.setdefault(i, out[0].tokens) != out[0].tokens:
                    raise SystemExit(f"K={a[0]} ({'alone' if a[1] else 'in calls'}) diverged from AR on prompt {i}")
                steps = gen.last_engine.steps
                res[a].append((dt, len(steps), sum(s.generated for s in steps)))
    base = np.array(res[(0, False)])
    ar_tok, ar_step = base[:, 0].sum() / base[:, 2].sum(), base[:, 0].sum() / base[:, 1].sum()
    print(f"{model.cfg.name}, {spec.drafter.name}, fixed K, batch 1, greedy, {len(prompts)} chat prompts x "
          f"{FLAGS.rounds} rounds, {FLAGS.max_new_tokens} new tokens; every arm's tokens identical to AR's")
    print("| K | steps run | tokens / step | wall ms per step (over AR's) | ms per token | speed against AR in calls |")
    print("|---|---|---|---|---|---|")
    for a in arms:
        x = np.array(res[a])
        step, tok = x[:, 0].sum() / x[:, 1].sum(), x[:, 0].sum() / x[:, 2].sum()
        print(f"| {a[0]} | {'alone' if a[1] else 'in calls'} | {x[:, 2].sum() / x[:, 1].sum():.2f} | "
              f"{step * 1e3:.2f} ({step / ar_step:.2f}x) | {tok * 1e3:.2f} | {ar_tok / tok:.2f}x |")
    sys.stdout.flush()


def main(argv):
    cli.run_job(run, argv)


if __name__ == "__main__":
    define_flags()
    app.run(main)
