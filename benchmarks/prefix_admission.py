#!/usr/bin/env python
"""Time to a first token with and without a prefix-cache hit, by the length of the shared prefix.

For each prefix length P (multiples of the 512-token chunk), prompts of P shared random tokens
plus a 100-token tail of their own are admitted one at a time into a plain-decoding generator
(``Generator.generate(max_new_tokens=1)``; its ``prefill_s`` is the admission: the prefill, and
with a hit the restore of the stored chunks). *miss*: a generator without the store (every
prompt prefilled whole); *hit*: one with the store, the prefix stored by an earlier prompt, so
only the tail's chunk runs. Both compiled and run once before timing; rounds alternate the two
(specjax.benchtime), medians reported. The first tokens agree (asserted).

  python benchmarks/prefix_admission.py [--lens 512,1024,2048,3584] [--reps 5]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lens", default="512,1024,2048,3584")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tail", type=int, default=100)
    a = ap.parse_args()

    import numpy as np

    from specjax.benchtime import rounds, summarize
    from specjax.generate import Generator
    from specjax.models.loader import load_model
    from specjax.models.options import ForwardOptions

    m = load_model("smollm2-135m")
    fwd = ForwardOptions(rows_kernel=m.auto_rows_kernel())
    params = m.params_for(fwd)
    gens = {mb: Generator(m.cfg, params, eos_ids=(), fwd=fwd, batch_buckets=(1,), prefix_cache_mb=mb) for mb in (0, 4096)}
    rng = np.random.default_rng(0)
    print(f"SmolLM2-135M-Instruct ({'rows kernel' if fwd.rows_kernel else 'XLA dot'}), one prompt per admission, "
          f"{a.tail}-token tails, medians of {a.reps} alternating rounds\n")
    print("| shared prefix, tokens | prompt, tokens | first token, miss (whole prefill), ms | first token, hit, ms | "
          "miss / hit |")
    print("|---|---|---|---|---|")
    for P in (int(x) for x in a.lens.split(",")):
        prefix = [int(x) for x in rng.integers(100, m.cfg.vocab_size, P)]
        tail = lambda: [int(x) for x in rng.integers(100, m.cfg.vocab_size, a.tail)]  # noqa: E731
        for g in gens.values():  # compile and run once; the store's generator stores the prefix
            g.generate([prefix + tail()], max_new_tokens=1)
        gens[4096].generate([prefix + tail()], max_new_tokens=1)  # (a first hit: its restore runs once)

        def admit(mb):
            def run():
                p = prefix + tail()
                return {"prefill_s": gens[mb].generate([p], max_new_tokens=1)[0].prefill_s}
            return run

        s = rounds({"miss": admit(0), "hit": admit(4096)}, a.reps, warmup=0)
        miss, hit = (summarize(s[k])["prefill_s"] for k in ("miss", "hit"))
        assert gens[4096].backend(gens[4096].slots_for([P + a.tail], 1)).prefix.stats.hits >= a.reps
        print(f"| {P} | {P + a.tail} | {1e3 * miss:.0f} | {1e3 * hit:.0f} | {miss / hit:.1f}x |", flush=True)
        # the same prompt through both generators gives the same first token
        p = prefix + tail()
        assert gens[0].generate([p], max_new_tokens=1)[0].tokens == gens[4096].generate([p], max_new_tokens=1)[0].tokens


if __name__ == "__main__":
    main()
