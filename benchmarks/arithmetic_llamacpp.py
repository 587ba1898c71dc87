"""llama.cpp's own logits on the token ids benchmarks/arithmetic.py scores (run in the llama.cpp
peer's venv, benchmarks/requirements-llamacpp-peer.txt; specjax is not imported), for its KL and
top-1 row: every position of each sequence evaluated in one ``eval`` with ``logits_all``.

  python benchmarks/arithmetic.py --tokens_out ids.json ...          # specjax's venv
  /work/llamacpp-venv/bin/python benchmarks/arithmetic_llamacpp.py --gguf FILE --tokens ids.json --out lc.npz
  python benchmarks/arithmetic.py --llamacpp_logits lc.npz ...       # the same flags as the first run
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    from llama_cpp import Llama

    with open(a.tokens) as f:
        seqs = json.load(f)["sequences"]
    n_ctx = max(len(s) for s in seqs) + 8
    llm = Llama(a.gguf, n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, n_threads=a.threads,
                n_threads_batch=a.threads, verbose=False)
    out = {}
    for i, s in enumerate(seqs):
        llm.reset()
        llm.eval(s)
        out[f"s{i}"] = np.array(llm.scores[:len(s)], np.float32)  # a copy: llm.scores is reused by the next eval
    np.savez(a.out, **out)


if __name__ == "__main__":
    main()
