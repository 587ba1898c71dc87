"""Cost of one speculative step vs one autoregressive decode step (the verify-cost curve).

  python benchmarks/step_cost.py --context 64,512,1024 --ks 0,1,2,4,8 [--draft_layers 8]
  python benchmarks/step_cost.py --context 256 --ks 1,3,5 --draft_layers 8 --draft_vocab 4096,8192

For each committed context length and each K, times the compiled ``spec_step`` (host drafter,
greedy, batch 1; the drafts are random tokens, acceptance does not change the cost) and the
autoregressive ``decode_step`` at the same context, and prints ms per call and the ratio.
``--draft_vocab`` adds the same layer-skip draft with reduced-vocabulary heads of those sizes
(drafters.device.reduced_vocab) and prints each device draft's own cost (its step minus the
host-drafter step at the same K: K draft forwards and the draft cache's re-feed).
A speculative step that accepts ``a`` tokens on average (bonus included) beats AR when
``a > cost(K) / cost(AR)``: the ratio column is that break-even mean accepted length.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from benchmarks.timing import median_seconds  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Model name, .gguf or HF dir.")
flags.DEFINE_list("context", ["64", "512", "1024"], "Committed context lengths.")
flags.DEFINE_list("ks", ["0", "1", "2", "4", "8"], "K values.")
flags.DEFINE_integer("slots", 2048, "Cache slots.")
flags.DEFINE_integer("draft_layers", 0, "Also time a layer-skip step with this many layers (0 = off).")
flags.DEFINE_list("draft_vocab", [], "Also time the layer-skip draft with reduced heads of these sizes.")
flags.DEFINE_integer("reps", 20, "Timed calls per point (median reported).")


def main(argv):
    import jax
    import numpy as np

    from specjax import cache as kv
    from specjax.drafters.device import layer_skip, reduced_vocab
    from specjax.engine.compile_key import CompileKey
    from specjax.engine.step import spec_prefill_jit, spec_step_jit
    from specjax.reference_ar import decode_step
    from specjax.models.loader import load_model
    from specjax.sampling import SamplingArrays, SamplingParams

    m = load_model(FLAGS.model)
    cfg, params = m.cfg, m.params
    S = FLAGS.slots
    samp = SamplingArrays.build([SamplingParams()], 1)
    rng = np.random.default_rng(0)
    drafts = [(None, params)] + ([layer_skip(cfg, params, FLAGS.draft_layers)] if FLAGS.draft_layers else [])
    for n in map(int, FLAGS.draft_vocab):
        # which N tokens does not change the cost: the first N ids stand for the N most frequent
        drafts.append(reduced_vocab(*drafts[1], np.arange(n)))
    print(f"{cfg.name}, batch 1, greedy, {S} slots; ms per call (median of {FLAGS.reps})")
    print("| context | drafter | K | step ms | AR decode ms | step / AR | draft ms |")
    print("|---|---|---|---|---|---|---|")
    for ctx in map(int, FLAGS.context):
        toks = jax.device_put(rng.integers(0, cfg.vocab_size, (1, ctx), dtype=np.int32))
        lens = jax.device_put(np.array([ctx], np.int32))

        def fresh_lens():
            return jax.device_put(np.array([ctx], np.int32))
        for draft, dparams in drafts:
            pkey = CompileKey("prefill", cfg, 1, S, True, draft, prompt=ctx)
            state0 = spec_prefill_jit(params, dparams, toks, lens, samp, key=pkey)
            ar_cache = state0.cache
            tok = jax.device_put(np.zeros(1, np.int32))
            act = jax.device_put(np.ones(1, bool))

            def ar():
                nonlocal ar_cache
                c, t = decode_step(params, ar_cache, tok, act, samp, cfg=cfg, greedy_only=True)
                jax.block_until_ready(t)
                ar_cache = kv.set_lengths(c, fresh_lens())  # stay at the same context (a new buffer: donated)

            ar_ms = 1e3 * median_seconds(ar, FLAGS.reps)
            host_ms = {} if draft is None else host_ms
            for K in map(int, FLAGS.ks):
                state = spec_prefill_jit(params, dparams, toks, lens, samp, key=pkey)
                dt = jax.device_put(rng.integers(0, cfg.vocab_size, (1, max(K, 1)), dtype=np.int32))
                nd = jax.device_put(np.array([K], np.int32))

                def step():
                    nonlocal state
                    st, o = spec_step_jit(params, dparams, state, dt, nd, act, samp,
                                          key=CompileKey("step", cfg, 1, S, True, draft, k=K))
                    jax.block_until_ready(o.tokens)
                    state = st.__class__(cache=kv.set_lengths(st.cache, fresh_lens()), dcache=st.dcache, prev=st.prev,
                                         pending=st.pending)

                ms = 1e3 * median_seconds(step, FLAGS.reps)
                name = "host" if draft is None else draft.label
                if draft is None:
                    host_ms[K] = ms
                own = "" if draft is None else f"{ms - host_ms[K]:.1f}"
                print(f"| {ctx} | {name} | {K} | {ms:.1f} | {ar_ms:.1f} | {ms / ar_ms:.2f} | {own} |", flush=True)


if __name__ == "__main__":
    app.run(main)
