#!/usr/bin/env python
"""Several online drafts on SmolLM2 (seed 003's multi-draft experiment, section 5.2): one stream
that interleaves task types, served with online distillation by one self-draft for everything
(``none``), by a draft per request tag (``tag``: the task the client says), and by a draft per
cluster of a classifier that never sees a tag (``centroid``: online k-means over idf-weighted
hashed token n-grams, distill.routing.CentroidRouter).

  python benchmarks/multi_draft.py --data_dir ../shared/data --plot docs/multi_draft_smollm2.png

Each routing serves the same shuffled stream (``--blocks``, interleaved at random with
``--seed``) on one backend; with several drafts a batch runs one draft and the engine switches
between batches (distill.routing.MultiDraft). Each of n drafts updates after every/n of its own
requests, so each gets as many updates as the single draft does (n times its training). Prints, per task, the
acceptance rate over the task's last ``--tail`` requests, the router's purity (the share of
requests in their cluster's majority task), the wall time and the number of draft switches.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from benchmarks.task_stream import define_stream_flags, online_configs, stream, stream_backend  # noqa: E402
from specjax.goodput.acceptance import AcceptanceCounts  # noqa: E402

FLAGS = flags.FLAGS
define_stream_flags(["gsm8k:200", "humaneval:164", "specbench:200"], draft_layers=8, every=32, steps=2, lr=6e-4)
flags.DEFINE_list("routings", ["none", "tag", "centroid"], "Routings to run, in turn.")
flags.DEFINE_integer("seed", 0, "Shuffle seed.")
flags.DEFINE_integer("tail", 60, "Acceptance over each task's last this many requests.")
flags.DEFINE_string("plot", None, "Write per-task acceptance curves here (PNG).")
flags.DEFINE_string("json_out", None, "Write the numbers here.")


def serve(m, items, routing: str):
    from specjax.distill import train as tr
    from specjax.distill.online import OnlineDistiller
    from specjax.distill.routing import CentroidRouter, MultiDraft, TagRouter
    from specjax.engine.loop import ServingEngine
    from specjax.engine.scheduler import Request
    from specjax.goodput.selector import FixedK

    cfg, tok = m.cfg, m.tokenizer
    tags = sorted({t for t, _ in items})
    n = 1 if routing == "none" else len(tags)
    drafts = [tr.TrainableDraft.of(cfg, m.params, FLAGS.draft_layers) for _ in range(n)]
    be = stream_backend(m, drafts[0])
    reqs = [Request(f"r{i}", tok.encode_chat(text)[-FLAGS.max_prompt:], FLAGS.max_new_tokens, tag=tag)
            for i, (tag, text) in enumerate(items)]
    t0 = time.perf_counter()
    be.warmup(prompt_lens=sorted({len(r.prompt) for r in reqs}))
    compile_s = time.perf_counter() - t0
    tc, oc = online_configs(n)
    ods = [OnlineDistiller(be, FixedK(FLAGS.k), d, tc, oc) for d in drafts]
    finished = []
    if routing == "none":
        od = ods[0]
        od.expect(reqs)
        engine = ServingEngine(be, od.policy, eos_ids=tok.eos_ids, on_finish=lambda o: (finished.append(o),
                                                                                       od.on_finish(o)))
        md = None
    else:
        router = TagRouter(tags) if routing == "tag" else CentroidRouter(n)
        md = MultiDraft(router, ods)
        md.expect(reqs)
        groups = dict(md.of)
        switches = [0]
        activate = md.activate

        def counted(g):
            switches[0] += 1
            return activate(g)

        md.activate = counted
        engine = ServingEngine(be, ods[0].policy, eos_ids=tok.eos_ids, drafts=md,
                               on_finish=lambda o: (finished.append(o), md.on_finish(o)))
    t0 = time.perf_counter()
    engine.run(reqs)
    wall = time.perf_counter() - t0
    out = {"wall_s": wall, "compile_s": compile_s, "updates": [d.updates for d in ods],
           "update_s": sum(d.update_s for d in ods)}
    if md is not None:
        out["switches"] = switches[0]
        out["groups"] = {r.id: groups[r.id] for r in reqs}
    return finished, out


def main(argv):
    del argv
    import numpy as np
    from absl import logging

    from specjax.distill.online import acceptance_curve
    from specjax.models.loader import load_model

    logging.set_verbosity(logging.WARNING)
    items = [(name.rstrip("0123456789"), text) for name, text in stream(FLAGS.data_dir, FLAGS.blocks)]
    np.random.default_rng(FLAGS.seed).shuffle(items)
    m = load_model("smollm2-135m")
    tasks = sorted({t for t, _ in items})
    res = {"blocks": FLAGS.blocks, "tasks": tasks, "runs": {}}
    print(f"{len(items)} requests, tasks {tasks} interleaved at random (seed {FLAGS.seed})")
    print("| routing | drafts | " + " | ".join(f"{t}: last {FLAGS.tail}" for t in tasks)
          + " | all: last 150 | purity | switches | wall s | update s |")
    print("|---|---|" + "---|" * (len(tasks) + 5))
    curves = {}
    for routing in FLAGS.routings:
        fin, info = serve(m, items, routing)
        by_id = {o.id: o for o in fin}
        outs = [by_id[f"r{i}"] for i in range(len(items))]
        row = {}
        for t in tasks:
            mine = [o for o, (tt, _) in zip(outs, items) if tt == t]
            tail = mine[-FLAGS.tail:]
            row[t] = AcceptanceCounts.of_requests(tail).acceptance_rate
            curves[(routing, t)] = acceptance_curve(mine, 50).tolist()
        last = outs[-150:]
        row["all"] = AcceptanceCounts.of_requests(last).acceptance_rate
        purity = None
        if "groups" in info:
            g = np.array([info["groups"][f"r{i}"] for i in range(len(items))])
            lab = np.array([tasks.index(t) for t, _ in items])
            purity = sum(np.bincount(lab[g == c]).max() for c in np.unique(g)) / len(g)
        n = len(info["updates"])
        print(f"| {routing} | {n} | " + " | ".join(f"{row[t]:.3f}" for t in tasks) + f" | {row['all']:.3f} | "
              + (f"{purity:.2f}" if purity is not None else "-") + f" | {info.get('switches', 0)} | "
              f"{info['wall_s']:.0f} | {info['update_s']:.0f} |", flush=True)
        res["runs"][routing] = {"acceptance": row, "purity": purity, **{k: v for k, v in info.items() if k != "groups"}}
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(res | {"curves": {f"{r}|{t}": c for (r, t), c in curves.items()}}, f)
    if FLAGS.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(tasks), figsize=(4 * len(tasks), 3.2), sharey=True)
        for ax, t in zip(np.atleast_1d(axes), tasks):
            for routing in FLAGS.routings:
                c = curves[(routing, t)]
                ax.plot(np.arange(1, len(c) + 1), c, label=routing, lw=1)
            ax.set_title(t)
            ax.set_xlabel(f"{t} request")
        np.atleast_1d(axes)[0].set_ylabel("acceptance, last 50 of the task")
        np.atleast_1d(axes)[0].legend()
        fig.suptitle(f"SmolLM2-135M, {FLAGS.draft_layers}-layer self-drafts, interleaved tasks: one draft vs a "
                     "draft per tag / per cluster")
        fig.tight_layout()
        fig.savefig(FLAGS.plot, dpi=120)
        print(f"plot: {FLAGS.plot}")


if __name__ == "__main__":
    app.run(main)
