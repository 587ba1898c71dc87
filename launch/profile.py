"""Profile forward passes on this hardware and fit SmartSpec's performance model.

  python launch/profile.py --out perf_models.json                        # SmolLM2, prompt lookup + layer skip
  python launch/profile.py --drafters suffix --rows_kernel 0             # host drafters share the target-only model
  python launch/profile.py --drafters prompt_lookup --batch_buckets 1,2,4 --plot docs/perf_fit.png
  python launch/profile.py --model target.gguf --drafters draft_model --draft_model draft.gguf

Host drafters (prompt lookup, suffix, hybrid) are costed with the target-only model, profiled
under the name prompt_lookup; a device drafter (layer_skip, draft_model) adds its draft's
forwards, profiled under its own name (the layer count, the draft model's name).

For every batch bucket x context length x compiled K it times real engine steps (the target's
verify of a K + 1 block; with a device drafter also the draft's K forwards), fits

    T_fwd = a * N_context + g * N_batched + d     (per model: target and draft)

by least squares, reports R^2 on held-out grid cells, fits the prefill cost, then serves a
burst of requests through the real engine to calibrate the loop's host overhead per step and per
request (scored on held-out engine steps). It profiles the code serving runs: the same forward
flags (``--rows_kernel -1`` resolved the same way), dtype and buckets. Coefficients go to ``--out``
under the key '<model>|<drafter>|<platform>:<device>|<code>' (registry.perf_key; <code> the
forward options, dtype and layout), next to any other models already in the file; a serving run
of other code does not use them (``--policy smartspec`` refuses, ``auto`` says so and runs a fixed K).

User mistakes print one line ("error: ...") and exit with status 2.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from specjax import buckets as bk  # noqa: E402
from specjax import cli, plots, registry  # noqa: E402
from specjax.sweep import calibration_requests  # noqa: E402

FLAGS = flags.FLAGS

def define_flags() -> None:
    cli.define_model_flags()
    cli.define_drafter_flags(several=["prompt_lookup", "layer_skip"], k_buckets="0,1,2,3,4,5")
    cli.define_engine_flags()
    cli.define_forward_flags()
    flags.DEFINE_string("contexts", "32,150,280", "Context lengths to time steps at.")
    flags.DEFINE_string("prefill_lens", "24,50,100,200,400", "Prompt lengths to time prefills at (one per "
                        "prompt bucket serving will use: the simulator looks the medians up).")
    flags.DEFINE_integer("reps", 4, "Timed steps per (batch, context, K) cell.")
    flags.DEFINE_float("holdout", 0.25, "Share of grid cells held out to score the fit.")
    flags.DEFINE_integer("calibration_requests", 24, "Requests served to calibrate host overhead (0 = skip).")
    flags.DEFINE_integer("max_new_tokens", 48, "Calibration requests: tokens per request.")
    flags.DEFINE_string("out", "configs/perf/perf_models.json", "JSON file to store the fitted models in (other keys are kept).")
    flags.DEFINE_string("plot", None, "Optional PNG: predicted vs measured step time (held-out cells marked).")
    flags.DEFINE_integer("seed", 0, "Random seed (prompts, held-out split).")
    flags.DEFINE_string("records_out", None, "Optional JSON: every timed step and prefill (for refits).")


def main(argv):
    cli.run_job(run, argv)


def run():
    from tqdm import tqdm

    from specjax.engine.loop import ServingEngine
    from specjax.engine.profiling import (calibrate_host, fit_profile, profile_prefills, profile_row_ops,
                                         profile_steps, row_op_cells)
    from specjax.errors import SpecjaxError
    from specjax.goodput import FixedK, StepCostModel
    from specjax.goodput.perf_model import ProfiledCost, hardware_key, prefill_table_cells, save_table, table_cells

    # Host drafters add nothing to the device step: they share the target-only model, profiled
    # under prompt_lookup; each device drafter gets its own.
    names = cli.drafters_from_flags(allow_none=False)
    specs = {}
    host = registry.TARGET_ONLY
    for d in [host] + [d for d in names if registry.DRAFTERS[d].device]:
        # (no prefix cache: profiling times the same prompts' prefills again and again)
        specs[d] = dataclasses.replace(cli.engine_spec_from_flags(drafter=d, policy="auto"), prefix_cache_mb=0)
    drafters, devs = list(specs), list(specs)[1:]
    ks, bbs = list(specs[host].k_buckets), list(specs[host].batch_buckets)
    contexts, plens = registry.number_list("contexts", FLAGS.contexts, minimum=0), registry.number_list("prefill_lens", FLAGS.prefill_lens, minimum=0)
    if max(contexts) + (FLAGS.reps + 1) * (max(ks) + 1) * len(ks) + max(ks) + 1 > FLAGS.slots:
        raise SpecjaxError(f"--contexts up to {max(contexts)} leave no room for the timed steps in --slots "
                           f"{FLAGS.slots}; lower the contexts or raise --slots")
    if not 0 < FLAGS.holdout < 1:
        raise SpecjaxError(f"--holdout must be in (0, 1), got {FLAGS.holdout}")
    for name, lo in (("reps", 1), ("calibration_requests", 0), ("max_new_tokens", 1), ("seed", 0)):
        cli.check_range(name, lo)
    model, _ = cli.load_target(specs[host])
    # serving's forward options, the rows kernel resolved the same way: the profile is of its code
    specs = {d: sp.resolved(model) for d, sp in specs.items()}
    hw = hardware_key()
    base = StepCostModel(target=None, context_mode="padded")  # XLA:CPU chunked attention reads padded rows
    print(f"[{model.cfg.name} on {hw}, {specs['prompt_lookup'].code_key()}; batches {bbs}, K {ks}, contexts "
          f"{contexts}]", file=sys.stderr)

    t0 = time.perf_counter()
    cal_reqs = calibration_requests(model.tokenizer, FLAGS.calibration_requests, FLAGS.max_new_tokens)
    warm_lens = contexts + plens + [len(r.prompt) for r in cal_reqs]
    tgt_be = registry.build_backend(specs[host], model, profiling=True)
    tgt_be.warmup(prompt_lens=warm_lens, progress=True)
    cells = len(bbs) * len(contexts) * len(ks)
    with tqdm(total=cells, desc="target steps", disable=None) as bar:
        tgt = profile_steps(tgt_be, bbs, contexts, ks, FLAGS.reps, FLAGS.seed, bar.update)
    pre = profile_prefills(tgt_be, bbs, plens)
    row_ops = {host: profile_row_ops(tgt_be)}
    fits = {host: _with_call(fit_profile(tgt, [], pre, base, FLAGS.holdout, FLAGS.seed), tgt_be) + (tgt, [])}
    _save(model, specs[host], fits[host], contexts)  # before the (long) rest
    dev_be, dev_pre = {}, {}
    for d in devs:
        be = dev_be[d] = registry.build_backend(specs[d], model)
        be.warmup(prompt_lens=warm_lens, progress=True)
        with tqdm(total=cells, desc=f"{d} steps", disable=None) as bar:
            # (its own K buckets: those above the most drafts its steps take are not compiled)
            dr = profile_steps(be, bbs, contexts, [k for k in be.k_buckets if k > 0], FLAGS.reps, FLAGS.seed,
                               bar.update)
        dev_pre[d] = profile_prefills(be, bbs, plens)
        row_ops[d] = profile_row_ops(be)  # its state holds the draft's cache too
        fits[d] = _with_call(fit_profile(tgt, dr, dev_pre[d], base, FLAGS.holdout, FLAGS.seed), be) + (tgt, dr)
        _save(model, specs[d], fits[d], contexts)
    print(f"[profiled in {time.perf_counter() - t0:.0f} s]", file=sys.stderr)
    if FLAGS.records_out:  # raw timings, to refit or inspect without profiling again
        recs = {"target": tgt, "prefill": pre, "row_ops": row_ops}
        for d in devs:
            recs[d], recs[f"prefill_{d}"] = fits[d][3], dev_pre[d]
        with open(FLAGS.records_out, "w") as f:
            json.dump(recs, f)

    for d in drafters:
        m, rep, tg, dr = fits[d]
        if cal_reqs:
            if not specs[d].device_draft:
                be = registry.build_backend(specs[d], model)
                be.table = tgt_be.table  # same compiled executables; only the drafter differs
            else:
                be = dev_be[d]
            steps = []
            bks = list(be.k_buckets)
            for k in sorted({0, bk.proposal_bucket(bks, min(2, max(bks))), max(bks)}):  # (2, or the next compiled K)
                be.reset()
                eng = ServingEngine(be, FixedK(k), eos_ids=model.tokenizer.eos_ids)
                eng.run(cal_reqs)
                steps += eng.steps
            m, cal = calibrate_host(steps, m, FLAGS.seed)
            rep.update(cal)
        # The simulator's profiled table: medians of the timed steps (K = 0 from the target grid)
        # with its own host calibration on the same engine steps.
        table = ProfiledCost(m, table_cells([r for r in tg if d not in dev_be or r["K"] == 0] + dr,
                                            m.chunk), row_op_cells(row_ops[d]),
                             # a device drafter's request admitted without its draft prefills the target only
                             prefill_plain=fits[host][0].prefill if d in dev_be else None,
                             prefill_cells=prefill_table_cells(pre, False)
                             + (prefill_table_cells(dev_pre[d], True) if d in dev_be else ()))
        if cal_reqs:
            table, tcal = calibrate_host(steps, table, FLAGS.seed)
            rep.update({f"table_{k}": v for k, v in tcal.items() if k != "calibration_steps"})
        key = _save(model, specs[d], (m, rep), contexts)
        save_table(FLAGS.out, key, table)
        label = key.split("|")[1]
        print(f"\n{key}")
        print(f"  target: a={m.target.alpha:.3e} s/ctx-token  g={m.target.gamma:.3e} s/token  d={m.target.delta * 1e3:.2f} ms")
        if m.draft:
            print(f"  draft:  a={m.draft.alpha:.3e}  g={m.draft.gamma:.3e}  d={m.draft.delta * 1e3:.2f} ms per forward")
        print(f"  prefill: {m.prefill.gamma * 1e6:.1f} us/token + {m.prefill.delta * 1e3:.2f} ms")
        print(f"  a device call: {m.call_s * 1e3:.2f} ms beyond its steps")
        print(f"  host: {m.host_step * 1e3:.2f} ms/step + {m.host_row * 1e3:.3f} ms/request (linear model); "
              f"{table.linear.host_step * 1e3:.2f} ms/step + {table.linear.host_row * 1e3:.3f} ms/request (table)")
        print("  row ops (ms): " + ", ".join(f"{op} {a}->{b} {t * 1e3:.1f}" for op, a, b, t in table.row_ops))
        print("  " + json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rep.items()}))
        if FLAGS.plot:
            plots.perf_fit(FLAGS.plot if len(drafters) == 1 else FLAGS.plot.replace(".png", f"_{label}.png"), m, tg,
                           dr, label)
    print(f"\n[saved to {FLAGS.out}]", file=sys.stderr)


def _with_call(fit, be):
    """A fit (model, report) with the backend's per-call cost measured (StepCostModel.call_s)."""
    from specjax.engine.profiling import profile_call_overhead

    m, rep = fit
    call_s = profile_call_overhead(be, reps=FLAGS.reps + 2, seed=FLAGS.seed)
    return dataclasses.replace(m, call_s=call_s), dict(rep, call_s=call_s)


def _save(model, spec, fit, contexts) -> str:
    from specjax.goodput.perf_model import save_model

    m, rep = fit[0], fit[1]
    key = registry.perf_key(spec, model.cfg.name)
    meta = {"report": rep, "batch_buckets": list(spec.batch_buckets), "k_buckets": list(spec.k_buckets),
            "slots": spec.slots, "contexts": contexts,
            "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    save_model(FLAGS.out, key, m, meta)
    return key


if __name__ == "__main__":
    define_flags()
    app.run(main)
