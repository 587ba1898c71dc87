"""Host-side speed and memory of SuffixDecoding's suffix trees over a growing cache.

  python benchmarks/suffix_speed.py [--target_tokens 1000000] [--json_out f.json]

Corpus: real text, tokenized with SmolLM2's tokenizer: GSM8K questions and answers,
HumanEval prompts and solutions and Spec-Bench questions from ../shared/data
(--data_dir). To grow the cache past the corpus size, the corpus is cycled and on each
pass 10% of the tokens of every sequence are replaced at random, so later passes repeat
earlier text loosely (as a stream of similar outputs would) but not verbatim.

At each checkpoint of cached tokens it reports, through the same SuffixDrafter API the
generator uses:
- insert: global-tree insertion of whole finished outputs, microseconds per token;
- append: the per-request tree growing one token at a time (per call, Python wrapper
  included), microseconds per token;
- speculate: for 40 requests (held-out perturbed copies of corpus sequences) at every
  position, drafting a tree of up to 16 nodes from both trees
  (propose_tree: global match cursors + both trees' best-first expansion), microseconds
  per draft token and per call;
- memory: live bytes per cached token (node rows, hash slots at the load bound, tokens)
  and allocated bytes per cached token (array capacities), and nodes per token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def load_corpus(data_dir: str, tokenizer) -> list[np.ndarray]:
    texts = []
    with open(os.path.join(data_dir, "gsm8k", "test_shared_200.jsonl"), encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            texts += [r["question"], r["answer"]]
    with open(os.path.join(data_dir, "humaneval", "HumanEval.jsonl"), encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            texts += [r["prompt"] + r["canonical_solution"], r["test"]]
    sb = os.path.join(data_dir, "spec_bench", "question.jsonl")
    if os.path.isfile(sb):
        with open(sb, encoding="utf-8") as f:
            for line in f:
                texts += json.loads(line)["turns"]
    return [np.asarray(tokenizer.encode(t), np.int32) for t in texts if t.strip()]


def perturb(seq: np.ndarray, rng, vocab: int, frac: float = 0.1) -> np.ndarray:
    s = seq.copy()
    m = rng.random(len(s)) < frac
    s[m] = rng.integers(0, vocab, int(m.sum()))
    return s


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data_dir", default=os.path.join(ROOT, "..", "shared", "data"))
    ap.add_argument("--target_tokens", type=int, default=1_000_000)
    ap.add_argument("--checkpoints", default="10000,100000,1000000")
    ap.add_argument("--max_depth", type=int, default=64)
    ap.add_argument("--max_nodes", type=int, default=16)
    ap.add_argument("--json_out", default=None)
    a = ap.parse_args()

    from specjax.drafters.suffix import SuffixConfig, SuffixDrafter
    from specjax.models.loader import load_model

    tok = load_model("smollm2-135m").tokenizer
    corpus = load_corpus(a.data_dir, tok)
    vocab = tok.vocab_size
    n_corpus = sum(len(s) for s in corpus)
    print(f"corpus: {len(corpus)} sequences, {n_corpus} tokens; cycled with 10% token noise per pass", file=sys.stderr)
    rng = np.random.default_rng(0)
    d = SuffixDrafter(SuffixConfig(max_depth=a.max_depth, max_spec=a.max_nodes, max_cached_requests=-1,
                                   max_cached_mb=1e9))
    # Warm the compiled kernels (numba) outside the timings.
    d.add_output([1, 2, 3])
    d.start(0, [1, 2])
    d.propose_tree(0, a.max_nodes)
    d.extend(0, [3])
    d.finish(0)
    d.clear_cache()

    checkpoints = sorted(int(x) for x in a.checkpoints.split(","))
    rows, cached, ins_t, ins_n, i = [], 0, 0.0, 0, 0
    for cp in checkpoints:
        while cached < cp:
            s = corpus[i % len(corpus)]
            s = s if i < len(corpus) else perturb(s, rng, vocab)
            i += 1
            t = time.perf_counter()
            d.add_output(s)
            ins_t += time.perf_counter() - t
            ins_n += len(s)
            cached += len(s)
        g = d.global_trie
        # Speculation and per-token append on held-out perturbed copies (the request's own tree
        # holds its prompt = first 32 tokens, then grows by one true token per step).
        spec_t = app_t = 0.0
        calls = drafted = appended = 0
        for r in range(40):
            s = perturb(corpus[int(rng.integers(len(corpus)))], rng, vocab)
            if len(s) < 48:
                continue
            d.start(1, s[:32].tolist())
            for j in range(32, min(len(s), 32 + 200)):
                t = time.perf_counter()
                parents, toks = d.propose_tree(1, a.max_nodes)[:2]
                spec_t += time.perf_counter() - t
                calls += 1
                drafted += len(toks)
                t = time.perf_counter()
                d.extend(1, [int(s[j])])
                app_t += time.perf_counter() - t
                appended += 1
            d._rows.pop(1)  # drop the request without caching it: the cache size stays at cp
        row = {"cached_tokens": g.num_tokens, "sequences": g.num_sequences,
               "insert_us_per_token": 1e6 * ins_t / ins_n,
               "append_us_per_token": 1e6 * app_t / max(appended, 1),
               "speculate_us_per_call": 1e6 * spec_t / max(calls, 1),
               "speculate_us_per_draft_token": 1e6 * spec_t / max(drafted, 1),
               "draft_tokens_per_call": drafted / max(calls, 1),
               "nodes_per_token": g.num_nodes / g.num_tokens,
               "live_bytes_per_token": g.used_bytes() / g.num_tokens,
               "allocated_bytes_per_token": g.allocated_bytes() / g.num_tokens}
        rows.append(row)
        ins_t, ins_n = 0.0, 0
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), file=sys.stderr)

    hdr = ("| cached tokens | insert µs/token | append µs/token | speculate µs/draft token | speculate µs/call "
           "| draft tokens/call | nodes/token | live B/token | allocated B/token |")
    print(hdr)
    print("|" + "---|" * 9)
    for r in rows:
        print(f"| {r['cached_tokens']:,} | {r['insert_us_per_token']:.2f} | {r['append_us_per_token']:.2f} | "
              f"{r['speculate_us_per_draft_token']:.2f} | {r['speculate_us_per_call']:.1f} | "
              f"{r['draft_tokens_per_call']:.1f} | {r['nodes_per_token']:.2f} | {r['live_bytes_per_token']:.0f} | "
              f"{r['allocated_bytes_per_token']:.0f} |")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"args": vars(a), "corpus_tokens": n_corpus, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
