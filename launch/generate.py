"""Generate text with specjax: the autoregressive baseline or speculative decoding.

  python launch/generate.py --prompt "What is the capital of France?" --chat
  python launch/generate.py --prompt "..." --chat --drafter prompt_lookup --num_spec_tokens 4
  python launch/generate.py --prompt "..." --chat --drafter layer_skip --draft_layers 8
  python launch/generate.py --prompt "..." --drafter draft_model --draft_model /path/to/small_model
  python launch/generate.py --input_jsonl in.jsonl --output_jsonl out.jsonl --chat [--drafter ...]

Drafters (``--drafter``, registry.DRAFTERS; their knobs: ``--helpfull``): none (the
autoregressive ``Generator``, default), prompt_lookup, draft_model, layer_skip, suffix,
suffix_path, hybrid; for the suffix drafters K is the draft-node budget per step. Speculative
runs use ``SpecGenerator`` under ``--policy`` (auto: SmartSpec where a performance model of this
model, drafter, hardware and compiled code exists, else fixed K = ``--num_spec_tokens``, said on
stderr; smartspec requires the model; an integer is that fixed K; none is K = 0), K one of
``--k_buckets``.

Compilation: with ``--prompt``, nothing compiles before generation. The answer compiles (or,
from the executable cache, loads) each executable when it first reaches it, while a background
thread compiles the K = 0 step beside the prefill's compilation, on the other core
(JaxBackend.warmup, ``lazy``); the seconds the answer waited for them are printed and excluded
from tok/s. The K > 0 buckets (SmartSpec's, or a fixed K's: it runs plain decode calls until its
step is in) compile in that thread from step 16 on and join the policy's choices as they finish
(their cost is inside the reported speed; the answer is printed first, then the script waits
only for the one in progress, so that the next run finds it). ``--compile ahead`` builds all of
them before the answer instead, which then speculates from its first step. The executable cache (``$SPECJAX_CACHE_DIR``,
specjax.engine.exe_cache) stores every executable keyed without tracing, so a later run loads the
ones it reaches instead.

Speculative metrics (vLLM-style, over row-steps): acceptance rate = accepted / drafted; mean
accepted tokens per step, bonus included; per-position acceptance = P(draft j accepted | drafted).

JSONL mode serves the job exactly as launch/batch.py does (specjax.serve_job: the continuous
batching engine with ``--batch_buckets`` rows of ``--slots`` KV slots; README "JSONL jobs"): one
output line per non-blank input line (a result or an error record), ids and duplicates, resume,
a lock on the output, one lone retry after a failure; Ctrl-C stops after the current engine step
with exit status 130.

User mistakes print one line ("error: ...") and exit with status 2.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from specjax import cli, registry  # noqa: E402

FLAGS = flags.FLAGS
def define_flags() -> None:
    flags.DEFINE_string("prompt", None, "Prompt text.")
    cli.define_job_flags()
    flags.DEFINE_integer("max_new_tokens", 128, "Maximum tokens to generate per prompt.")
    cli.define_model_flags()
    cli.define_drafter_flags()
    cli.define_engine_flags(slots=0)
    cli.define_request_flags()
    cli.define_forward_flags()
    cli.define_distributed_flags()
    cli.define_policy_flags()


# Steps a single answer runs before the other K buckets start loading or compiling beside it:
# each load from a warm cache holds the GIL for about 0.45 s (BENCHMARKS.md, first answer).
LATER_AFTER_STEPS = 16


def run_single(model, gen, stats=None, policy=None, policy_label="") -> None:
    from specjax.generate import validate_request

    tok = model.tokenizer
    ids = tok.encode_chat(FLAGS.prompt, FLAGS.system) if FLAGS.chat else tok.encode(FLAGS.prompt)
    samp = cli.sampling_from_flags()
    validate_request(ids, FLAGS.max_new_tokens, model.cfg)
    # Nothing compiles up front: the prefill compiles when the answer reaches it while the K = 0
    # step compiles beside it on the other core. The K > 0 buckets (SmartSpec's; a fixed K's and
    # those below it: host drafts shrink the block) join the policy's options as they finish, from
    # the LATER_AFTER_STEPS-th step on (a short answer is not slowed by loading them; a fixed K
    # runs plain decode calls until its step is in: the same tokens).
    # --compile ahead: every executable the answer may reach is built first, so it speculates from
    # its first step (what a timing or a token-identity check of this path needs).
    k_fixed = getattr(policy, "k", None)
    k_warm = k_fixed if k_fixed is not None else max(gen.k_buckets)
    ahead = FLAGS.compile == "ahead"
    later = [] if ahead else [b for b in gen.k_buckets if 0 < b <= k_warm]
    registry.warm_spec(gen, [registry.spec_shapes(gen, len(ids), FLAGS.max_new_tokens)], k_warm, greedy=samp.greedy,
                       later=later, later_after_steps=LATER_AFTER_STEPS, lazy=not ahead)
    res = gen.generate([ids], samp, max_new_tokens=FLAGS.max_new_tokens, ignore_eos=FLAGS.ignore_eos,
                       **({} if stats is None else {"num_spec_tokens": FLAGS.num_spec_tokens, "stats": stats,
                                                    "policy": policy}))[0]
    print(tok.decode(res.tokens), flush=True)  # (before waiting for a background build in progress)
    t = time.perf_counter()
    in_time = [k for k in later if k in gen.k_options()]
    gen.stop_later()
    wait_s = time.perf_counter() - t
    n = len(res.tokens)
    pre_w, all_w = gen.compile_waits()  # compilation the answer waited for, inside its prefill and decode times
    prefill_s, decode_s = res.prefill_s - pre_w, res.decode_s - (all_w - pre_w)
    dec = n / decode_s if decode_s > 0 else float("nan")
    bg = (f"; K {later} to compile alongside the generation from step {LATER_AFTER_STEPS} on (included; "
          f"{len(in_time)} ready before the end, {wait_s:.1f} s waited after it for the one in progress)"
          if later else "")
    print(f"\n[{n} tokens ({res.finish_reason}); prompt {res.prompt_len} tokens: prefill {prefill_s * 1e3:.0f} ms "
          f"({res.prompt_len / max(prefill_s, 1e-9):.0f} tok/s); decode {dec:.1f} tok/s; compilation {all_w:.1f} s "
          f"on first use, waited for by the answer and excluded{bg}]", file=sys.stderr)
    if stats is not None:
        print(f"[spec {FLAGS.drafter}, policy {policy_label}: {registry.format_spec_stats(stats)}]", file=sys.stderr)


def job() -> int:
    from specjax.errors import SpecjaxError

    if (FLAGS.prompt is None) == (FLAGS.input_jsonl is None):
        raise SpecjaxError("give exactly one of --prompt or --input_jsonl")
    if FLAGS.prompt is not None and not FLAGS.prompt.strip():
        raise SpecjaxError("empty prompt: --prompt must contain some text")
    cli.request_defaults()  # --max_new_tokens and the sampling flags, before the (slow) model load
    cli.prefill_budget_from_flags()
    cli.drafters_from_flags()
    spec = cli.engine_spec_from_flags()
    if FLAGS.num_processes > 1 and FLAGS.input_jsonl is None:
        raise SpecjaxError("--num_processes > 1 splits a JSONL job (--input_jsonl) between processes")
    if FLAGS.input_jsonl is None:
        model, spec = cli.load_target(spec)
        gen = registry.build_generator(spec, model)
        if spec.drafter.name == "none":
            run_single(model, gen)
        else:
            from specjax.spec_generate import SpecStats

            run_single(model, gen, SpecStats(), *cli.policy_from_spec(spec, model))
        return 0
    return run_jsonl(spec)


def run_jsonl(spec) -> int:
    """The JSONL job on the serving engine, as launch/batch.py serves it (specjax.serve_job)."""
    from specjax.serve_job import serve_job

    def serve(job):
        import dataclasses

        model, loaded = cli.load_target(spec)
        # (--slots 0: KV rows sized from the job's records, serve_job's slot classes)
        backend = (registry.build_backend(loaded, model) if loaded.slots else
                   lambda slots: registry.build_backend(dataclasses.replace(loaded, slots=slots), model))
        return serve_job(job, model, backend, *cli.policy_from_spec(loaded, model),
                         drafter=loaded.drafter.name, chat=FLAGS.chat, system=FLAGS.system,
                         ignore_eos=FLAGS.ignore_eos, **cli.serving_from_flags())

    return cli.run_jsonl_job(serve)


def main(argv):
    cli.run_job(job, argv)


if __name__ == "__main__":
    define_flags()
    app.run(main)
