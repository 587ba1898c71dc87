"""Online adaptation of SuffixDecoding on a stream that switches task type (exact greedy replay).

  python benchmarks/suffix_stream.py --run /tmp/bench/specbench.json:../shared/data/spec_bench/question.jsonl \
      --run /tmp/rep_bench.json:/tmp/repetitive.jsonl --plot stream.png --json_out stream.json

Each --run is BENCH_JSON:QUESTION_FILE, a launch/bench.py result (its AR outputs, in the
order they ran) and the question file it ran on (to rebuild the prompts exactly: same
chat template). The runs are concatenated into one request stream whose task type
(category) switches block by block.

Why a replay is exact: with greedy decoding the target's tokens are the AR output, and a
draft step accepts exactly the longest draft path that agrees with them. So replaying
each request against its AR output (draft with the real drafter, accept the longest
matching path, append the accepted tokens plus the target's next one) gives the same
accepted tokens per step as the engine, without running the model; --check_bench
compares the replayed mean accepted tokens with the ones the bench measured.

Reported per request and per block (task): mean accepted tokens per step for
- suffix: global tree (outputs of earlier requests, inserted as each finishes) + the
  request's own tree;
- suffix, local only: the request's own tree (what the stream's history adds is the gap);
- prompt lookup (K = --pld_max_draft).
A plot shows all three over the stream with the task switches marked.

--pld_by_ngram instead replays prompt lookup at every position of each AR output (history = the
chat-templated prompt + the output so far, K = --k drafts per proposal) and prints, by the
n-gram length of its match (the draft class the goodput policy learns alpha for), the share of
proposals whose first j drafts are accepted (up to the first draft that differs from the output):

  python benchmarks/suffix_stream.py --run /tmp/b/host8.json:../shared/data/spec_bench/question.jsonl \
      --pld_by_ngram --k 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def accepted_len(parents, tokens, truth) -> int:
    """Longest root path of the draft tree that equals truth[0:] (parents come before children)."""
    best, depth = 0, {}  # depth of every node whose whole path matches
    for i, (p, t) in enumerate(zip(parents, tokens)):
        p = int(p)
        d = 1 if p < 0 else (depth[p] + 1 if p in depth else 0)
        if d and d <= len(truth) and int(t) == truth[d - 1]:
            depth[i] = d
            best = max(best, d)
    return best


def replay(drafter, prompt, out, k, tree=True):
    """(steps, accepted) of one greedy request; out[0] comes from prefill."""
    drafter.start(0, prompt)
    drafter.extend(0, out[:1])
    pos, steps, acc = 1, 0, 0
    while pos < len(out):
        if tree:
            parents, toks = drafter.propose_tree(0, k)[:2]
        else:
            toks = drafter.propose(0, k)
            parents = np.arange(-1, len(toks) - 1)
        n = accepted_len(parents, toks, out[pos:])
        emit = min(n + 1, len(out) - pos)
        drafter.extend(0, out[pos:pos + emit])
        pos += emit
        steps += 1
        acc += n
    drafter.finish(0)
    return steps, acc


def load_run(spec: str, tok, system=None):
    bench_json, qfile = spec.split(":", 1)
    rows = json.load(open(bench_json))["prompts"]
    texts = {}
    with open(qfile, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                r = json.loads(line)
                texts[f"{r['category']}/{r.get('question_id', i)}"] = r["turns"][0]
    out = []
    for r in rows:
        out.append({"key": r["key"], "category": r["category"], "prompt": tok.encode_chat(texts[r["key"]], system),
                    "output": r["ar"]["output_ids"], "bench": {d: v.get("mean_accepted_tokens") for d, v in r.items()
                                                               if isinstance(v, dict) and "mean_accepted_tokens" in v}})
    return out


def pld_by_ngram(stream, k: int, min_ngram: int, max_ngram: int) -> dict:
    """{n-gram length: [proposals, proposals with >= 1 draft accepted, ..., with all k]}."""
    from specjax.drafters.prompt_lookup import PromptLookupConfig, PromptLookupDrafter

    cfg = PromptLookupConfig(max_ngram=max_ngram, min_ngram=min_ngram, max_draft=k)
    by_n: dict = {}
    for req in stream:
        out = req["output"]
        dr = PromptLookupDrafter(cfg)
        dr.start(0, req["prompt"])
        for i in range(len(out) - k):
            prop = dr.propose(0, k)
            if len(prop):
                a = 0
                while a < len(prop) and int(prop[a]) == out[i + a]:
                    a += 1
                row = by_n.setdefault(dr.draft_class(0), [0] * (k + 1))
                row[0] += 1
                for j in range(1, a + 1):
                    row[j] += 1
            dr.extend(0, [out[i]])
    return by_n


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", required=True, help="BENCH_JSON:QUESTION_FILE (repeatable)")
    ap.add_argument("--k", type=int, default=16, help="draft nodes per step (the bench's K)")
    ap.add_argument("--pld_max_draft", type=int, default=4)
    ap.add_argument("--alpha", type=float, default=1.0)
    ap.add_argument("--min_prob", type=float, default=0.1)
    ap.add_argument("--max_depth", type=int, default=64)
    ap.add_argument("--pld_by_ngram", action="store_true", help="prompt lookup's acceptance by match length instead")
    ap.add_argument("--pld_min_ngram", type=int, default=1)
    ap.add_argument("--pld_max_ngram", type=int, default=3)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--json_out", default=None)
    a = ap.parse_args()

    from specjax.drafters.prompt_lookup import PromptLookupConfig, PromptLookupDrafter
    from specjax.drafters.suffix import SuffixConfig, SuffixDrafter
    from specjax.models.loader import load_model

    tok = load_model("smollm2-135m").tokenizer
    stream = [req for spec in a.run for req in load_run(spec, tok)]
    if a.pld_by_ngram:
        by_n = pld_by_ngram(stream, a.k, a.pld_min_ngram, a.pld_max_ngram)
        print("| n-gram match | proposals | " + " | ".join(f"P(first {j} accepted)" for j in range(1, a.k + 1)) + " |")
        print("|---|---|" + "---|" * a.k)
        for n, row in sorted(by_n.items()):
            print(f"| {n} | {row[0]} | " + " | ".join(f"{row[j] / row[0]:.2f}" for j in range(1, a.k + 1)) + " |")
        return
    cfg = SuffixConfig(max_depth=a.max_depth, alpha=a.alpha, min_prob=a.min_prob, max_spec=a.k)
    methods = {
        "suffix": SuffixDrafter(cfg),
        "suffix_local_only": SuffixDrafter(SuffixConfig(**{**cfg.__dict__, "max_cached_requests": 0})),
        "prompt_lookup": PromptLookupDrafter(PromptLookupConfig(max_draft=a.pld_max_draft)),
    }
    per_req = []
    for req in stream:
        row = {"key": req["key"], "category": req["category"], "bench": req["bench"]}
        for name, d in methods.items():
            s, n = replay(d, req["prompt"], req["output"], a.k, tree=(name != "prompt_lookup"))
            row[name] = (n + s) / s if s else 1.0
            row[name + "_steps"], row[name + "_acc"] = s, n
        per_req.append(row)

    # Per block (consecutive requests of one category), first half vs second half of the block.
    blocks, start = [], 0
    for i in range(1, len(per_req) + 1):
        if i == len(per_req) or per_req[i]["category"] != per_req[start]["category"]:
            blocks.append((start, i))
            start = i

    def mat(rs, m):
        s = sum(r[m + "_steps"] for r in rs)
        return (sum(r[m + "_acc"] for r in rs) + s) / s if s else float("nan")

    print("| # | task (block) | requests | suffix: first half | suffix: second half | suffix local-only | "
          "prompt lookup |")
    print("|---|---|---|---|---|---|---|")
    table = []
    for j, (lo, hi) in enumerate(blocks):
        rs = per_req[lo:hi]
        h = max(1, len(rs) // 2)
        e = {"block": j + 1, "category": rs[0]["category"], "requests": len(rs), "suffix_first_half": mat(rs[:h], "suffix"),
             "suffix_second_half": mat(rs[h:], "suffix") if len(rs) > 1 else float("nan"),
             "suffix_local_only": mat(rs, "suffix_local_only"), "prompt_lookup": mat(rs, "prompt_lookup")}
        table.append(e)
        print(f"| {j + 1} | {e['category']} | {e['requests']} | {e['suffix_first_half']:.2f} | "
              f"{e['suffix_second_half']:.2f} | {e['suffix_local_only']:.2f} | {e['prompt_lookup']:.2f} |")
    print(f"| | **all** | {len(per_req)} | {mat(per_req, 'suffix'):.2f} (whole stream) | | "
          f"{mat(per_req, 'suffix_local_only'):.2f} | {mat(per_req, 'prompt_lookup'):.2f} |")
    checks = [(r["bench"]["suffix"], r["suffix"]) for r in per_req if r["bench"].get("suffix") is not None]
    if checks:
        err = max(abs(b - s) / b for b, s in checks)
        print(f"\nreplay vs bench (suffix, {len(checks)} requests measured by the engine): max relative "
              f"difference in mean accepted tokens {100 * err:.1f}%", file=sys.stderr)

    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(11, 4))
        x = np.arange(len(per_req))
        for name, style in (("suffix", "-"), ("suffix_local_only", ":"), ("prompt_lookup", "--")):
            y = np.array([r[name] for r in per_req])
            trailing = np.array([y[max(0, i - 2): i + 1].mean() for i in range(len(y))])
            ax.plot(x, trailing, style, label=f"{name} (mean of the last 3 requests)")
        for lo, hi in blocks:
            ax.axvline(lo - 0.5, color="grey", lw=0.5)
            ax.text((lo + hi - 1) / 2, 0.98, per_req[lo]["category"][:10], rotation=90,
                    transform=ax.get_xaxis_transform(), ha="center", va="top", fontsize=7)
        ax.set_xlabel("request in stream")
        ax.set_ylabel("mean accepted tokens / step")
        ax.set_title("SuffixDecoding on a task-switching stream (SmolLM2-135M, greedy replay)")
        ax.legend(loc="upper left", bbox_to_anchor=(0.0, 0.8), fontsize=8)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"args": vars(a), "blocks": table, "requests": per_req}, f, indent=1)


if __name__ == "__main__":
    main()
