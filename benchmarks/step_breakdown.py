#!/usr/bin/env python
"""Where a decoding step's time goes on this CPU: the engine's decode calls (batch 1, greedy, the
launch scripts' defaults and flags; K = 0, or a device drafter's fixed-K steps, which run in the
same calls) under jax's profiler, each operation of the compiled decode program timed by the
trace (XLA:CPU's thunk executor records one event per operation) and grouped by what it does:

  projections, per weight (the rows kernel's custom calls, named by their output width and
  weight format), the vocab head, the CPU attention kernel, XLA's fused element-wise work
  (norms, RoPE, SiLU, residuals, sampling), the layer loop itself (the while op's own time),
  and what lies outside the compiled program (host work between calls, dispatch).

  python benchmarks/step_breakdown.py [--new_tokens 96] [--batch 1]
  python benchmarks/step_breakdown.py --drafter eagle --k 1     # a K = 1 EAGLE step: the head's ops
                                                                # are its Q8_0 weights, fc's dot, ...

Times are exclusive (an event's duration less its children's), summed over the run and divided
by the decode steps; shares are of the decode steps' wall time (the run's, less the prompt's
prefill programs). The operations are named from the
program's optimized HLO, which XLA dumps as it compiles (a private cache directory makes the
engine compile instead of loading a cached executable). Ratios, not absolutes, travel between
machines; run it with nothing else on the CPU.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    from specjax import cli

    cli.define_model_flags()
    cli.define_drafter_flags("none")
    cli.define_forward_flags()
    cli.define_engine_flags()
    cli.define_policy_flags()
    flags.DEFINE_integer("k", 0, "Drafts a step verifies (a fixed K; > 0 needs a device --drafter).")
    flags.DEFINE_integer("new_tokens", 96, "Tokens decoded under the profiler (after a warm-up run).")
    flags.DEFINE_integer("batch", 1, "Rows decoding together (each the same prompt).")
    flags.DEFINE_string("prompt", "Write a long story about a dragon and a knight.", "The chat prompt.")
    flags.DEFINE_string("keep_hlo", None, "Copy the decode program's optimized HLO text here (to read what each op "
                        "is).")

_OP = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) custom-call\(.*custom_call_target=\"([^\"]+)\"")
_SHAPE = re.compile(r"\[([\d,]*)\]")
_WEIGHT = re.compile(r"rows kernel, (\w+) weight (\d+) x (\d+)")
_BYTES = {"q4_1": 20 / 32, "q8_0": 34 / 32, "packed": 4.0}  # bytes a weight (GGUF blocks: codes and scales)
_DEF = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = \w+\[([\d,]*)\]")


def custom_calls(dump_dir: str) -> dict[str, str]:
    """{op name: label} of every custom call in the dumped optimized decode programs: the rows
    kernel's by weight format and shape (its activations' width x its output width), the
    attention kernel's as attention."""
    labels = {}
    for path in glob.glob(os.path.join(dump_dir, "*spec_decode*after_optimizations.txt")):
        with open(path) as f:
            lines = f.read().splitlines()
        width = {}  # every instruction's last dimension, by name
        for line in lines:
            d = _DEF.match(line)
            if d:
                dims = d.group(2).split(",")
                width[d.group(1)] = dims[-1] if dims[-1] else "1"
        for line in lines:
            m = _OP.match(line)
            if not m:
                continue
            name, shape, target = m.groups()
            if "attention" in target:
                labels[name] = "attention kernel"
            elif target.startswith("specjax_rows"):
                first = re.search(r"custom-call\(\s*(?:\w+\[[\d,]*\]\S*\s+)?%?([\w.\-]+)", line)
                dims = _SHAPE.search(shape)
                out = dims.group(1).split(",")[-1] if dims else "?"
                labels[name] = (f"rows kernel, {target.replace('specjax_rows_', '')} weight "
                                f"{width.get(first.group(1), '?') if first else '?'} x {out}")
            else:
                labels[name] = f"custom call {target}"
    return labels


def exclusive_times(events: list[dict]) -> dict[str, float]:
    """Each complete event's duration less its children's on the same thread (microseconds),
    summed by name (and the number of events, by name, in ``exclusive_times.calls``)."""
    out: dict[str, float] = collections.defaultdict(float)
    exclusive_times.calls = collections.Counter(e["name"] for e in events)
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        stack: list[list] = []  # [event, children's time]
        for e in evs:
            while stack and stack[-1][0]["ts"] + stack[-1][0].get("dur", 0) <= e["ts"]:
                done = stack.pop()
                out[done[0]["name"]] += done[0].get("dur", 0) - done[1]
            if stack:
                stack[-1][1] += e.get("dur", 0)
            stack.append([e, 0.0])
        for ev, child in stack:
            out[ev["name"]] += ev.get("dur", 0) - child
    return out


def group_of(name: str, labels: dict[str, str]) -> str:
    if name in labels:
        return labels[name]
    if name.startswith("while"):
        return "layer loop (the while op's own time)"
    if "fusion" in name:
        return "XLA fused element-wise ops"
    return "other XLA ops: " + re.sub(r"\.\d+$", "", name)


def main(argv):
    del argv
    cache = tempfile.mkdtemp(prefix="step_breakdown_")
    dump = os.path.join(cache, "hlo")
    home = os.path.join(os.path.expanduser("~"), ".cache", "specjax", "ext")
    if os.path.isdir(home):  # (the built rows kernel: no rebuild)
        shutil.copytree(home, os.path.join(cache, "ext"))
    os.environ["SPECJAX_CACHE_DIR"] = cache
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_as_text"
                               " --xla_dump_hlo_module_re=.*spec_decode.*").strip()
    import jax

    from specjax import cli, registry
    from specjax.goodput import FixedK
    from specjax.sampling import SamplingParams

    spec = cli.engine_spec_from_flags(policy="auto")
    m, spec = cli.load_target(spec)
    g = registry.build_generator(spec, m)
    fwd = spec.fwd
    tok = m.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": FLAGS.prompt}]), add_bos=False)
    prompts, samp = [prompt] * FLAGS.batch, [SamplingParams()] * FLAGS.batch
    kw = {} if spec.drafter.name == "none" else {"num_spec_tokens": FLAGS.k, "policy": FixedK(FLAGS.k)}

    def generate():
        return g.generate(prompts, samp, max_new_tokens=FLAGS.new_tokens, ignore_eos=True, **kw)

    generate()  # (compiles; the dump is written)
    labels = custom_calls(dump)
    trace = os.path.join(cache, "trace")
    jax.profiler.start_trace(trace)
    t0 = time.perf_counter()
    out = generate()
    wall = time.perf_counter() - t0
    jax.profiler.stop_trace()
    tokens = sum(len(r.tokens) for r in out)
    path = sorted(glob.glob(os.path.join(trace, "**", "*.trace.json.gz"), recursive=True))[-1]
    with gzip.open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    module = [str((e.get("args") or {}).get("hlo_module", "")) for e in events]
    decode = [e for e, mod in zip(events, module) if "spec_decode" in mod]
    prefill = sum(exclusive_times([e for e, mod in zip(events, module) if "prefill" in mod]).values())
    groups: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    for name, us in exclusive_times(decode).items():
        groups[group_of(name, labels)] += us
        calls[group_of(name, labels)] += exclusive_times.calls[name]
    steps = len(g.last_engine.steps)  # (the engine's record of its decode steps)
    in_program = sum(groups.values())
    wall -= prefill / 1e6  # (the decode steps' wall time: the prompt's prefill ran alone, before them)
    print(f"{m.cfg.name}, {spec.drafter.name} at K = {FLAGS.k}, batch {FLAGS.batch}, {fwd}; {steps:.0f} decode steps "
          f"({tokens / FLAGS.batch / steps:.2f} tokens a step) in {wall:.2f} s (the prompt's prefill, "
          f"{prefill / 1e6:.2f} s, left out): {wall / steps * 1e3:.2f} ms a step")
    print("| what | calls a step | ms a step | share of the wall time | weight GB/s | GMAC/s |\n"
          "|---|---|---|---|---|---|")
    for name, us in sorted(groups.items(), key=lambda kv: -kv[1]):
        rate = ""
        w = _WEIGHT.match(name)
        if w:
            fmt, k, n = re.sub(r"_(bf16|int8|i8)$", "", w.group(1)), int(w.group(2)), int(w.group(3))
            macs = k * n * calls[name]
            gbs = macs * _BYTES.get(fmt, 4.0) / (us * 1e-6) / 1e9
            rate = f" {gbs:.1f} | {macs * FLAGS.batch / (us * 1e-6) / 1e9:.1f} |"
        print(f"| {name} | {calls[name] / steps:.0f} | {us / steps / 1e3:.3f} | {us / 1e6 / wall:.1%} |"
              + (rate or " | |"))
    print(f"| all of the decode program's operations (thread time) | | {in_program / steps / 1e3:.3f} | "
          f"{in_program / 1e6 / wall:.1%} | | |")
    rest = wall - in_program / 1e6
    print(f"| outside the programs (host work, dispatch; wall less the above) | | {rest / steps * 1e3:.3f} | "
          f"{rest / wall:.1%} | | |")
    if FLAGS.keep_hlo:
        os.makedirs(FLAGS.keep_hlo, exist_ok=True)
        for path in glob.glob(os.path.join(dump, "*spec_decode*after_optimizations.txt")):
            shutil.copy(path, FLAGS.keep_hlo)
    shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    define_flags()
    app.run(main)
