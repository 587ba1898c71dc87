#!/usr/bin/env python
"""Hugging Face transformers on the CPU for a GGUF model: the ``hf`` peer (specjax.peers), and
the transformers primitives every transformers peer times with (``benchmarks/hf_pld.py`` imports
them). Runs in a venv of its own (benchmarks/requirements-hf-peer.txt); specjax never imports torch.

transformers loads the GGUF with ``gguf_file=``, **dequantizing every weight to float32**: its
matmuls read float32, where llama.cpp reads the file's 4-bit blocks and specjax's rows kernel
reads them too (specjax's float32 math on those blocks equals transformers' up to summation
order; llama.cpp also quantizes activations to 8 bits).

Like for like with specjax and llama.cpp:

- **prefill** (``next_token``): the base model over the prompt, then ``lm_head`` on the last
  position's hidden state only (a plain ``model(...)`` would compute logits at every prompt
  position: about 20% more work on SmolLM2 and a [T, vocab] float32 array written), then the
  greedy argmax; the time to the first token;
- **decode** (``greedy``): a KV-cache loop of its own, one ``next_token`` per step, timed from its
  own steps (not ``generate`` minus a prefill), greedy argmax, stopping at the job's EOS ids;
- ``torch.set_num_threads(threads)`` (2 by default, as the other sides).

Job ``{"gguf": path, "threads": 2, ...}`` and either

- ``"prompts": [text, ...], "max_new_tokens": N`` (``"chat"``: apply the chat template, default
  true; benchmarks/ar_speed.py): per prompt ``prefill_s`` / ``prefill_tok_s``, ``decode_s`` /
  ``decode_tok_s`` ((new_tokens - 1) / decode_s: the first new token comes out of the prefill),
  ``total_s`` / ``total_tok_s``, ``new_tokens``, ``output_ids`` (new tokens only),
  ``output_text``, ``stopped_at_eos``; aggregates (sums of tokens and times, the tok/s ratios of
  the sums), load times and RSS (``rss_*_mb`` from psutil, ``peak_rss_mb`` from getrusage); or
- ``"prefill_lens": [...], "decode_contexts": [...], "reps": 3`` (benchmarks/prefill_speed.py):
  prefill and decode speed by length on random-token prompts (``run_hf_lengths``).
"""
from __future__ import annotations

import os
import sys
import time

from specjax.peers import peer_main


def _rss_mb() -> float:
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except ImportError:  # pragma: no cover
        return float("nan")


def _peak_rss_mb() -> float:
    import resource

    # ru_maxrss is in KiB on Linux (bytes on macOS)
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 2**20 if sys.platform == "darwin" else r / 2**10


def load(gguf_path: str, threads: int):
    """(model, load seconds): the GGUF dequantized to float32, eval mode, ``threads`` torch threads."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    d, name = os.path.split(os.path.abspath(gguf_path))
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    model.eval()
    return model, time.perf_counter() - t0


def versions() -> dict:
    """The peer environment's versions, for the result's ``env`` (and the bench JSON)."""
    from importlib.metadata import version

    import torch

    return {"torch": torch.__version__, "transformers": version("transformers"), "gguf_package": version("gguf"),
            "numpy": version("numpy"), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch_threads": torch.get_num_threads()}


def next_token(model, ids: list, cache) -> int:
    """Feed ``ids`` (after what ``cache`` holds) and return the greedy next token: the base model,
    then ``lm_head`` on the last position only."""
    import torch

    h = model.model(input_ids=torch.tensor([ids], dtype=torch.long), past_key_values=cache,
                    use_cache=True).last_hidden_state
    return int(model.lm_head(h[:, -1]).argmax(-1))


def greedy(model, ids: list, n_new: int, eos) -> dict:
    """Greedy decoding of ``ids`` by a KV-cache loop: ``prefill_s`` (prompt to first token),
    ``decode_s`` (the steps after it), ``wall_s``, ``new_tokens``, ``output_ids`` (EOS included,
    as specjax reports them), ``stopped_at_eos``. An empty ``eos`` decodes exactly ``n_new``."""
    import torch
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        t0 = time.perf_counter()
        tok = next_token(model, ids, cache)
        t1 = time.perf_counter()
        out = [tok]
        while tok not in eos and len(out) < n_new:
            tok = next_token(model, [tok], cache)
            out.append(tok)
        t2 = time.perf_counter()
    return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "wall_s": t2 - t0, "new_tokens": len(out),
            "output_ids": out, "stopped_at_eos": out[-1] in eos}


def best_prefill_s(model, ids: list, reps: int) -> float:
    """The best of ``reps`` prefills (prompt to first token, logits of the last position only)."""
    return min(greedy(model, ids, 1, ())["prefill_s"] for _ in range(max(reps, 1)))


def run_hf_greedy(gguf_path: str, prompts: list[str], max_new_tokens: int, chat: bool = True,
                  num_threads: int = 2) -> dict:
    """Greedy-decode each text prompt (``greedy``) and time it: ``{"rows", "aggregate", "load", "env"}``."""
    gguf_path = os.path.abspath(gguf_path)
    rss0 = _rss_mb()
    t0 = time.perf_counter()
    from transformers import AutoTokenizer

    t_import = time.perf_counter() - t0
    d, name = os.path.split(gguf_path)
    rss_before = _rss_mb()
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    t_tok = time.perf_counter() - t0
    model, t_model = load(gguf_path, num_threads)
    rss_after = _rss_mb()
    eos = {int(tok.eos_token_id)} if tok.eos_token_id is not None else set()

    def encode(p: str) -> list[int]:
        # (apply_chat_template's tokenize=True is this; its return type varies by version)
        if chat:
            p = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        return tok.encode(p, add_special_tokens=False)

    encoded = [encode(p) for p in prompts]
    t_warm = 0.0
    if encoded:
        t0 = time.perf_counter()
        greedy(model, encoded[0], min(8, max_new_tokens), eos)
        t_warm = time.perf_counter() - t0

    rows = []
    for p, ids in zip(prompts, encoded):
        g = greedy(model, ids, max_new_tokens, eos)
        n_new = g["new_tokens"]
        rows.append({"prompt": p, "prompt_tokens": len(ids), "new_tokens": n_new, "prefill_s": g["prefill_s"],
                     "prefill_tok_s": len(ids) / g["prefill_s"], "total_s": g["wall_s"],
                     "total_tok_s": n_new / g["wall_s"], "decode_s": g["decode_s"],
                     "decode_tok_s": (n_new - 1) / g["decode_s"] if n_new > 1 else float("nan"),
                     "stopped_at_eos": g["stopped_at_eos"], "output_ids": g["output_ids"],
                     "output_text": tok.decode(g["output_ids"], skip_special_tokens=False)})

    sum_p = sum(r["prompt_tokens"] for r in rows)
    sum_n = sum(r["new_tokens"] for r in rows)
    sum_pre = sum(r["prefill_s"] for r in rows)
    sum_tot = sum(r["total_s"] for r in rows)
    sum_dec = sum(r["decode_s"] for r in rows)
    nan = float("nan")
    agg = {"prompts": len(rows), "prompt_tokens": sum_p, "new_tokens": sum_n, "prefill_s": sum_pre,
           "prefill_tok_s": sum_p / sum_pre if sum_pre else nan, "total_s": sum_tot,
           "total_tok_s": sum_n / sum_tot if sum_tot else nan, "decode_s": sum_dec,
           "decode_tok_s": (sum_n - len(rows)) / sum_dec if sum_dec else nan,
           "peak_rss_mb": _peak_rss_mb(), "rss_end_mb": _rss_mb()}
    return {"rows": rows, "aggregate": agg,
            "load": {"import_s": t_import, "tokenizer_s": t_tok, "model_s": t_model, "warmup_s": t_warm,
                     "rss_start_mb": rss0, "rss_before_load_mb": rss_before, "rss_after_load_mb": rss_after},
            "env": {**versions(), "gguf_file": gguf_path, "num_threads": num_threads, "dtype": "float32",
                    "chat": chat, "max_new_tokens": max_new_tokens}}


def run_hf_lengths(gguf_path: str, prefill_lens: list[int], decode_contexts: list[int], decode_tokens: int = 32,
                   reps: int = 3, num_threads: int = 2, seed: int = 0) -> dict:
    """Prefill and decode speed by length on random-token prompts (token ids 100..vocab-1):
    ``prefill``: {length: best-of-``reps`` seconds to the first token}; ``decode``: {context:
    seconds per decode step over ``decode_tokens`` steps after a prompt of that length (EOS not
    checked), best of ``reps``}."""
    import numpy as np

    model, _ = load(gguf_path, num_threads)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(seed)

    def ids(n):
        return [int(x) for x in rng.integers(100, vocab, n)]

    out = {"prefill": {}, "decode": {}}
    greedy(model, ids(16), 2, ())  # warm-up
    for n in prefill_lens:
        out["prefill"][n] = best_prefill_s(model, ids(n), reps)
    for c in decode_contexts:
        x = ids(c)
        out["decode"][c] = min(greedy(model, x, decode_tokens + 1, ())["decode_s"] for _ in range(max(reps, 1))
                               ) / decode_tokens
    out["env"] = {**versions(), "num_threads": num_threads}
    return out


def run(job: dict) -> dict:
    threads = int(job.get("threads", 2))
    if "prefill_lens" in job:
        return run_hf_lengths(job["gguf"], job["prefill_lens"], job.get("decode_contexts", []),
                              int(job.get("decode_tokens", 32)), int(job.get("reps", 3)), threads)
    return run_hf_greedy(job["gguf"], job["prompts"], int(job["max_new_tokens"]), chat=job.get("chat", True),
                         num_threads=threads)


if __name__ == "__main__":
    sys.exit(peer_main(run))
