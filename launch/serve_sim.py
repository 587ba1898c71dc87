"""Serve Poisson request streams with no-SD, fixed K and SmartSpec; real engine or simulator.

  # real engine on SmolLM2 (CPU), prompt lookup and layer skip, then the simulator on the
  # same requests for fidelity:
  python launch/serve_sim.py --mode both --rates 0.5,1,2,3,4 --num_requests 20 \\
      --perf_models configs/perf/perf_models.json --plot docs/smartspec_sweep.png
  # ... also simulated with the table scaled by a speed probe taken before each real run:
  python launch/serve_sim.py --mode both --drafters prompt_lookup --speed_probe --rates 0.3,1.2
  # simulated 7B / 70B-scale sweeps from stated A100 assumptions (no device needed):
  python launch/serve_sim.py --mode sim --scale 7b,70b --rates 1,2,4,8,16,32 --plot docs/smartspec_sim.png
  # load test: a burst of 4x the KV rows at t=0
  python launch/serve_sim.py --mode real --burst 4 --drafters prompt_lookup --policies smartspec

Average request latency = finish - arrival (queueing included), like the paper's Figs. 11-12;
speedup = no-SD latency / policy latency at the same rate on the *same* requests and arrival
times (common random numbers: every policy sees the identical stream).

Policies: ``none`` (K = 0), integers (fixed K; host drafters still shrink the block to the
longest draft), ``smartspec`` (goodput selector, moving-average acceptance), ``oracle``
(simulator only: knows the accepted lengths).

User mistakes print one line ("error: ...") and exit with status 2.
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

from specjax import cli, registry  # noqa: E402
from specjax.simulate import report  # noqa: E402
from specjax.sweep import (SCALES, load_prompts, load_replay, load_tree_paths, log_row, make_requests,  # noqa: E402
                           policy_label, rotated, run_summary)

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_enum("mode", "real", ["real", "sim", "both"], "real engine, simulator, or both on the same "
                      "requests (simulator fidelity).")
    cli.define_model_flags()
    cli.define_drafter_flags(several=["prompt_lookup", "layer_skip"], k_buckets="0,1,2,3,4,5")
    cli.define_engine_flags()
    cli.define_forward_flags()
    flags.DEFINE_string("policies", "none,1,3,5,smartspec", "Comma list: none, fixed K integers, smartspec, smartspec-req "
                       "(per-request draft counts), smartspec-conf (confidence-based proposal; device drafters), oracle.")
    cli.define_policy_flags(single=False)
    flags.DEFINE_string("rates", "0.5,1,2,3,4", "Poisson request rates (requests/s).")
    flags.DEFINE_integer("num_requests", 20, "Requests per (rate, policy) run.")
    flags.DEFINE_float("burst", 0.0, "If > 0: a single burst of burst x KV rows requests at t=0 (load test).")
    cli.define_question_flags(max_prompt_tokens=300)
    flags.DEFINE_integer("max_new_tokens", 64, "Tokens per request (EOS ends earlier unless --ignore_eos).")
    flags.DEFINE_bool("ignore_eos", False, "Generate exactly --max_new_tokens per request.")
    flags.DEFINE_string("scale", None, "sim mode without a real model: comma list of 7b, 70b (assumed coefficients).")
    flags.DEFINE_float("sim_alpha", 0.7, "sim --scale: per-token acceptance rate of the draft.")
    flags.DEFINE_string("sim_tree_paths", None, "sim --scale: FILE:DRAFTER, the accepted tree paths a --mode real "
                        "run of a device tree drafter saved in its --out_json: the scale's draft drafts such trees.")
    flags.DEFINE_integer("sim_input_len", 256, "sim --scale: prompt tokens per request.")
    flags.DEFINE_integer("sim_output_len", 128, "sim --scale: output tokens per request.")
    flags.DEFINE_integer("window", 16, "SmartSpec moving-average window (steps).")
    flags.DEFINE_float("prefill_disable", 0.7, "Draft prefill disabled when more than this share of recent steps "
                       "proposed nothing (device drafters).")
    flags.DEFINE_string("out_json", None, "Write all rows as JSON here.")
    flags.DEFINE_string("plot", None, "PNG: latency and speedup vs request rate per drafter.")
    flags.DEFINE_string("benchmarks_md_section", None, "Replace this '## ' section of BENCHMARKS.md with the table.")
    flags.DEFINE_integer("seed", 0, "Arrivals / prompt order / simulator draws.")
    flags.DEFINE_integer("repeats", 1, "Independent request streams per rate (seeds seed..seed+R-1); every "
                         "policy serves each, in a rotated order; tables pool the repeats.")
    flags.DEFINE_string("replay_json", None, "--mode sim: simulate the real runs saved in this --out_json (their "
                        "output lengths and measured acceptance) and report fidelity against them.")
    flags.DEFINE_bool("speed_probe", False, "Real runs: time a few K = 0 steps per batch bucket just before each "
                      "run (~1 s) and save this machine's speed relative to the profile; the simulator is then "
                      "also run with the profiled table scaled by it ('<drafter>+probe' rows), to separate "
                      "machine drift since the profile from the simulator's own error.")
    flags.DEFINE_enum("sim_cost", "table", ["table", "linear"], "What the simulator's event clock charges per step: "
                      "the profiled step-time table (falling back to Eq. 7 off the grid) or Eq. 7 alone. The "
                      "SmartSpec selector plans with Eq. 7 either way.")


def run_real(model, spec, policies, rates, prompts, geom, cost, seed, table=None):
    from specjax.engine.loop import ServingEngine
    from specjax.engine.spec import PolicySpec
    from specjax.goodput import DraftPrefillGate

    drafter, prefill_budget = spec.drafter.name, cli.prefill_budget_from_flags()
    pols = [PolicySpec(p) for p in policies]  # one backend compiles what every policy needs
    be = registry.build_backend(spec, model, draft_first=any(p.draft_first for p in pols),
                                packed=any(p.packed for p in pols))
    t0 = time.perf_counter()
    be.warmup(prompt_lens=[len(p) for p in prompts], progress=True, execute=True)
    print(f"[{drafter}: compiled and ran {len(be.table)} executables in {time.perf_counter() - t0:.0f} s]",
          file=sys.stderr)
    rows, engines = [], {}
    for rate in rates:
        for rep in range(FLAGS.repeats):
            reqs = stream(prompts, rate, seed + rep)
            for pol in rotated(policies, rep):
                probe = None
                if FLAGS.speed_probe and table is not None and table.cells:
                    from specjax.engine.profiling import probe_speed

                    probe = probe_speed(be, table, context=min(len(p) for p in prompts), seed=seed + rep)
                be.reset()
                policy = registry.policy_for(pol, cost, geom["k_buckets"], FLAGS.window, FLAGS.confidence_threshold)
                gate = DraftPrefillGate(FLAGS.prefill_disable) if PolicySpec(pol).goodput else None
                eng = ServingEngine(be, policy, eos_ids=model.tokenizer.eos_ids, prefill_gate=gate,
                                    prefill_budget=prefill_budget)
                outs = eng.run(reqs)
                rows.append(dict(mode="real", drafter=drafter, rate=rate, policy=policy_label(pol), repeat=rep,
                                 out_lens=[len(o.tokens) for o in outs], **run_summary(eng, outs)))
                if probe:
                    rows[-1]["speed_probe"] = probe
                engines[(rate, pol, rep)] = (eng, outs)
                log_row(rows[-1])
    return rows, engines


def stream(prompts, rate, seed):
    if FLAGS.burst > 0:
        return make_requests(prompts, int(FLAGS.burst * max(registry.number_list("batch_buckets", FLAGS.batch_buckets))), None,
                             FLAGS.max_new_tokens, FLAGS.ignore_eos, seed)
    return make_requests(prompts, FLAGS.num_requests, rate, FLAGS.max_new_tokens, FLAGS.ignore_eos, seed)


def run_sim(drafter, policies, rates, reqs_for_rate, cost, accept, device_draft, geom, seed, label=None,
            sim_cost=None, repeats: int = 1, speed=None):
    """``cost``: the linear model the selector plans with; ``sim_cost``: what the event clock
    charges (a profiled table, or ``cost`` itself when None); ``speed``: (rate, repeat, policy
    label) -> the speed probe of that real run, to scale the table by."""
    from specjax.engine.spec import PolicySpec

    from specjax.goodput import DraftPrefillGate
    from specjax.simulate import simulate

    rows = []
    for rate in rates:
        for rep in range(repeats):
            reqs = reqs_for_rate(rate, rep)
            for pol in policies:
                policy = registry.policy_for(pol, cost, geom["k_buckets"], FLAGS.window, FLAGS.confidence_threshold)
                gate = DraftPrefillGate(FLAGS.prefill_disable) if PolicySpec(pol).goodput else None
                charge = sim_cost or cost
                if speed is not None:
                    charge = charge.with_speed(speed.get((rate, rep, policy_label(pol))))
                outs, eng = simulate(reqs, policy, charge, accept, device_draft=device_draft,
                                     k_buckets=geom["k_buckets"], batch_buckets=geom["batch_buckets"],
                                     slots=geom["slots"], seed=seed + rep, prefill_gate=gate,
                                     packed=any(PolicySpec(p).packed for p in policies),
                                     prefill_chunk=FLAGS.prefill_chunk, prefill_budget=FLAGS.prefill_budget or None,
                                     prefill_rows=geom["prefill_rows"])
                rows.append(dict(mode="sim", drafter=label or drafter, real_drafter=drafter, rate=rate,
                                 policy=policy_label(pol), repeat=rep, **run_summary(eng, outs)))
                log_row(rows[-1])
    return rows


# ---------------------------------------------------------------- main


def main(argv):
    cli.run_job(run, argv)


def run():
    from specjax.errors import SpecjaxError
    from specjax.goodput import LinearCost, StepCostModel
    from specjax.goodput.perf_model import ProfiledCost, load_model as load_perf, load_profiled
    from specjax.simulate import AcceptanceProfile

    from specjax.engine.spec import PolicySpec

    policies = [PolicySpec(p, threshold=FLAGS.confidence_threshold).name for p in FLAGS.policies.split(",")
                if p.strip()]
    cli.prefill_budget_from_flags()
    rates = registry.number_list("rates", FLAGS.rates, float, positive=True)
    drafters = cli.drafters_from_flags(allow_none=False)
    base = cli.engine_spec_from_flags(drafter=drafters[0], policy="auto")
    # (this machine's engine: its prefill calls' rows, BackendOptions.prefill_rows_on; a --scale
    # simulation models an accelerator's, the largest bucket)
    import jax

    from specjax.engine.options import BackendOptions

    geom = dict(k_buckets=list(base.k_buckets), batch_buckets=list(base.batch_buckets), slots=base.slots,
                prefill_rows=BackendOptions(batch_buckets=base.batch_buckets).prefill_rows_on(jax.default_backend()))
    for p in policies:  # a fixed K must be compiled (--scale runs check nothing else against a drafter)
        if PolicySpec(p).fixed_k:
            cli.engine_spec_from_flags(drafter=drafters[0], policy=p)
    if FLAGS.num_requests < 1:
        raise SpecjaxError(f"--num_requests must be >= 1, got {FLAGS.num_requests}")
    if FLAGS.repeats < 1:
        raise SpecjaxError(f"--repeats must be >= 1, got {FLAGS.repeats}")
    # Range checks of the remaining numeric flags (NaN and infinities are refused by cli.run_job).
    cli.check_range("burst", 0)
    cli.check_range("sim_alpha", 0, 1)
    cli.check_range("prefill_disable", 0, 1)
    for name in ("max_prompt_tokens", "max_new_tokens", "sim_input_len", "sim_output_len", "window", "draft_layers"):
        cli.check_range(name, 1)
    cli.check_range("seed", 0)
    if FLAGS.burst > 0 and int(FLAGS.burst * max(geom["batch_buckets"])) < 1:
        raise SpecjaxError(f"--burst {FLAGS.burst} x {max(geom['batch_buckets'])} KV rows is less than one request")
    if FLAGS.speed_probe and (FLAGS.mode == "sim" or FLAGS.sim_cost != "table"):
        raise SpecjaxError("--speed_probe scales the profiled table by probes taken before real runs: use it with "
                           "--mode real or both and --sim_cost table")
    if FLAGS.sim_tree_paths and not FLAGS.scale:
        raise SpecjaxError("--sim_tree_paths gives a --scale simulation its head trees: use it with --scale")
    if FLAGS.replay_json and (FLAGS.mode != "sim" or FLAGS.scale):
        raise SpecjaxError("--replay_json re-simulates saved real runs: use it with --mode sim (no --scale)")
    if FLAGS.burst > 0:
        rates = [float("inf")]
    rows = []
    if FLAGS.scale:
        if FLAGS.mode != "sim":
            raise SpecjaxError("--scale is a simulation: use --mode sim")
        from specjax.engine.scheduler import Request

        trees = load_tree_paths(FLAGS.sim_tree_paths) if FLAGS.sim_tree_paths else {}
        for name in [s.strip() for s in FLAGS.scale.split(",")]:
            if name not in SCALES:
                raise SpecjaxError(f"unknown --scale {name!r}; known: {', '.join(SCALES)}")
            sc = SCALES[name]
            # (a head's trees cost the draft forwards the measured drafter's trees took: EAGLE-2's depth)
            cost = StepCostModel(target=LinearCost(**sc["target"]), draft=LinearCost(**sc["draft"]),
                                 prefill=LinearCost(**sc["prefill"]), context_mode="sum",
                                 draft_forwards=trees.get("tree_forwards", 0))
            g = dict(geom, batch_buckets=[b for b in (1, 2, 4, 8, 16, 32, 64) if b <= sc["rows"]], slots=sc["slots"],
                     prefill_rows=None)
            acc = AcceptanceProfile(per_position=(FLAGS.sim_alpha,), **trees)
            import numpy as np

            def reqs_for_rate(rate, rep, n=FLAGS.num_requests):
                rng = np.random.default_rng(FLAGS.seed + rep)
                t = np.cumsum(rng.exponential(1.0 / rate, size=n))
                return [Request(f"s{i}", [1] * FLAGS.sim_input_len, FLAGS.sim_output_len, arrival=float(t[i] - t[0]),
                                ignore_eos=True) for i in range(n)]

            print(f"[{name}: {sc['desc']}]", file=sys.stderr)
            rows += run_sim(name, policies, rates, reqs_for_rate, cost, acc, True, g, FLAGS.seed,
                            label=f"{name} (assumed)", repeats=FLAGS.repeats)
        finish(rows)
        return

    from specjax.models.loader import load_model

    if "oracle" in policies and FLAGS.mode != "sim":
        raise SpecjaxError("the oracle policy needs the true accepted lengths: simulator only (--mode sim)")
    for d in drafters:  # every (drafter, policy) pair checked before the load (smartspec-conf: device drafters)
        for p in policies:
            if p != "oracle":
                cli.engine_spec_from_flags(drafter=d, policy=p)
    specs = {d: cli.engine_spec_from_flags(drafter=d, policy="auto") for d in drafters}
    model = load_model(FLAGS.model, FLAGS.dtype)
    prompts = load_prompts(FLAGS.question_file, model.tokenizer, FLAGS.max_prompt_tokens, ROOT)
    perf_path = FLAGS.perf_models or registry.default_perf_models()
    for d in drafters:
        spec = specs[d].resolved(model)
        key = registry.perf_key(spec, model.cfg.name)
        cost = load_perf(perf_path, key)
        sim_cost = load_profiled(perf_path, key) if FLAGS.sim_cost == "table" else cost
        if FLAGS.sim_cost == "table" and not sim_cost.cells:
            print(f"[{key} has no profiled table: the simulator uses Eq. 7 (re-run launch/profile.py)]", file=sys.stderr)
        lens = {}  # (rate, repeat) -> output lengths the real run produced (EOS included)
        accept = AcceptanceProfile(per_position=(FLAGS.sim_alpha,))
        if FLAGS.mode in ("real", "both"):
            r, real_runs = run_real(model, spec, policies, rates, prompts, geom, cost, FLAGS.seed,
                                    table=sim_cost if FLAGS.sim_cost == "table" else None)
            rows += r
            lens = {(x["rate"], x["repeat"]): x["out_lens"] for x in r if x["policy"] == policy_label(policies[0])}
            accept = measured_acceptance(real_runs)
            ACCEPTANCE[d] = dataclasses.asdict(accept)  # saved in --out_json for --replay_json
        elif FLAGS.replay_json:
            r, lens, accept = load_replay(FLAGS.replay_json, d, rates, policies, FLAGS.repeats)
            rows += r
        if FLAGS.mode in ("sim", "both"):

            def reqs_for_rate(rate, rep):
                reqs = stream(prompts, rate, FLAGS.seed + rep)
                if lens:  # the lengths the real run produced; no EOS in the simulator
                    reqs = [dataclasses.replace(q, max_new_tokens=max(1, n), ignore_eos=True)
                            for q, n in zip(reqs, lens[(rate, rep)])]
                return reqs

            rows += run_sim(d, policies, rates, reqs_for_rate, cost, accept, spec.device_draft, geom, FLAGS.seed,
                            label=d, sim_cost=sim_cost, repeats=FLAGS.repeats)
            probes = {(x["rate"], x["repeat"], x["policy"]): {int(b): f for b, f in x["speed_probe"].items()}
                      for x in rows if x["mode"] == "real" and x["drafter"] == d and x.get("speed_probe")}
            if probes and isinstance(sim_cost, ProfiledCost):
                rows += run_sim(d, policies, rates, reqs_for_rate, cost, accept, spec.device_draft, geom, FLAGS.seed,
                                label=f"{d}+probe", sim_cost=sim_cost, repeats=FLAGS.repeats, speed=probes)
    finish(rows)


ACCEPTANCE: dict = {}  # drafter -> the acceptance profile the simulator used (saved in --out_json)


def measured_acceptance(real_runs):
    """Conditional per-position acceptance and proposal lengths pooled over the real runs."""
    from specjax.simulate import AcceptanceProfile

    prof = AcceptanceProfile.measured([eng for eng, _ in real_runs.values()])
    dist = "" if prof.draft_len_dist is None else f", proposal lengths {[round(x, 2) for x in prof.draft_len_dist]}"
    trees = "" if prof.tree_paths is None else f", {len(prof.tree_paths)} accepted paths of {prof.tree_nodes}-node trees"
    print(f"[measured acceptance per position given the earlier ones {[round(x, 2) for x in prof.per_position]}"
          f"{dist}{trees}]", file=sys.stderr)
    return prof


def finish(runs):
    rows = report.pooled(runs)
    md = ""
    if FLAGS.repeats > 1:
        md += (f"\n(each cell: the mean over {FLAGS.repeats} independent request streams of "
               f"{FLAGS.num_requests} requests; policies run in a rotated order per stream)\n")
    for mode in ("real", "sim"):
        if any(r["mode"] == mode for r in rows):
            md += report.speedup_table(rows, mode) + "\n"
    if any(r["mode"] == "real" for r in rows) and any(r["mode"] == "sim" for r in rows):
        md += report.fidelity_table(rows) + "\n"
    print(md)
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    served = sum(r["requests"] - r["errors"] for r in runs)
    print(f"[{len(runs)} runs, {served} requests served, {sum(r['errors'] for r in runs)} rejected; "
          f"peak RSS {rss:.0f} MiB]", file=sys.stderr)
    if FLAGS.out_json:
        with open(FLAGS.out_json, "w") as f:
            json.dump({"pooled": rows, "runs": runs, "acceptance": ACCEPTANCE}, f, indent=1)
    if FLAGS.plot:
        report.plot(rows, FLAGS.plot)
    if FLAGS.benchmarks_md_section:
        report.replace_md_section(FLAGS.benchmarks_md_section, md, os.path.join(ROOT, "BENCHMARKS.md"),
                                  "python " + " ".join(sys.argv))


if __name__ == "__main__":
    define_flags()
    app.run(main)
