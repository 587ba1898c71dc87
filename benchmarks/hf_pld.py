#!/usr/bin/env python
"""HF transformers side of launch/bench.py's peer column: greedy vs prompt-lookup decoding (the
``hf_pld`` peer, specjax.peers).

Runs in a separate venv with torch (CPU), transformers, accelerate and gguf; specjax never
imports torch. launch/bench.py starts it through ``peers.run_peer`` (before its own runs, never
concurrently) with already-tokenized prompts (specjax's chat-template token ids, so both sides
see the same input).

Job: ``{"gguf": path, "max_new_tokens": N, "eos_ids": [...], "threads": 2,
"prompt_lookup_num_tokens": 10, "max_matching_ngram_size": null, "prompts": [{"key", "category",
"input_ids"}]}``.

Per prompt, fp32, batch 1, ``do_sample=False``, stopping at ``eos_ids`` (the ids specjax
stops at):

- HF greedy: ``model.generate(...)``;
- HF PLD: the same with ``prompt_lookup_num_tokens`` (HF's assisted-generation prompt
  lookup; ``max_matching_ngram_size`` left at HF's default 2 unless given).

Wall time is measured around each whole ``generate`` call (prefill included, as in
Spec-Bench). One untimed warm-up of each mode on the first prompt runs first. Result:
``{"rows": [{"key", "category", "prompt_tokens", "greedy": {"new_tokens", "wall_s",
"output_ids"}, "pld": {...}, "pld_equals_greedy"}], "env": {...}}``.
"""
from __future__ import annotations

import os
import sys
import time

from specjax.peers import peer_main


def run(job: dict) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(int(job.get("threads", 2)))
    d, name = os.path.split(os.path.abspath(job["gguf"]))
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    model.eval()
    load_s = time.perf_counter() - t0
    N = int(job["max_new_tokens"])
    eos = [int(e) for e in job.get("eos_ids") or []]
    if not eos and model.generation_config.eos_token_id is not None:
        e = model.generation_config.eos_token_id
        eos = [int(x) for x in (e if isinstance(e, list) else [e])]
    pld_kw = {"prompt_lookup_num_tokens": int(job.get("prompt_lookup_num_tokens", 10))}
    if job.get("max_matching_ngram_size"):
        pld_kw["max_matching_ngram_size"] = int(job["max_matching_ngram_size"])

    def gen(ids, n, **kw):
        x = torch.tensor([ids], dtype=torch.long)
        t = time.perf_counter()
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                             eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0, **kw)
        wall = time.perf_counter() - t
        new = [int(v) for v in out[0, len(ids):].tolist()]
        # HF pads nothing at batch 1, but drop anything after the first EOS to be safe.
        for i, v in enumerate(new):
            if v in eos:
                new = new[: i + 1]
                break
        return {"new_tokens": len(new), "wall_s": wall, "output_ids": new}

    prompts = job["prompts"]
    rows = []
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    with torch.inference_mode():
        warm_s = 0.0
        if prompts:
            t = time.perf_counter()
            gen(prompts[0]["input_ids"], min(16, N))
            gen(prompts[0]["input_ids"], min(16, N), **pld_kw)
            warm_s = time.perf_counter() - t
        it = tqdm(prompts, desc="HF greedy+PLD", unit="prompt", file=sys.stderr, disable=None) if tqdm else prompts
        for p in it:
            g = gen(p["input_ids"], N)
            q = gen(p["input_ids"], N, **pld_kw)
            rows.append({"key": p["key"], "category": p["category"], "prompt_tokens": len(p["input_ids"]),
                         "greedy": g, "pld": q, "pld_equals_greedy": g["output_ids"] == q["output_ids"]})
    res = {"rows": rows,
           "env": {"torch": torch.__version__, "transformers": transformers.__version__,
                   "threads": torch.get_num_threads(), "dtype": "float32", "gguf": job["gguf"],
                   "max_new_tokens": N, "eos_ids": eos, "load_s": load_s, "warmup_s": warm_s, **pld_kw}}
    return res


if __name__ == "__main__":
    sys.exit(peer_main(run))
