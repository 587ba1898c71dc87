"""Request streams and the bookkeeping of a serving sweep (launch/serve_sim.py): Spec-Bench
prompts, Poisson arrivals, the order policies run in, each run's summary row, the real runs
an earlier sweep saved (to re-simulate them); and the calibration burst launch/profile.py serves."""

from __future__ import annotations

import json
import os
import sys

from specjax.errors import SpecjaxError

# Stated assumptions for the simulated large-model sweeps (no GPU profile available): one A100-80G
# class device per 7B (2 TB/s HBM, ~150 TFLOP/s achieved bf16) and 8 of them (tensor parallel)
# for 70B. delta = weight bytes / bandwidth + launch/comm overhead; gamma = 2 * params FLOP per
# token / achieved FLOP/s; alpha = KV bytes per context token / bandwidth.
SCALES = {
    "7b": dict(
        target=dict(alpha=0.26e-6, gamma=0.09e-3, delta=8.0e-3),  # 14 GB weights, 0.5 MB KV/token
        draft=dict(alpha=0.01e-6, gamma=0.004e-3, delta=1.5e-3),  # Llama-160M: launch-bound
        prefill=dict(alpha=0.0, gamma=0.1e-3, delta=8.0e-3),
        rows=64, slots=2048, desc="Vicuna-7B on 1 A100 + Llama-160M draft"),
    "70b": dict(
        target=dict(alpha=0.02e-6, gamma=0.12e-3, delta=14.0e-3),  # 140 GB over 8 GPUs + all-reduce
        draft=dict(alpha=0.03e-6, gamma=0.02e-3, delta=3.0e-3),  # TinyLlama-1.1B, TP 1
        prefill=dict(alpha=0.0, gamma=0.12e-3, delta=14.0e-3),
        rows=64, slots=2048, desc="Llama2-70B on 8 A100 (TP8) + TinyLlama-1.1B draft"),
}


def load_prompts(path: str, tok, max_tokens: int, root: str = ".") -> list[list[int]]:
    """First turns of Spec-Bench questions, chat-templated (raw text for a model without a chat
    template), at most ``max_tokens`` long (a relative
    ``path``: relative to ``root``)."""
    path = path if os.path.isabs(path) else os.path.join(root, path)
    if not os.path.exists(path):
        raise SpecjaxError(f"--question_file {path} not found")
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                q = json.loads(line)
                ids = tok.encode_chat(q["turns"][0]) if tok.chat_template else tok.encode(q["turns"][0])
                if len(ids) <= max_tokens:
                    out.append(ids)
    if not out:
        raise SpecjaxError(f"no prompt in {path} fits --max_prompt_tokens {max_tokens}")
    return out


def make_requests(prompts, n: int, rate: float | None, max_new: int, ignore_eos: bool, seed: int):
    """n requests cycling through a shuffled prompt list; Poisson arrivals at ``rate`` (None: all at 0)."""
    import numpy as np

    from specjax.engine.scheduler import Request

    rng = np.random.default_rng(seed)
    order = rng.permutation(len(prompts))
    gaps = rng.exponential(1.0 / rate, size=n) if rate else np.zeros(n)
    t = np.cumsum(gaps) - (gaps[0] if rate else 0.0)  # the first request arrives at 0
    return [Request(f"r{i}", prompts[order[i % len(order)]], max_new, arrival=float(t[i]), ignore_eos=ignore_eos)
            for i in range(n)]


def policy_label(name: str) -> str:
    from specjax.engine.spec import PolicySpec

    return PolicySpec(name).label


def rotated(policies, rep: int):
    """Round ``rep`` runs the policies in a rotated order, so no policy is always the first run
    after a pause or always the one that meets a slow stretch of a shared machine."""
    i = rep % len(policies)
    return list(policies[i:]) + list(policies[:i])


def run_summary(eng, outs) -> dict:
    """summarize() plus how busy the engine was: busy = step iterations + prefills; utilisation
    = busy / (last finish - first arrival). Near 1 the queue is saturated."""
    from specjax.engine.loop import summarize

    s = summarize(outs, eng.steps)
    busy = sum(st.wall for st in eng.steps) + eng.prefill_s
    span = max((o.finished for o in outs if o.finished is not None), default=0.0)
    s.update(busy_s=busy, span_s=span, utilization=busy / span if span > 0 else float("nan"))
    return s


def log_row(r) -> None:
    """One run's row on stderr, as it finishes."""
    print(f"  {r['mode']:4s} {r['drafter']:14s} rate {r['rate']:5.2f} #{r.get('repeat', 0)} {r['policy']:9s} "
          f"latency {r['mean_latency_s']:7.2f} s  batch {r['mean_batch']:4.1f}  K {r['mean_k']:4.2f}  "
          f"acc {r['acceptance_rate']:.2f}  tok/s {r['throughput_tok_s']:6.1f}  busy {r['utilization']:.2f}  "
          f"errors {r['errors']}", file=sys.stderr)


def load_replay(path, drafter, rates, policies, repeats: int):
    """The real runs of an earlier ``--out_json`` (same prompts, rates, seeds, repeats): their rows,
    output lengths and measured acceptance, so the simulator can be re-run against them."""
    from specjax.simulate import AcceptanceProfile

    try:
        with open(path) as f:
            data = json.load(f)
        real = [r for r in data["runs"] if r["mode"] == "real" and r["drafter"] == drafter]
        acc = data["acceptance"][drafter]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SpecjaxError(f"--replay_json {path}: no real runs / acceptance for {drafter!r} ({e})") from None
    lens = {(r["rate"], r["repeat"]): r["out_lens"] for r in real if r["policy"] == policy_label(policies[0])}
    missing = [(x, rep) for x in rates for rep in range(repeats) if (x, rep) not in lens]
    if missing:
        raise SpecjaxError(f"--replay_json {path} has no real {policy_label(policies[0])} run for (rate, repeat) "
                           f"{missing[0]}; use the rates, repeats and policies of the run that wrote it")
    prof = AcceptanceProfile(per_position=tuple(acc["per_position"]), propose_prob=acc["propose_prob"],
                             draft_len_cap=acc.get("draft_len_cap"),
                             draft_len_dist=tuple(acc["draft_len_dist"]) if acc.get("draft_len_dist") else None,
                             **_tree_fields(acc))
    return [r for r in real if r["rate"] in rates], lens, prof


def _tree_fields(acc: dict) -> dict:
    paths = acc.get("tree_paths")
    if not paths:
        return {}
    return dict(tree_paths=tuple(tuple(p) for p in paths), tree_nodes=int(acc["tree_nodes"]),
                tree_forwards=int(acc.get("tree_forwards", 0)))  # (files written before it: 0, one per node)


def load_tree_paths(arg: str) -> dict:
    """``FILE:DRAFTER``: the accepted tree paths a serve_sim ``--out_json`` measured for a device
    tree drafter, as AcceptanceProfile fields (a simulated scale's head trees)."""
    path, _, drafter = arg.rpartition(":")
    try:
        with open(path) as f:
            fields = _tree_fields(json.load(f)["acceptance"][drafter])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SpecjaxError(f"--sim_tree_paths {arg}: no measured acceptance for {drafter!r} ({e})") from None
    if not fields:
        raise SpecjaxError(f"--sim_tree_paths {arg}: {drafter!r} verified no device trees in that run")
    return fields


CALIBRATION_PROMPTS = [
    "Repeat this list exactly, one item per line: apples, pears, plums, cherries, grapes, lemons.",
    "Rewrite in the passive voice: The committee approved the budget. The mayor signed the law.",
    "Explain what a hash table is in two sentences.",
    "Write a Python function that returns the squares of a list of numbers.",
    "Summarise: The river rose overnight after heavy rain, and the town closed two bridges as a precaution.",
    "Translate to French: Good morning. How are you today? I am fine, thank you.",
    "List five prime numbers and say why each is prime.",
    "Fix the grammar: me and him goes to the store yesterday and buyed three apple.",
]


def calibration_requests(tok, n: int, max_new: int) -> list:
    """A burst of n requests whose lengths cycle through max_new x (1/4, 1/2, 3/4, 1): rows free
    up at different steps, so the batch runs full, then drains through every size (the host
    overhead per request is only identifiable across batch sizes)."""
    from specjax.engine.scheduler import Request

    try:
        prompts = [tok.encode_chat(p) for p in CALIBRATION_PROMPTS]
    except SpecjaxError:  # no chat template (e.g. the byte-level test tokenizer)
        prompts = [tok.encode(p) for p in CALIBRATION_PROMPTS]
    return [Request(f"cal{i}", prompts[i % len(prompts)], max(1, max_new * (i % 4 + 1) // 4), ignore_eos=True)
            for i in range(n)]
