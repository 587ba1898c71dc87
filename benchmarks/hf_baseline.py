#!/usr/bin/env python
"""Hugging Face transformers CPU baseline (fp32, greedy) for a GGUF model: the ``hf`` peer
(specjax.peers), run in a venv with torch (CPU), transformers, accelerate, gguf and psutil by
benchmarks/ar_speed.py and benchmarks/prefill_speed.py.

Job ``{"gguf": path, "threads": 2, ...}`` and either

- ``"prompts": [text, ...], "max_new_tokens": N`` (``"chat"``: apply the chat template, default
  true): per prompt ``prefill_s`` / ``prefill_tok_s`` (median wall time of one forward over the
  whole prompt with use_cache=True, like generate's first step), ``total_s`` / ``total_tok_s``
  (``model.generate(do_sample=False, max_new_tokens=N)``, prefill included), ``decode_s`` /
  ``decode_tok_s`` (total_s - prefill_s and (new_tokens - 1) / decode_s: the first new token
  comes out of the prefill forward), ``new_tokens``, ``output_ids`` (new tokens only),
  ``output_text``, ``stopped_at_eos``; aggregates (sums of tokens and times, the tok/s ratios of
  the sums), load times and RSS (``rss_*_mb`` from psutil, ``peak_rss_mb`` from getrusage); or
- ``"prefill_lens": [...], "decode_contexts": [...], "reps": 3``: prefill and decode speed by
  length on random-token prompts (``run_hf_lengths``).
"""
from __future__ import annotations

import os
import sys
import time

from specjax.benchtime import median_seconds
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


def run_hf_greedy(
    gguf_path: str,
    prompts: list[str],
    max_new_tokens: int,
    chat: bool = True,
    num_threads: int = 2,
    prefill_repeats: int = 3,
) -> dict:
    """Greedy-decode each prompt with transformers (fp32, CPU) and time it.

    Returns ``{"rows": [...], "aggregate": {...}, "load": {...}, "env": {...}}``.
    """
    gguf_path = os.path.abspath(gguf_path)
    rss0 = _rss_mb()
    t0 = time.perf_counter()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t_import = time.perf_counter() - t0
    torch.set_num_threads(num_threads)
    d, name = os.path.split(gguf_path)
    rss_before = _rss_mb()
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    model.eval()
    t_model = time.perf_counter() - t0
    rss_after = _rss_mb()
    eos_id = tok.eos_token_id
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else eos_id

    def encode(p: str) -> list[int]:
        # (apply_chat_template's tokenize=True is this; its return type varies by version)
        if chat:
            p = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        return tok.encode(p, add_special_tokens=False)

    def gen(x, n):
        return model.generate(
            x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=n,
            pad_token_id=pad_id,
        )

    def prefill(x):
        return model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=True)

    encoded = [encode(p) for p in prompts]
    t_warm = 0.0
    if encoded:
        t0 = time.perf_counter()
        with torch.inference_mode():
            x = torch.tensor([encoded[0]], dtype=torch.long)
            prefill(x)
            gen(x, min(8, max_new_tokens))
        t_warm = time.perf_counter() - t0

    rows = []
    with torch.inference_mode():
        for p, ids in zip(prompts, encoded):
            x = torch.tensor([ids], dtype=torch.long)
            t_pre = median_seconds(lambda: prefill(x), max(1, prefill_repeats), warmup=0)
            t0 = time.perf_counter()
            out = gen(x, max_new_tokens)
            t_tot = time.perf_counter() - t0
            new = [int(v) for v in out[0, len(ids):].tolist()]
            n_new = len(new)
            t_dec = max(t_tot - t_pre, 1e-9)
            rows.append(
                {
                    "prompt": p,
                    "prompt_tokens": len(ids),
                    "new_tokens": n_new,
                    "prefill_s": t_pre,
                    "prefill_tok_s": len(ids) / t_pre,
                    "total_s": t_tot,
                    "total_tok_s": n_new / t_tot if t_tot > 0 else float("nan"),
                    "decode_s": t_dec,
                    "decode_tok_s": (n_new - 1) / t_dec if n_new > 1 else float("nan"),
                    "stopped_at_eos": bool(n_new < max_new_tokens and new and new[-1] == eos_id),
                    "output_ids": new,
                    "output_text": tok.decode(new, skip_special_tokens=False),
                }
            )

    sum_p = sum(r["prompt_tokens"] for r in rows)
    sum_n = sum(r["new_tokens"] for r in rows)
    sum_pre = sum(r["prefill_s"] for r in rows)
    sum_tot = sum(r["total_s"] for r in rows)
    sum_dec = sum(r["decode_s"] for r in rows)
    agg = {
        "prompts": len(rows),
        "prompt_tokens": sum_p,
        "new_tokens": sum_n,
        "prefill_s": sum_pre,
        "prefill_tok_s": sum_p / sum_pre if sum_pre else float("nan"),
        "total_s": sum_tot,
        "total_tok_s": sum_n / sum_tot if sum_tot else float("nan"),
        "decode_s": sum_dec,
        "decode_tok_s": (sum_n - len(rows)) / sum_dec if sum_dec else float("nan"),
        "peak_rss_mb": _peak_rss_mb(),
        "rss_end_mb": _rss_mb(),
    }
    return {
        "rows": rows,
        "aggregate": agg,
        "load": {
            "import_s": t_import,
            "tokenizer_s": t_tok,
            "model_s": t_model,
            "warmup_s": t_warm,
            "rss_start_mb": rss0,
            "rss_before_load_mb": rss_before,
            "rss_after_load_mb": rss_after,
        },
        "env": {
            "gguf": gguf_path,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "num_threads": num_threads,
            "dtype": "float32",
            "chat": chat,
            "max_new_tokens": max_new_tokens,
            "prefill_repeats": prefill_repeats,
        },
    }


def run_hf_lengths(gguf_path: str, prefill_lens: list[int], decode_contexts: list[int], decode_tokens: int = 32,
                   reps: int = 3, num_threads: int = 2, seed: int = 0) -> dict:
    """Prefill and decode speed by length on random-token prompts (token ids 100..vocab-1):
    ``prefill``: {length: best-of-``reps`` seconds of one forward over the prompt}; ``decode``:
    {context: seconds per decode step, from generate(max_new_tokens=decode_tokens + 1, EOS
    suppressed) minus the prefill, over decode_tokens steps, best of ``reps``}."""
    import numpy as np
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(num_threads)
    d, name = os.path.split(os.path.abspath(gguf_path))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    rng = np.random.default_rng(seed)

    def ids(n):
        return torch.tensor(rng.integers(100, vocab, (1, n)), dtype=torch.long)

    def best(fn):
        return median_seconds(fn, reps, warmup=0, stat=min)

    out = {"prefill": {}, "decode": {}}
    with torch.inference_mode():
        model(input_ids=ids(16), use_cache=True)  # warm-up
        for n in prefill_lens:
            x = ids(n)
            out["prefill"][n] = best(lambda: model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=True))
        for c in decode_contexts:
            x = ids(c)
            pre = best(lambda: model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=True))
            tot = best(lambda: model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                              max_new_tokens=decode_tokens + 1, min_new_tokens=decode_tokens + 1,
                                              pad_token_id=0))
            out["decode"][c] = max(tot - pre, 1e-9) / decode_tokens
    out["env"] = {"torch": torch.__version__, "transformers": transformers.__version__, "num_threads": num_threads}
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
