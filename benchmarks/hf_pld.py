#!/usr/bin/env python
"""transformers side of launch/bench.py's peers: its greedy decoding, its prompt-lookup decoding
and its prefill by length (the ``hf_pld`` peer, specjax.peers), on the token ids specjax feeds.

Runs in the transformers peer venv (benchmarks/requirements-hf-peer.txt); specjax never imports
torch. launch/bench.py starts it through ``peers.run_peer`` before its own runs, never concurrently.
The GGUF is dequantized to float32 (benchmarks/hf_baseline.py says what that means for the
comparison), batch 1, ``threads`` torch threads.

Job: ``{"gguf": path, "max_new_tokens": N, "eos_ids": [...], "threads": 2, "modes": ["greedy",
"pld", "prefill"], "prompts": [{"key", "category", "input_ids"}], "prefill_prompts": [[ids], ...],
"reps": 3, "prompt_lookup_num_tokens": 10, "max_matching_ngram_size": null, "omp_wait_policy":
"PASSIVE"}`` (all but ``gguf`` optional; OMP_WAIT_POLICY as the environment has it unless the job
sets it). Modes:

- ``greedy``: hf_baseline.greedy, a KV-cache loop (prefill with logits of the last position only,
  decode timed from its own steps): ``prefill_s``, ``decode_s``, ``wall_s``, ``new_tokens``,
  ``output_ids`` (EOS included), ``stopped_at_eos``. One untimed run of the first prompt first.
- ``pld``: transformers' prompt lookup, ``model.generate(do_sample=False,
  prompt_lookup_num_tokens=..., max_matching_ngram_size=...)`` (its default 2 unless given), timed
  around the whole call (prefill included): ``wall_s``, ``new_tokens``, ``output_ids`` (cut after
  the first EOS); ``pld_equals_greedy``. ``generate`` carries per-step work the loop does not
  (logits processors, stopping criteria), so "PLD speedup" against the loop is a lower bound.
- ``prefill``: per prompt of ``prefill_prompts``, the best of ``reps`` prefills:
  ``prefill`` = [{"tokens", "seconds"}].

Rows have llamacpp_peer.py's layout (specjax.specbench summarizes both alike); ``env`` has the
versions (torch, transformers, gguf, numpy) and settings.
"""
from __future__ import annotations

import os
import sys
import time

from benchmarks.hf_baseline import best_prefill_s, greedy, load, versions  # (run_peer puts the repo on the path)
from specjax.peers import peer_main


def run(job: dict) -> dict:
    if job.get("omp_wait_policy"):
        # (read when torch loads its OpenMP runtime: PASSIVE keeps torch's threads from spinning at
        # barriers, which on a shared machine cost it 5x here when a core was taken)
        os.environ["OMP_WAIT_POLICY"] = job["omp_wait_policy"]
    import torch

    modes = job.get("modes") or ["greedy", "pld"]
    threads = int(job.get("threads", 2))
    model, load_s = load(job["gguf"], threads)
    N = int(job.get("max_new_tokens", 96))
    eos = [int(e) for e in job.get("eos_ids") or []]
    if not eos and model.generation_config.eos_token_id is not None:
        e = model.generation_config.eos_token_id
        eos = [int(x) for x in (e if isinstance(e, list) else [e])]
    pld_kw = {"prompt_lookup_num_tokens": int(job.get("prompt_lookup_num_tokens", 10))}
    if job.get("max_matching_ngram_size"):
        pld_kw["max_matching_ngram_size"] = int(job["max_matching_ngram_size"])
    prompts = job.get("prompts") or []
    pre = job.get("prefill_prompts") or []
    reps = int(job.get("reps", 3))

    def pld(ids, n):
        x = torch.tensor([ids], dtype=torch.long)
        with torch.inference_mode():
            t = time.perf_counter()
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                                 eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0, **pld_kw)
            wall = time.perf_counter() - t
        new = [int(v) for v in out[0, len(ids):].tolist()]
        cut = next((i + 1 for i, v in enumerate(new) if v in eos), len(new))  # (nothing after the first EOS)
        return {"wall_s": wall, "new_tokens": cut, "output_ids": new[:cut]}

    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None

    def bar(items, desc):
        return tqdm(items, desc=desc, unit="prompt", file=sys.stderr, disable=None) if tqdm else items

    rows = {p["key"]: {"key": p["key"], "category": p.get("category"), "prompt_tokens": len(p["input_ids"])}
            for p in prompts}
    warm = {}
    if "greedy" in modes and prompts:
        t = time.perf_counter()
        greedy(model, prompts[0]["input_ids"], min(16, N), set(eos))  # untimed warm-up
        warm["greedy_s"] = time.perf_counter() - t
        for p in bar(prompts, "transformers greedy"):
            rows[p["key"]]["greedy"] = greedy(model, p["input_ids"], N, set(eos))
    if "pld" in modes and prompts:
        t = time.perf_counter()
        pld(prompts[0]["input_ids"], min(16, N))
        warm["pld_s"] = time.perf_counter() - t
        for p in bar(prompts, "transformers prompt lookup"):
            r = rows[p["key"]]
            r["pld"] = pld(p["input_ids"], N)
            if "greedy" in r:
                r["pld_equals_greedy"] = r["pld"]["output_ids"] == r["greedy"]["output_ids"]
    res = {"rows": list(rows.values())}
    if "prefill" in modes and pre:
        greedy(model, pre[0], 1, ())
        res["prefill"] = [{"tokens": len(ids), "seconds": best_prefill_s(model, ids, reps)}
                          for ids in bar(pre, "transformers prefill by length")]
    res["env"] = {**versions(), "threads": torch.get_num_threads(), "dtype": "float32 (GGUF dequantized at load)",
                  "gguf": os.path.abspath(job["gguf"]), "max_new_tokens": N, "eos_ids": eos, "load_s": load_s,
                  "warmup": warm, "modes": modes, **pld_kw,
                  "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset: the OpenMP runtime's default)"),
                  "greedy": "KV-cache loop: base model + lm_head on the last position, argmax",
                  "pld": "model.generate(do_sample=False, prompt_lookup_num_tokens=...)"}
    return res


if __name__ == "__main__":
    sys.exit(peer_main(run))
