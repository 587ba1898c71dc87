"""Cost of one speculative step vs one autoregressive decode step (the verify-cost curve).

  python benchmarks/step_cost.py --context 64,512,1024 --ks 0,1,2,4,8 [--draft_layers 8]
  python benchmarks/step_cost.py --context 256 --ks 1,3,5 --draft_layers 8 --draft_vocab 4096,8192
  python benchmarks/step_cost.py --context 256 --ks 0,1,3,5 --eagle_vocab 4096,49152 --launch_fwd
  python benchmarks/step_cost.py --context 256,1024 --ks 0,3 --eagle_vocab 8192 --eagle_mlp_width 0,6144 --launch_fwd
  python benchmarks/step_cost.py --context 256,1024 --ks 0,1,3 --eagle_vocab 8192 --eagle_layers 1,2 --eagle_copies auto,int8 --launch_fwd
  python benchmarks/step_cost.py --context 256,1024 --ks 0,1,3,6 --medusa --trees --launch_fwd
  python benchmarks/step_cost.py --context 256,1024 --ks 0,1,2,4,8 --launch_fwd --rows_activations float32,int8

For each committed context length and each K, times the engine's compiled chain step (host
drafter, greedy, batch 1; the drafts are random tokens, acceptance does not change the cost) and
the autoregressive ``decode_step`` at the same context, every K and AR in rotated rounds
(specjax.benchtime), and prints ms per call and the ratio.
``--draft_vocab`` adds the same layer-skip draft with reduced-vocabulary heads of those sizes
(drafters.device.reduced_vocab) and prints each device draft's own cost (its step minus the
host-drafter step at the same K: K draft forwards and the draft cache's re-feed).
``--eagle_vocab`` does the same for an EAGLE head (drafters.eagle, random weights: the cost does
not depend on them) with a head over that many target tokens (the model's vocabulary size = no
reduction), at each ``--eagle_mlp_width``, ``--eagle_layers`` and serving-copy mode ``--eagle_copies``; ``--medusa`` adds the shipped Medusa heads (chains: K heads at once) and
``--trees`` the tree step of K nodes (K = the node budget, K = 0 left out) for the host (random
siblings), Medusa's static tree and the shipped EAGLE head's dynamic tree of ``--eagle_tree``
(width x depth), each tree's draft cost against the host tree step's; ``--launch_fwd`` times every table and AR with the launch scripts' forward options as
resolved for this model on this machine (rows kernel, CPU attention, layers as a loop) instead of
XLA's defaults.
A speculative step that accepts ``a`` tokens on average (bonus included) beats AR when
``a > cost(K) / cost(AR)``: the ratio column is that break-even mean accepted length.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Model name, .gguf or HF dir.")
flags.DEFINE_list("context", ["64", "512", "1024"], "Committed context lengths.")
flags.DEFINE_list("ks", ["0", "1", "2", "4", "8"], "K values.")
flags.DEFINE_integer("slots", 2048, "Cache slots.")
flags.DEFINE_integer("draft_layers", 0, "Also time a layer-skip step with this many layers (0 = off).")
flags.DEFINE_list("draft_vocab", [], "Also time the layer-skip draft with reduced heads of these sizes.")
flags.DEFINE_list("eagle_vocab", [], "Also time an EAGLE head with a vocabulary head of each of these sizes.")
flags.DEFINE_list("eagle_mlp_width", ["0"], "--eagle_vocab: each head at each of these MLP widths (0: the target's).")
flags.DEFINE_list("eagle_layers", ["1"], "--eagle_vocab: each head with each of these layer counts.")
flags.DEFINE_list("eagle_copies", ["auto"], "--eagle_vocab: each head's serving copies in each of these activation "
                  "modes (auto: the engine's, as eagle.build serves them; float32, int8, bfloat16).")
flags.DEFINE_bool("medusa", False, "Also time the shipped Medusa heads' chain steps.")
flags.DEFINE_bool("trees", False, "Also time tree steps: the host's, Medusa's static tree and the shipped EAGLE "
                  "head's dynamic tree (--eagle_tree).")
flags.DEFINE_string("eagle_tree", "3x3", "--trees: the EAGLE dynamic tree's width x depth.")
flags.DEFINE_bool("launch_fwd", False, "Time with the launch scripts' forward options for this model "
                  "(EngineSpec's automatic settings resolved) instead of XLA's defaults.")
flags.DEFINE_list("rows_activations", ["auto"], "With --launch_fwd: the rows kernel's activation modes to time "
                  "(auto: the launch scripts' default for this machine; float32, int8, bfloat16), the host steps and "
                  "AR of every mode in the same rotated rounds; each mode's "
                  "extra verified row (the least-squares slope of step ms over K >= 1) is printed after the table. "
                  "The draft tables use the first mode.")
flags.DEFINE_integer("reps", 20, "Timed calls per point (median reported).")
flags.DEFINE_string("json_out", None, "Write the rows as JSON here.")


def main(argv):
    import jax
    import numpy as np

    from specjax import cache as kv
    from specjax.benchtime import interleaved_medians, prefill_fn, steady_step
    from specjax.drafters import eagle, medusa
    from specjax.drafters.device import layer_skip, reduced_vocab
    from specjax.drafters.model_kinds import draft_forward
    from specjax.engine.spec import EngineSpec
    from specjax.engine.table import StepTable
    from specjax.reference_ar import decode_step
    from specjax.models.loader import load_model
    from specjax.models.options import ForwardOptions
    from specjax.sampling import SamplingArrays, SamplingParams

    m = load_model(FLAGS.model)
    cfg = m.cfg
    auto = dict(rows_kernel_auto=True, attention_auto=True, scan_auto=True)  # (the launch flags' defaults)
    modes = FLAGS.rows_activations
    if not set(modes) <= {"auto", "float32", "int8", "bfloat16"} or len(set(modes)) != len(modes) or (
            not FLAGS.launch_fwd and modes not in (["auto"], ["float32"])):
        raise app.UsageError("--rows_activations: distinct auto / float32 / int8 / bfloat16, all but auto and float32 "
                             "with --launch_fwd (the rows kernel)")
    fwds = {mode: EngineSpec(model=FLAGS.model, **auto, rows_activations_auto="" if mode == "float32" else mode).resolved(m).fwd
            if FLAGS.launch_fwd else ForwardOptions() for mode in modes}
    fwd = fwds[modes[0]]
    params = m.params_for(fwd)
    S = FLAGS.slots
    rng = np.random.default_rng(0)
    # (the layer-skip draft on the engine's forward, as --drafter layer_skip runs it)
    drafts = [layer_skip(cfg, params, FLAGS.draft_layers, draft_forward(fwd))] if FLAGS.draft_layers else []
    for n in map(int, FLAGS.draft_vocab):
        # which N tokens does not change the cost: the first N ids stand for the N most frequent
        drafts.append(reduced_vocab(*drafts[0], np.arange(n)))
    for n, width, layers, copies in ((n, w, ly, c) for n in map(int, FLAGS.eagle_vocab)
                                     for w in map(int, FLAGS.eagle_mlp_width) for ly in map(int, FLAGS.eagle_layers)
                                     for c in FLAGS.eagle_copies):
        d, dp = eagle.init_params(cfg, m.params, vocab_ids=np.arange(n), mlp_width=width, layers=layers)
        act = eagle.copies_activations(fwd) if copies == "auto" else copies
        if fwd.rows_kernel:  # (as eagle.build serves it)
            d, dp = dataclasses.replace(d, fwd=eagle.copies_forward(act)), eagle.for_rows_kernel(dp, act)
        label = (f"eagle, {n} tokens" + (f", MLP {width}" if width else "") + (f", {layers} layers" if layers > 1 else "")
                 + (f", copies {act}" if copies != "auto" else ""))
        drafts.append((dataclasses.replace(d, label=label), dp))
    if FLAGS.medusa:
        h = medusa.build(m, tree=False)
        drafts.append((dataclasses.replace(h.draft, label="medusa"), h.params))
    # (name, table, tree step?); the host of each activation mode: "host", or "host int8" after the first
    hosts = {}  # mode -> (params, its host table)
    for mode in modes:
        p = params if mode == modes[0] else m.params_for(fwds[mode])
        hosts[mode] = (p, StepTable(cfg, p, p, fwd=fwds[mode]))
    host_name = {mode: "host" if mode == modes[0] else f"host {mode}" for mode in modes}
    tables = [(host_name[mode], hosts[mode][1], False) for mode in modes] + [
        (d.label, StepTable(cfg, params, dp, d, fwd=fwd), False) for d, dp in drafts]
    if FLAGS.trees:
        w, depth = (int(x) for x in FLAGS.eagle_tree.lower().split("x"))
        trees = [("medusa tree", medusa.build(m)), (f"eagle tree {w}x{depth}",
                                                 eagle.build(m, None, w, depth, eagle.copies_activations(fwd)))]
        tables += [("host tree", StepTable(cfg, params, params, fwd=fwd), True)] + [
            (name, StepTable(cfg, params, h.params, h.draft, fwd=fwd), True) for name, h in trees]
    samp = SamplingArrays.build([SamplingParams()], 1)
    ks = [int(k) for k in FLAGS.ks]

    def ar_step(mode, ctx):
        """The AR decode step of activation mode ``mode`` held at ``ctx`` tokens (the lengths set
        back after each call)."""
        p, table = hosts[mode]
        holder = [prefill_fn(table, 1, ctx, S, rng)().cache]
        tok, act = jax.device_put(np.zeros(1, np.int32)), jax.device_put(np.ones(1, bool))

        def run():
            c, t = decode_step(p, holder[0], tok, act, samp, cfg=cfg, greedy_only=True, fwd=fwds[mode])
            jax.block_until_ready(t)
            holder[0] = kv.set_lengths(c, jax.device_put(np.array([ctx], np.int32)))  # (a new buffer: donated)
        return run

    for mode in modes:
        print(f"{mode}: {fwds[mode]}")
    print(f"{cfg.name}, batch 1, greedy, {S} slots; ms per call (median of {FLAGS.reps} rotated rounds)")
    print("| context | drafter | K | step ms | AR decode ms | step / AR | draft ms |")
    print("|---|---|---|---|---|---|---|")
    rows, slopes = [], []
    for ctx in map(int, FLAGS.context):
        base = {}  # the host's chain and tree steps: each drafter's own cost is its step minus these
        # the hosts of every activation mode, with their AR steps, in one set of rounds
        variants = {(mode, K): steady_step(hosts[mode][1], 1, K, ctx, S, rng) for mode in modes for K in ks}
        variants.update({(mode, "AR"): ar_step(mode, ctx) for mode in modes})
        timed = {host_name[mode]: {} for mode in modes}
        for (mode, k), t in interleaved_medians(variants, FLAGS.reps).items():
            timed[host_name[mode]][k] = 1e3 * t
        for name, table, tree in tables:
            kk = [K for K in ks if K > 0] if tree else ks
            ms = timed.get(name) if not tree else None
            if ms is None:
                ms = {k: 1e3 * t for k, t in interleaved_medians(
                    {K: steady_step(table, 1, K, ctx, S, rng, tree=tree) for K in kk}, FLAGS.reps).items()}
            base.setdefault(tree, ms)
            # a host's ratios are to its own mode's AR step; a draft's to the first mode's
            ar = ms["AR"] if "AR" in ms else base[False]["AR"]
            for K in kk:
                r = {"context": ctx, "drafter": name, "K": K, "tree": tree, "step_ms": ms[K], "ar_ms": ar,
                     "draft_ms": None if name.startswith("host") else ms[K] - base[tree][K]}
                rows.append(r)
                cells = [ctx, name, K, f"{ms[K]:.1f}", f"{ar:.1f}", f"{ms[K] / ar:.2f}",
                         "" if r["draft_ms"] is None else f"{r['draft_ms']:.1f}"]
                print("| " + " | ".join(map(str, cells)) + " |", flush=True)
            if name.startswith("host") and not tree and len([K for K in kk if K >= 1]) >= 2:
                kx = np.array([K for K in kk if K >= 1], float)
                slope = float(np.polyfit(kx, np.array([ms[int(K)] for K in kx]), 1)[0])
                slopes.append(f"{name}, context {ctx}: an extra verified row {slope:.2f} ms (AR {ar:.2f} ms)")
    print("\n".join(slopes))
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    app.run(main)
