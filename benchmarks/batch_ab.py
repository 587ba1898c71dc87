"""One JSONL batch job served again and again in one process, turn about: specjax AR and each
drafter under its policy (SmartSpec by default), every run a whole fresh job through the serving
path of launch/batch.py (specjax.serve_job: a new backend and policy per run, as a new process
would have, everything compiled and run once before serving), in rounds whose order rotates.

  python benchmarks/batch_ab.py --input_jsonl prompts.jsonl --chat --batch_buckets 1,2,4 \\
      --max_new_tokens 96 --arms none,prompt_lookup,suffix,layer_skip,none --rounds 3 --json_out ab.json

Why not one process per run (benchmarks/batch_drafters.sh): on the 2-core machines here, two
processes serving the very same AR job differ by up to 14% (151.8-172.9 tok/s seen on one 64-record
job, 2026-11-30), more than the 2% a drafter may cost, and a drafter that never drafts measured
0.90-1.06x AR that way. Here every arm shares the loaded weights and the process, and machine drift
falls on every arm alike (rotation: no arm always runs first or after a given other). A second
``none`` arm is a control: AR against AR shows what this harness cannot tell apart.

Prints, per round and over all rounds, each arm's serving tok/s (compilation excluded; tokens over
the rounds' summed serving seconds), serving CPU ms per token, the serving loop's host ms per token
(ServingEngine.host_s: wall time between device calls, where a drafter's upkeep at K = 0 lands:
proposals, the policy's choice, shadow verification; measured apart from the device steps, so
machine drift barely moves it), mean K and its ratio to the first
``none`` arm of the same round, and per run its ratio to the AR runs (any ``none`` arm) nearest
before and after it in the order they ran (``bracketed``: drift within a round cancels); greedy outputs must equal AR's, record by record. The outputs of
every run stay in --out_dir.

``--paired``: runs one after the other still differ by up to 8% here within minutes (198.9 and
182.6 tok/s for two AR runs of one process, 2026-11-30). So each arm serves beside an AR job of
its own, the two at once in two threads that take turns between the engine's iterations (one
decode call or verify step, and what the loop does around it: a few hundred milliseconds), and
its tok/s is read against that AR job's. Each side's serving time leaves out its waits for the
other; the machine's drift lands on both alike. Their caches share the machine's, as two
processes would.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

from specjax import cli, registry, specbench  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("arms", ["none", "prompt_lookup", "suffix"], "The engines, in first-round order: 'none' is "
                  "specjax AR (the first one the baseline, any other a control), else a drafter under --policy.")
flags.DEFINE_integer("rounds", 2, "Runs of every arm (the order rotates each round).")
flags.DEFINE_bool("paired", False, "Serve every arm after the first 'none' beside an AR job of its own, the two in "
                  "lock-step (they take turns iteration by iteration, benchtime.LockStep), and read its tok/s against "
                  "that AR job's; a later 'none' arm is then AR beside AR, the control.")
flags.DEFINE_string("out_dir", "/tmp/specjax_batch_ab", "Each run's output JSONL goes here (emptied first).")
flags.DEFINE_string("json_out", None, "Write every run's figures and the summary as JSON here.")
flags.DEFINE_integer("max_new_tokens", 128, "Maximum tokens to generate per prompt (records may override).")
cli.define_job_flags()
cli.define_model_flags()
cli.define_drafter_flags("prompt_lookup", num_spec_tokens=3, k_buckets="0,1,2,3,4,5")
cli.define_engine_flags(slots=0)
cli.define_request_flags()
cli.define_forward_flags()
cli.define_policy_flags()


def arm_names(arms: list[str]) -> list[str]:
    """Unique labels: a drafter's name, 'ar' for the first 'none', 'ar (control N)' after it."""
    out, seen = [], 0
    for a in arms:
        if a == "none":
            out.append("ar" if not seen else f"ar (control {seen})")
            seen += 1
        else:
            out.append(a)
    return out


def validate() -> dict:
    from specjax.errors import SpecjaxError

    if not FLAGS.input_jsonl:
        raise SpecjaxError("--input_jsonl is required")
    if FLAGS.rounds < 1:
        raise SpecjaxError(f"--rounds must be >= 1, got {FLAGS.rounds}")
    arms = [a.strip() for a in FLAGS.arms if a.strip()]
    if "none" not in arms:
        raise SpecjaxError("--arms needs 'none' (specjax AR, the baseline)")
    dup = {a for a in arms if a != "none" and arms.count(a) > 1}
    if dup:
        raise SpecjaxError(f"--arms lists {', '.join(sorted(dup))} twice (only 'none' may repeat)")
    for a in arms:
        if a != "none" and a not in registry.DRAFTERS:
            raise SpecjaxError(f"unknown drafter {a!r} in --arms")
    cli.request_defaults()
    return {name: cli.engine_spec_from_flags(drafter=a, policy="none" if a == "none" else None)
            for name, a in zip(arm_names(arms), arms)}


def serve_once(spec, model, out_path: str, turn=None) -> dict:
    """One fresh batch job of --input_jsonl into ``out_path``, as launch/batch.py serves it;
    ``turn()``: called where the engine polls should_stop (once per iteration) while records are
    left to write (serve_pair's turns)."""
    from specjax.jobs import Job
    from specjax.serve_job import serve_job

    if spec.slots:
        backend = registry.build_backend(spec, model)
    else:  # KV rows sized from the job's records (serve_job's slot classes), as launch/batch.py
        def backend(slots):
            return registry.build_backend(dataclasses.replace(spec, slots=slots), model)
    policy, label = cli.policy_from_spec(spec, model)
    rep: dict = {}
    with Job(FLAGS.input_jsonl, out_path, cli.request_defaults(), progress=False) as job:
        if turn is not None:
            stop = job.should_stop

            def should_stop():
                if sum(job.written.values()) < len(job.todo):
                    turn()
                return stop()
            job.should_stop = should_stop
        rep["rc"] = serve_job(job, model, backend, policy, label, drafter=spec.drafter.name, chat=FLAGS.chat,
                              system=FLAGS.system, compile_ahead=True, report=rep)
    return rep


def serve_pair(ar_spec, spec, model, paths: tuple[str, str]) -> tuple[dict, dict]:
    """The AR job and ``spec``'s at once, in two threads taking turns between the serving
    engine's iterations (the engine polls should_stop once per iteration; no turns once every
    record is written). Each report's serve_s is its own: its waits for the other taken out
    (the first waits for the other's compilation too); serve_cpu_s is the process's, so None."""
    import threading

    from specjax.benchtime import LockStep

    step, reps, errors = LockStep(), [None, None], []

    def work(i, sp, path):
        try:
            reps[i] = serve_once(sp, model, path, lambda: step.turn(i))
        except BaseException as e:  # (re-raised in the caller's thread)
            errors.append(e)
        finally:
            step.finish(i)

    threads = [threading.Thread(target=work, args=(i, sp, p)) for i, (sp, p) in enumerate(zip((ar_spec, spec), paths))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    for rep, w in zip(reps, step.waited):
        rep.update(serve_s=rep["serve_s"] - w, waited_s=w, serve_cpu_s=None)
    return reps[0], reps[1]


def outputs(path: str) -> dict:
    with open(path) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    return {r["id"]: r.get("output_ids", r.get("error")) for r in recs}


def tok_s(run: dict) -> float:
    return run["tokens"] / run["serve_s"]


def bracketed(runs: list[dict]) -> list[float]:
    """Each run's tok/s over the mean of the AR runs nearest to it in the order they ran, one
    before and one after (either alone at an end; an AR run's own is left out): machine drift
    during a round lands on both sides of the ratio. NaN for a run with no other AR run (the
    only one)."""
    ar = [i for i, r in enumerate(runs) if r["arm"].startswith("ar")]
    out = []
    for i, r in enumerate(runs):
        near = [j for j in (max((j for j in ar if j < i), default=None), min((j for j in ar if j > i), default=None))
                if j is not None]
        out.append(tok_s(r) / (sum(tok_s(runs[j]) for j in near) / len(near)) if near else float("nan"))
    return out


def table(runs: list[dict], names: list[str], rounds: int) -> str:
    by = {(r["arm"], r["round"]): r for r in runs}
    near = {(r["arm"], r["round"]): x for r, x in zip(runs, bracketed(runs))}
    head = ["arm"] + [f"round {i + 1}: tok/s (x AR)" for i in range(rounds)] + [
        "all rounds: tok/s (x AR)", "x the AR runs either side, per round", "CPU ms/token",
        "host ms/token", "mean K",
        "outputs equal AR's"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    tot = {n: tuple(sum(by[n, i][f] for i in range(rounds)) for f in ("tokens", "serve_s", "serve_cpu_s", "host_s"))
           for n in names}
    base = tot["ar"][0] / tot["ar"][1]
    for n in names:
        cells = [n]
        for i in range(rounds):
            r, a = by[n, i], by["ar", i]
            tps, ar_tps = tok_s(r), tok_s(a)
            cells.append(f"{tps:.1f} ({tps / ar_tps:.3f})")
        tk, ts, tc, th = tot[n]
        ks = [by[n, i]["mean_k"] for i in range(rounds) if by[n, i]["mean_k"] is not None]
        eq = [by[n, i]["equal"] for i in range(rounds)]
        cells += [f"{tk / ts:.1f} ({tk / ts / base:.3f})",
                  " / ".join("n/a" if math.isnan(near[n, i]) else f"{near[n, i]:.3f}" for i in range(rounds)),
                  f"{1e3 * tc / tk:.2f}", f"{1e3 * th / tk:.3f}",
                  " / ".join(f"{k:.2f}" for k in ks),
                  " / ".join(f"{e}/{by[n, 0]['records']}" for e in eq)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paired_table(runs: list[dict], names: list[str], rounds: int) -> str:
    """--paired: each arm's tok/s against the AR job served beside it, per round and over all
    rounds (each side's tokens over its summed serving seconds)."""
    by = {(r["arm"], r["round"]): r for r in runs}
    head = ["arm"] + [f"round {i + 1}: tok/s (x the AR beside it)" for i in range(rounds)] + [
        "all rounds: x the AR beside it", "host ms/token (AR beside it)", "mean K", "outputs equal AR's"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in names:
        rs = [by[n, i] for i in range(rounds)]
        cells = [n] + [f"{tok_s(r):.1f} ({tok_s(r) / tok_s(r['partner']):.3f})" for r in rs]
        mine = sum(r["tokens"] for r in rs) / sum(r["serve_s"] for r in rs)
        theirs = sum(r["partner"]["tokens"] for r in rs) / sum(r["partner"]["serve_s"] for r in rs)
        host = 1e3 * sum(r["host_s"] for r in rs) / sum(r["tokens"] for r in rs)
        host_ar = 1e3 * sum(r["partner"]["host_s"] for r in rs) / sum(r["partner"]["tokens"] for r in rs)
        cells += [f"{mine / theirs:.3f}", f"{host:.3f} ({host_ar:.3f})",
                  " / ".join(f"{r['mean_k']:.2f}" for r in rs if r["mean_k"] is not None),
                  " / ".join(f"{r['equal']}/{r['records']}" for r in rs)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv):
    cli.run_job(run, argv)


def run() -> int:
    import gc
    import shutil

    import jax

    specs = validate()
    names = list(specs)
    model, _ = cli.load_target(next(iter(specs.values())))
    specs = {n: sp.resolved(model) for n, sp in specs.items()}
    shutil.rmtree(FLAGS.out_dir, ignore_errors=True)
    os.makedirs(FLAGS.out_dir)
    runs = []

    def path_of(rnd, n, beside=""):
        name = re.sub(r"[^A-Za-z0-9]+", "_", n + (f" beside {beside}" if beside else "")).strip("_")
        return os.path.join(FLAGS.out_dir, f"r{rnd + 1}_{name}.jsonl")

    def check(n, rep, path):
        errors = sum(isinstance(v, str) for v in outputs(path).values())
        if rep["rc"] != 0 or errors:
            print(f"error: the {n} run ended with status {rep['rc']} and {errors} error records (in {path})",
                  file=sys.stderr)
            return rep["rc"] or 1
        return 0

    for rnd in range(FLAGS.rounds):
        for n in specbench.rotated([n for n in names if n != "ar"] if FLAGS.paired else names, rnd):
            print(f"[round {rnd + 1}/{FLAGS.rounds}: {n}{' beside ar' if FLAGS.paired else ''}]", file=sys.stderr,
                  flush=True)
            path = path_of(rnd, n)
            if FLAGS.paired:
                ar_path = path_of(rnd, "ar", beside=n)
                ar_rep, rep = serve_pair(specs["ar"], specs[n], model, (ar_path, path))
                rc = check("ar", ar_rep, ar_path) or check(n, rep, path)
                rep["partner"] = dict(path=ar_path, **ar_rep)
            else:
                rep = serve_once(specs[n], model, path)
                rc = check(n, rep, path)
            # the run's executables go, as with its process: each holds memory maps of its own,
            # which a process runs out of after a few hundred (the next run loads its own from disk)
            jax.clear_caches()
            gc.collect()
            if rc:
                return rc
            runs.append(dict(arm=n, round=rnd, path=path, **rep))
        first_ar = next(r["partner"] if FLAGS.paired else r for r in runs
                        if r["round"] == rnd and (FLAGS.paired or r["arm"] == "ar"))
        ar_out = outputs(first_ar["path"])
        for r in runs:
            if r["round"] == rnd:
                mine = outputs(r["path"])
                r["records"] = len(ar_out)
                r["equal"] = sum(1 for k, v in ar_out.items() if mine.get(k) == v)
    md = (paired_table(runs, [n for n in names if n != "ar"], FLAGS.rounds) if FLAGS.paired
          else table(runs, names, FLAGS.rounds))
    print(f"\n{specbench.cpu_description()}; "
          f"{len(ar_out)} records, batch buckets {FLAGS.batch_buckets}, {FLAGS.rounds} rounds; every run "
          f"compiled ahead and run once before serving (launch/batch.py --compile ahead; its default, lazy, "
          f"compiles beside serving: benchmarks/prefix_cache.sh, benchmarks/cold_compile.sh)\n\n{md}")
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump({"command": "python benchmarks/batch_ab.py " + " ".join(sys.argv[1:]), "runs": runs,
                       "table": md}, f, indent=1)
    return 0


if __name__ == "__main__":
    app.run(main)
