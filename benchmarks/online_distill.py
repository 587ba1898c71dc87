#!/usr/bin/env python
"""Online speculative decoding on SmolLM2 (seed 003's stream experiment): a stream of prompts in
task blocks served by the engine with a self-draft (the target's first --draft_layers layers and
exit norm, own copies) that trains online from the steps' teacher signal (distill.online).

  python benchmarks/online_distill.py --data_dir ../shared/data --plot /tmp/b/online.png

Blocks, in order (the distribution shifts at each boundary): GSM8K train, HumanEval, Spec-Bench
first turns, GSM8K train again (other questions). Prints the moving acceptance rate over the last
--window requests at block boundaries and at the end, the update overhead (training and swap
seconds over the run's wall time), and writes a plot of the curve with the boundaries marked.
A second pass with --baseline serves the same stream with the untrained draft (no updates).
``--drafter eagle`` / ``medusa``: the shipped head refined while serving (distill.head_online)
against the same head frozen ("untrained" in the output: not refined).

--checkpoint_dir keeps orbax checkpoints of the online draft there (every --checkpoint_every
updates and at the end: launch/bench.py --distilled_draft evaluates it). --kill_at N stops
the online run after N finished requests (as a kill would: requests in flight are lost and
served again), then serves the rest with a fresh backend and a fresh draft resumed from the
latest checkpoint (the replay buffer starts empty, as after a real restart): the curve shows
whether acceptance continues where it was.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from benchmarks.task_stream import define_stream_flags, online_configs, stream, stream_backend  # noqa: E402
from specjax import registry  # noqa: E402

FLAGS = flags.FLAGS
define_stream_flags(["gsm8k:300", "humaneval:164", "specbench:300", "gsm8k2:236"], draft_layers=4, every=16, steps=4,
                    lr=1e-4)
flags.DEFINE_enum("drafter", "layer_skip", ["layer_skip", *registry.HEAD_DRAFTERS], "The draft trained online: the "
                  "self-draft, or a feature head (the shipped one, refined by distill.head_online; no checkpoints).")
flags.DEFINE_integer("window", 50, "Requests in the moving acceptance rate.")
flags.DEFINE_bool("baseline", True, "Also serve the stream with the untrained draft.")
flags.DEFINE_bool("online", True, "Serve the stream with online distillation (--noonline: the baseline alone).")
flags.DEFINE_string("checkpoint_dir", None, "Checkpoint the online draft here (needed by --kill_at).")
flags.DEFINE_integer("checkpoint_every", 1, "Updates between checkpoints.")
flags.DEFINE_integer("kill_at", 0, "Stop after this many finished requests and resume from the checkpoint (0: no).")
flags.DEFINE_string("reference_json", None, "Also plot the online curve of this earlier --json_out (and print the "
                    "difference after --kill_at).")
flags.DEFINE_string("reference_label", "uninterrupted", "What the --reference_json run was.")
flags.DEFINE_string("replot", None, "Plot (and compare) this earlier --json_out instead of serving.")
flags.DEFINE_string("plot", None, "Write the acceptance plot here (PNG).")
flags.DEFINE_string("json_out", None, "Write the curves and numbers here.")


def refines_head() -> bool:
    """--drafter is a feature head (refined in place), not the self-draft (checkpointed)."""
    return registry.entry(FLAGS.drafter).head_kind() is not None


def serve(m, texts, train: bool):
    from tqdm import tqdm

    from specjax.distill import train as tr
    from specjax.distill.checkpoint import open_draft
    from specjax.distill.online import OnlineDistiller
    from specjax.engine.loop import ServingEngine
    from specjax.engine.scheduler import Request
    from specjax.goodput.selector import FixedK

    cfg, tok = m.cfg, m.tokenizer
    prompts = [tok.encode_chat(t)[-FLAGS.max_prompt:] for _, t in texts]
    tc, oc = online_configs(checkpoint_every=FLAGS.checkpoint_every if FLAGS.checkpoint_dir else 0)
    compile_s = 0.0

    def start():
        """A backend, policy and distiller as a fresh process builds them (resumed when there is a checkpoint)."""
        nonlocal compile_s
        if refines_head():  # as a batch job's --online_distill does
            from specjax.distill.head_online import HeadRefiner

            be = registry.make_backend(m, FLAGS.drafter, k_buckets=(0, FLAGS.k), batch_buckets=(4,), slots=512)
            t0 = time.perf_counter()
            be.warmup(prompt_lens=sorted({len(p) for p in prompts}))
            compile_s += time.perf_counter() - t0
            pol = FixedK(FLAGS.k)
            return be, pol, HeadRefiner(be, pol, cfg, m.params, tc, oc) if train else None
        if train and FLAGS.checkpoint_dir:
            sd, ck = open_draft(FLAGS.checkpoint_dir, cfg, m.params, FLAGS.draft_layers)
        else:
            sd, ck = tr.TrainableDraft.of(cfg, m.params, FLAGS.draft_layers), None
        be = stream_backend(m, sd)
        t0 = time.perf_counter()
        be.warmup(prompt_lens=sorted({len(p) for p in prompts}))
        compile_s += time.perf_counter() - t0
        pol = FixedK(FLAGS.k)
        od = OnlineDistiller(be, pol, sd, tc, oc, checkpoints=ck) if train else None
        if od is not None and od.resume() is not None:
            print(f"\nresumed from checkpoint {ck.latest_step()}: update {od.updates}, {od.finished} requests seen")
        return be, pol, od

    reqs = [Request(f"r{i}", p, FLAGS.max_new_tokens) for i, p in enumerate(prompts)]
    finished, wall, update_s = [], 0.0, 0.0
    bar = tqdm(total=len(reqs), desc="online distill" if train else "untrained draft", unit="req", disable=None)
    kill_at = FLAGS.kill_at if train else 0
    while len(finished) < len(reqs):
        be, pol, od = start()
        todo = [r for r in reqs if r.id not in {o.id for o in finished}]
        stop_at = kill_at if kill_at and len(finished) < kill_at else None

        def done(o, od=od):
            finished.append(o)
            bar.update(1)
            if od is not None:
                od.on_finish(o)

        if od is not None:
            od.expect(todo)
        t0 = time.perf_counter()
        ServingEngine(be, pol, eos_ids=tok.eos_ids, on_finish=done,
                      should_stop=None if stop_at is None else (lambda: len(finished) >= stop_at)).run(todo)
        wall += time.perf_counter() - t0
        if od is not None:
            update_s += od.update_s
            od.update_s = update_s
            if stop_at is None and not refines_head():  # (a killed process saves nothing more)
                od.save()
        if stop_at is not None:
            print(f"\nkilled after {len(finished)} requests (update {od.updates}; its buffer of "
                  f"{len(od.buffer)} records is lost with the process)")
    bar.close()
    return finished, wall, compile_s, od


def main(argv):
    del argv
    from absl import logging

    logging.set_verbosity(logging.WARNING)  # (orbax logs every save at INFO)
    import numpy as np

    from specjax.distill.online import acceptance_curve
    from specjax.models.loader import load_model

    if FLAGS.replot:
        with open(FLAGS.replot) as f:
            res = json.load(f)
        bounds = res["bounds"]
        return _plot(res, bounds, np)
    if refines_head() and (FLAGS.kill_at or FLAGS.checkpoint_dir):
        raise SystemExit("error: --kill_at / --checkpoint_dir are for the self-draft's checkpoints")
    texts = stream(FLAGS.data_dir, FLAGS.blocks)
    m = load_model("smollm2-135m")
    runs = {"online": serve(m, texts, True)} if FLAGS.online else {}
    if FLAGS.baseline:
        runs["untrained"] = serve(m, texts, False)
    index = {f"r{i}": i for i in range(len(texts))}
    bounds, acc = [], 0
    for b in FLAGS.blocks:
        acc += int(b.split(":")[1])
        bounds.append(acc)
    res = {"blocks": FLAGS.blocks, "bounds": bounds}
    for name, (fin, wall, compile_s, od) in runs.items():
        # the curve in submission order (the stream's order), not the engine's finishing order
        outs = sorted(fin, key=lambda o: index[o.id])
        curve = acceptance_curve(outs, FLAGS.window)
        res[name] = {"curve": curve.tolist(), "wall_s": wall, "compile_s": compile_s,
                     "tokens": int(sum(len(o.tokens) for o in outs))}
        if od is not None:
            res[name].update(updates=od.updates, dropped=od.dropped, update_s=od.update_s, losses=od.losses)
        print(f"\n{name}: {len(outs)} requests in {wall:.0f} s (compile {compile_s:.0f} s excluded)"
              + (f"; {od.updates} updates ({od.dropped} dropped), {od.update_s:.0f} s of them = "
                 f"{100 * od.update_s / wall:.1f}% of the wall time" if od is not None else ""))
        at = sorted({min(FLAGS.window, len(outs)) - 1} | {b - 1 for b in bounds})
        print(f"moving acceptance over the last {FLAGS.window} requests at request " +
              ", ".join(f"{i + 1}: {curve[i]:.3f}" for i in at))
    if "untrained" in res and "online" in res:
        on, base = np.array(res["online"]["curve"]), np.array(res["untrained"]["curve"])
        print("online - untrained, at the same requests: " +
              ", ".join(f"{i + 1}: {on[i] - base[i]:+.3f}" for i in [b - 1 for b in bounds]))
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(res, f)
    _plot(res, bounds, np)


def _plot(res, bounds, np) -> None:
    if FLAGS.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 3.5))
        if FLAGS.reference_json:  # a run to compare with (say the uninterrupted one beside a --kill_at run)
            with open(FLAGS.reference_json) as f:
                ref = np.array(json.load(f)["online"]["curve"])
            ax.plot(np.arange(1, len(ref) + 1), ref, label=f"online, {FLAGS.reference_label}", lw=1)
            if "online" in res:
                d = np.abs(np.array(res["online"]["curve"]) - ref)[FLAGS.kill_at:]
                print(f"|online - {FLAGS.reference_label}| from request {FLAGS.kill_at + 1}: mean {d.mean():.3f}, "
                      f"max {d.max():.3f}")
        if FLAGS.kill_at:
            ax.axvline(FLAGS.kill_at, color="red", ls=":")
            ax.text(FLAGS.kill_at, 0.9 * ax.get_ylim()[1], " kill", color="red", fontsize=8)
        for name in ("online", "untrained"):
            if name in res:
                shown = "frozen head" if name == "untrained" and refines_head() else name
                label = shown + (f", killed at {FLAGS.kill_at} and resumed" if name == "online" and FLAGS.kill_at
                                else "")
                ax.plot(np.arange(1, len(res[name]["curve"]) + 1), res[name]["curve"], label=label, lw=1,
                        ls="--" if FLAGS.reference_json else "-")
        for b, name in zip(bounds[:-1], FLAGS.blocks[1:]):
            ax.axvline(b, color="grey", ls=":")
            ax.text(b, 0.02, name.split(":")[0], rotation=90, fontsize=7, va="bottom")
        ax.set_xlabel("request")
        ax.set_ylabel(f"acceptance, last {FLAGS.window}")
        ax.set_title(f"SmolLM2-135M, the shipped {FLAGS.drafter} head, K={FLAGS.k}" if refines_head()
                     else f"SmolLM2-135M, {FLAGS.draft_layers}-layer self-draft, K={FLAGS.k}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(FLAGS.plot, dpi=120)
        print(f"plot: {FLAGS.plot}")


if __name__ == "__main__":
    app.run(main)
