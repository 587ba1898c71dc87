"""Plain decoding (K = 0) through the serving engine, side by side in one process on the same
prompts: against the plain AR reference loop (``specjax.reference_ar``: one jitted decode step
per token) and, with --draft_layers, against a layer-skip drafter's backend under the same fixed
K = 0 (its requests skip their draft prefill, as under a closed prefill gate).

  python benchmarks/engine_ar.py --batches 1,8 --rounds 6
  python benchmarks/engine_ar.py --batches 1 --max_new_tokens 96 --decode_steps 1,16 --rounds 6
  python benchmarks/engine_ar.py --batches 1 --prompt_len 300 --max_new_tokens 48 --rounds 6 --draft_layers 8 \
      --policy_time

Per batch size and side: median prefill ms and decode ms per step over rotated rounds (the
harness, specjax.benchtime: the side going first changes every round, so machine drift and order
effects hit every side), the step time over the reference's, and whether the greedy tokens are
identical. --decode_steps: one engine side per value, each a backend whose K = 0 steps run up to
that many per device call (step.spec_decode; 1 = a call per step). An engine step is the wall time
of its whole loop iteration (host bookkeeping included; a decode call's divided by the steps it
ran) after the prefill, mean over the run's steps; the reference's is its decode time over
its decode steps. CPU ms/token: this process's CPU time per generated token over the whole run
(prefill included, the same work on every side), which other processes' load on a shared machine
leaves out. --policy_time adds the host time of one GoodputPolicy step (choose + observe +
observe_time) at batch 1 with the shipped layer-skip perf model, in microseconds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Model name, .gguf or HF dir.")
flags.DEFINE_list("batches", ["1", "8"], "Batch sizes.")
flags.DEFINE_integer("prompt_len", 100, "Prompt tokens (random ids).")
flags.DEFINE_integer("max_new_tokens", 64, "New tokens per request.")
flags.DEFINE_integer("rounds", 5, "Timed rounds of every side (after one warm-up round).")
flags.DEFINE_integer("draft_layers", 0, "Also run a layer-skip backend with this many draft layers at K = 0 (0: no).")
flags.DEFINE_list("decode_steps", ["1"], "The engine side once per value: K = 0 steps per decode call "
                  "(BackendOptions.decode_steps; 1: a call per step).")
flags.DEFINE_integer("rows_kernel", 0, "ForwardOptions.rows_kernel of every side (-1: the launch scripts' default, "
                     "LoadedModel.auto_rows_kernel).")
flags.DEFINE_list("variants", [], "Also, per variant, an engine side (decode calls of the last --decode_steps value) "
                  "and a reference loop with other forward options: 'int8' / 'bfloat16' (rows_activations: activations rounded to int8, "
                  "another model, so its tokens are compared with its own reference loop, and the CPU attention "
                  "kernel), 'cpu_attention' (float32, the CPU attention kernel), 'scan' (scan_layers: the layers as one loop, "
                  "with the rows kernel over its packed stacks in place; scan5 / scan10: 5 / 10 layers per loop iteration); "
                  "several joined by + combine.")
flags.DEFINE_bool("reference", True,
                  "Also time the reference loop (the ratio column's base; else the first engine side).")
flags.DEFINE_bool("policy_time", False, "Also time the goodput policy's host work per step.")
flags.DEFINE_string("json_out", None, "Write the rows (medians per batch and side) as JSON here.")


def policy_host_us(cfg, P: int, n: int = 2000) -> float:
    from specjax import registry
    from specjax.goodput.perf_model import hardware_key, load_model as load_perf
    from specjax.goodput.selector import BatchView, GoodputPolicy

    # the shipped layer-skip model of this target and hardware (whatever compiled-code part its key has)
    path = registry.default_perf_models()
    prefix = f"{cfg.name}|{registry.perf_model_label('layer_skip', FLAGS.draft_layers or 8)}|{hardware_key()}"
    with open(path) as f:
        keys = sorted(k for k in json.load(f) if k.startswith(prefix))
    if not keys:
        raise SystemExit(f"--policy_time: {path} has no performance model {prefix}*")
    pol = GoodputPolicy(load_perf(path, keys[0]))
    view = BatchView(ctx_lens=[P], bucket=1, k_options=(0, 1, 2, 4, 8), request_ids=[1], draft_lens=[8],
                     token_options={k: () for k in (0, 1, 2, 4, 8)})
    for i in range(n + 50):
        if i == 50:  # the first calls warm the policy's caches
            t0 = time.perf_counter()
        k = pol.choose(view)
        pol.observe(k, [0], [0], [1])
        pol.observe_time(view, k, view.bucket * (k + 1), 0.035)
    return (time.perf_counter() - t0) / n * 1e6


def main(argv):
    del argv
    import numpy as np

    from specjax import buckets as bk, registry
    from specjax.benchtime import rounds, serve_sample, summarize
    from specjax.engine.loop import ServingEngine
    from specjax.engine.scheduler import Request
    from specjax.goodput.selector import FixedK
    from specjax.engine.jax_backend import JaxBackend
    from specjax.models.loader import load_model
    from specjax.models.options import ForwardOptions
    from specjax.reference_ar import reference_generate

    m = load_model(FLAGS.model)
    cfg = m.cfg
    fwd = ForwardOptions(rows_kernel=m.auto_rows_kernel() if FLAGS.rows_kernel < 0 else FLAGS.rows_kernel)
    params = m.params_for(fwd)
    rng = np.random.default_rng(0)
    P, new = FLAGS.prompt_len, FLAGS.max_new_tokens
    print(f"{cfg.name}: AR decode (K = 0) through the engine vs the reference loop; prompts of {P} random tokens, "
          f"{new} new tokens, greedy, median of {FLAGS.rounds} rotated rounds, rows kernel {fwd.rows_kernel}")
    base_name = "reference" if FLAGS.reference else "first side"
    print(f"| batch | side | prefill ms | ms/step | decode tok/s | step / {base_name} | CPU ms/token | identical |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for B in map(int, FLAGS.batches):
        prompts = [rng.integers(3, cfg.vocab_size, P).tolist() for _ in range(B)]
        slots = bk.slot_bucket(P + new + 1, cfg.max_position)
        backends = {("engine" if n == 1 else f"engine, {n}-step decode calls"): JaxBackend(
            cfg, params, k_buckets=(0,), batch_buckets=(B,), slots=slots, fwd=fwd, decode_steps=n)
            for n in map(int, FLAGS.decode_steps)}
        if FLAGS.draft_layers:
            backends[f"engine, layer_skip{FLAGS.draft_layers} backend"] = registry.make_backend(
                m, "layer_skip", k_buckets=(0, 2), batch_buckets=(B,), slots=slots, draft_layers=FLAGS.draft_layers,
                fwd=fwd)
        known = {"int8": dict(rows_activations="int8", attention="cpu"), "bfloat16": dict(rows_activations="bfloat16", attention="cpu"), "cpu_attention": dict(attention="cpu"),
                 "scan": dict(scan_layers=1), "scan5": dict(scan_layers=5), "scan10": dict(scan_layers=10)}
        parts = {v: v.split("+") for v in FLAGS.variants}  # ("scan+cpu_attention": both)
        if {p for ps in parts.values() for p in ps} - set(known):
            raise app.UsageError(f"--variants takes {sorted(known)} (or several joined by +), got {FLAGS.variants}")
        variants = {v: dataclasses.replace(fwd, **{k: x for p in ps for k, x in known[p].items()})
                    for v, ps in parts.items()}
        for v, f in variants.items():
            backends[f"engine, {v}"] = JaxBackend(cfg, m.params_for(f), k_buckets=(0,), batch_buckets=(B,), slots=slots,
                                                  fwd=f, decode_steps=int(FLAGS.decode_steps[-1]))
        for be in backends.values():
            be.warmup(prompt_lens=[P], execute=True)
        reqs = [Request(str(i), p, new, ignore_eos=True) for i, p in enumerate(prompts)]

        def reference(f=fwd):
            def run():
                res = reference_generate(cfg, m.params_for(f), prompts, max_new_tokens=new, ignore_eos=True, fwd=f)
                return {"prefill_s": max(r.prefill_s for r in res),
                        "step_s": max(r.decode_s for r in res) / (new - 1), "tokens": [r.tokens for r in res]}
            return run

        def engine(be):
            def run():
                be.reset()
                return serve_sample(ServingEngine(be, FixedK(0)), reqs)
            return run

        # the warm-up round compiles the reference loop
        def cpu(fn):  # this process's CPU seconds per generated token, prefill included (the same for every side):
            def run():  # what other processes on a shared machine take does not count here
                t = time.process_time()
                out = fn()
                return {**out, "cpu_tok_s": (time.process_time() - t) / (B * new)}
            return run

        sides = {"reference": reference()} if FLAGS.reference else {}
        sides.update({f"reference, {v}": reference(f) for v, f in variants.items()})
        samples = rounds({n: cpu(f) for n, f in {**sides, **{n: engine(be) for n, be in backends.items()}}.items()},
                         FLAGS.rounds)
        base = next(iter(samples))
        ref = summarize(samples[base])
        for side, ss in samples.items():  # (a variant's tokens: its own reference loop's)
            row = summarize(ss)
            own = next((v for v in variants if side.endswith(", " + v)), None)
            want = samples[f"reference, {own}" if own and FLAGS.reference else base][0]["tokens"]
            same = all(s["tokens"] == want for s in ss)
            rows.append({"batch": B, "side": side, **row, "identical": same})
            print(f"| {B} | {side} | {1e3 * row['prefill_s']:.1f} | {1e3 * row['step_s']:.2f} | "
                  f"{B / row['step_s']:.1f} | {row['step_s'] / ref['step_s']:.3f} | {1e3 * row['cpu_tok_s']:.2f} | "
                  f"{'yes' if same else '**NO**'} |", flush=True)
    out = {"rows": rows}
    if FLAGS.policy_time:
        out["policy_host_us"] = policy_host_us(cfg, P)
        print(f"GoodputPolicy host time per step: {out['policy_host_us']:.0f} us")
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    app.run(main)
