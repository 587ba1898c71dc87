#!/usr/bin/env python
"""Chunked against whole-prompt prefill in the serving engine, on a stream mixing short and long
prompts: time to first token and time per output token (percentiles) at each request rate.

Short prompts: Spec-Bench first turns (<= 300 tokens); long ones: the 1-4k-token prompts of
``benchmarks/make_workload.py --long`` (built here from ../shared/data). Every --long_every-th
request is long. Poisson arrivals; each rate serves the identical stream once with whole-prompt
prefill (a long arrival stalls every running request for its whole prefill) and once per
--chunked setting CHUNK:BUDGET (prompts prefilled in chunks of at most CHUNK tokens, about
BUDGET prompt tokens per engine iteration while others decode). SmolLM2-135M fp32, plain
decoding (K = 0), so the prefill policy is all that differs. Besides TTFT and time per output
token it reports each request's longest wait between two tokens (the stall a streaming reader
sees when a long prompt is prefilled in front of it).

  python benchmarks/chunked_serving.py --rates 0.1,0.2 --num_requests 12 --chunked 512:512,128:128
"""

from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("rates", ["0.1", "0.2"], "Poisson request rates (requests/s).")
flags.DEFINE_integer("num_requests", 12, "Requests per run.")
flags.DEFINE_integer("long_every", 4, "Every n-th request is a long prompt.")
flags.DEFINE_list("chunked", ["512:512", "128:128"], "Chunked-prefill settings CHUNK:BUDGET (largest chunk, prompt "
                  "tokens per iteration) to compare with whole prefill.")
flags.DEFINE_integer("max_new_tokens", 32, "Tokens per request (EOS ignored).")
flags.DEFINE_string("data_dir", os.path.join(ROOT, "..", "shared", "data"), "The shared prompt sets.")
flags.DEFINE_integer("seed", 0, "Arrivals and prompt order.")
flags.DEFINE_string("json_out", None, "Write all rows as JSON here.")


def main(argv):
    del argv
    import numpy as np

    from benchmarks.make_workload import long_prompts
    from specjax import registry
    from specjax.engine.loop import ServingEngine, summarize
    from specjax.engine.scheduler import Request
    from specjax.goodput import FixedK
    from specjax.models.loader import load_model

    m = load_model("smollm2-135m")
    tok = m.tokenizer
    short = []
    with open(os.path.join(FLAGS.data_dir, "spec_bench", "question.jsonl")) as f:
        for line in f:
            ids = tok.encode_chat(json.loads(line)["turns"][0])
            if len(ids) <= 300:
                short.append(ids)
    long = [tok.encode_chat(q["turns"][0]) for q in long_prompts(FLAGS.data_dir, 2)]
    rng = np.random.default_rng(FLAGS.seed)
    picks = [long[i // FLAGS.long_every % len(long)] if i % FLAGS.long_every == FLAGS.long_every - 1
             else short[int(rng.integers(len(short)))] for i in range(FLAGS.num_requests)]
    settings = [(512, None)] + [tuple(int(x) for x in c.split(":")) for c in FLAGS.chunked]
    backends = {}
    for chunk in sorted({c for c, _ in settings}):
        be = backends[chunk] = registry.make_backend(m, "none", k_buckets=(0,), batch_buckets=(1, 2, 4, 8), slots=4096,
                                                     prefill_chunk=chunk)
        t0 = time.perf_counter()
        be.warmup(prompt_lens=sorted({len(p) for p in picks}), execute=True, progress=True)
        print(f"[chunks of <= {chunk}: compiled and ran {len(be.table)} executables in {time.perf_counter() - t0:.0f} s]",
              file=sys.stderr)
    rows = []
    for rate in [float(r) for r in FLAGS.rates]:
        gaps = rng.exponential(1.0 / rate, FLAGS.num_requests)
        arrivals = np.cumsum(gaps) - gaps[0]
        reqs = [Request(f"r{i}", p, FLAGS.max_new_tokens, arrival=float(t), ignore_eos=True)
                for i, (p, t) in enumerate(zip(picks, arrivals))]
        for chunk, budget in settings:
            be = backends[chunk]
            be.reset()
            eng = ServingEngine(be, FixedK(0), prefill_budget=budget)
            outs = eng.run(reqs)
            s = summarize(outs, eng.steps)
            is_long = [len(r.prompt) > 300 for r in reqs]
            for part, sel in (("short", False), ("long", True)):
                sub = summarize([o for o, lg in zip(outs, is_long) if lg == sel])
                s[f"{part}_p50_ttft_s"], s[f"{part}_p90_ttft_s"] = sub["p50_ttft_s"], sub["p90_ttft_s"]
            name = "whole" if budget is None else f"chunks {chunk}, budget {budget}"
            rows.append({"rate": rate, "prefill": name, **s})
            r = rows[-1]
            print(f"  rate {rate:.2f} {r['prefill']:22s} TTFT p50 {r['p50_ttft_s']:.2f} p90 {r['p90_ttft_s']:.2f} s; "
                  f"TPOT p50 {r['p50_tpot_s'] * 1e3:.0f} p90 {r['p90_tpot_s'] * 1e3:.0f} ms; longest gap p90 "
                  f"{r['p90_max_gap_s']:.2f} max {r['max_gap_s']:.2f} s", file=sys.stderr)
    print(f"\nSmolLM2-135M fp32, K = 0; {FLAGS.num_requests} requests per run, every {FLAGS.long_every}th a "
          f"{min(map(len, long))}-{max(map(len, long))}-token prompt, the rest Spec-Bench (<= 300 tokens); "
          f"{FLAGS.max_new_tokens} new tokens each")
    print("| rate (req/s) | prefill | TTFT p50 / p90 (s) | short TTFT p50 / p90 | long TTFT p50 / p90 | "
          "TPOT p50 / p90 (ms) | longest gap p90 / max (s) | mean latency (s) |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rate']:.2f} | {r['prefill']} | {r['p50_ttft_s']:.2f} / {r['p90_ttft_s']:.2f} | "
              f"{r['short_p50_ttft_s']:.2f} / {r['short_p90_ttft_s']:.2f} | "
              f"{r['long_p50_ttft_s']:.2f} / {r['long_p90_ttft_s']:.2f} | "
              f"{r['p50_tpot_s'] * 1e3:.0f} / {r['p90_tpot_s'] * 1e3:.0f} | "
              f"{r['p90_max_gap_s']:.2f} / {r['max_gap_s']:.2f} | {r['mean_latency_s']:.2f} |")
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    app.run(main)
