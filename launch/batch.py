"""Batch offline inference on the continuous-batching engine: JSONL in, JSONL out.

  python launch/batch.py --input_jsonl in.jsonl --output_jsonl out.jsonl --chat
  python launch/batch.py --input_jsonl in.jsonl --output_jsonl out.jsonl --chat --drafter layer_skip --draft_layers 8
  python launch/batch.py --input_jsonl in.jsonl --output_jsonl out.jsonl --chat --policy 4 --num_spec_tokens 4
  python launch/batch.py --input_jsonl in.jsonl --output_jsonl out.jsonl --drafter none          # no speculation

Input: one JSON object per line with a ``prompt`` (string), an optional ``id`` (default: the
1-based line number) and optional per-record overrides of the sampling flags (``temperature``,
``top_k``, ``top_p``, ``seed``, ``max_new_tokens``). Output: one line per input id, as
launch/generate.py writes it: {"id", "prompt", "output", "output_ids", "num_prompt_tokens",
"num_tokens", "finish_reason"}, or {"id", "error"} for a malformed line, bad overrides, an
empty prompt or a prompt that does not fit the engine's ``--slots`` KV slots. None of these
stops the job. If an id occurs more than once in the input, only its first record is served;
the later ones are reported on stderr (never a second output line with the same id).

Every record arrives at t = 0 and the engine (``specjax.engine``) serves them with continuous
batching: the first ``max(--batch_buckets)`` run, the rest queue and are admitted as rows free
up. Each finished request is appended to ``--output_jsonl`` (flushed and fsynced) the moment it
finishes, so a killed job loses only its in-flight requests: run the same command again and it
skips every id already in the output (error records included; delete those lines to retry them).

Speculation (``--policy``): ``auto`` uses SmartSpec's goodput selector when ``--perf_models``
has a performance model for this model, drafter and hardware (make one with
launch/profile.py), else a fixed K = ``--num_spec_tokens`` (said on stderr); ``smartspec``
requires the model; ``none`` is K = 0; an integer is that fixed K (one of ``--k_buckets``).
Greedy outputs are the target model's greedy outputs whatever the policy (lossless).

Everything the run needs (every batch bucket x compiled K x the prompt buckets present, greedy
and/or sampled) is compiled once before serving; the compile time is printed separately and is
not in the reported tok/s. The persistent XLA cache (``$SPECJAX_CACHE_DIR``) makes a resumed
run's compilation fast.

User mistakes print one line ("error: ...") and exit with status 2.
"""

from __future__ import annotations

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

from specjax import cli, registry  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("input_jsonl", None, "JSONL input: one {'id', 'prompt', ...} object per line.")
    flags.DEFINE_string("output_jsonl", None, "JSONL output (appended; finished ids are skipped on resume).")
    flags.DEFINE_integer("max_new_tokens", 128, "Maximum tokens to generate per prompt (records may override).")
    flags.DEFINE_enum("drafter", "prompt_lookup", list(registry.DRAFTERS), "Speculative drafter; none = plain decoding.")
    flags.DEFINE_string("batch_buckets", "1,2,4,8", "Batch buckets; the engine's KV rows = the largest.")
    flags.DEFINE_integer("slots", 512, "KV slots per request row (prompt + max_new_tokens + K + 1 must fit).")
    cli.define_request_flags()
    cli.define_spec_flags(num_spec_tokens=3, k_buckets="0,1,2,3,4,5")
    cli.define_forward_flags()
    cli.define_policy_flags()


# ---------------------------------------------------------------- flags


def validate_flags() -> dict:
    """Every check that needs no model (before the slow load). Returns the parsed geometry."""
    from specjax.errors import SpecjaxError

    if not FLAGS.input_jsonl:
        raise SpecjaxError("--input_jsonl is required")
    if not FLAGS.output_jsonl:
        raise SpecjaxError("--output_jsonl is required")
    if os.path.abspath(FLAGS.input_jsonl) == os.path.abspath(FLAGS.output_jsonl):
        raise SpecjaxError("--output_jsonl must differ from --input_jsonl")
    if not os.path.isfile(FLAGS.input_jsonl):
        raise SpecjaxError(f"input file not found: {FLAGS.input_jsonl}")
    if FLAGS.system and not FLAGS.chat:
        raise SpecjaxError("--system needs --chat")
    if FLAGS.max_new_tokens < 1:
        raise SpecjaxError(f"--max_new_tokens must be >= 1, got {FLAGS.max_new_tokens}")
    cli.sampling_from_flags()  # the default sampling flags
    ks = registry.number_list("k_buckets", FLAGS.k_buckets)
    if min(ks) < 0 or 0 not in ks:
        raise SpecjaxError(f"--k_buckets must be non-negative and include 0 (plain decoding), got {FLAGS.k_buckets!r}")
    bbs = registry.number_list("batch_buckets", FLAGS.batch_buckets)
    if min(bbs) < 1:
        raise SpecjaxError(f"--batch_buckets must be >= 1, got {FLAGS.batch_buckets!r}")
    if FLAGS.slots < 16:
        raise SpecjaxError(f"--slots must be >= 16, got {FLAGS.slots}")
    registry.check_policy(FLAGS.policy, ks, FLAGS.drafter, FLAGS.num_spec_tokens)
    cli.check_policy_flags()
    if FLAGS.drafter == "none":
        ks = [0]  # nothing to speculate with: compile plain decoding only
    cli.validate_spec_flags([FLAGS.drafter])  # the drafter's own knobs (shared with every script)
    return dict(k_buckets=ks, batch_buckets=bbs, slots=FLAGS.slots)


# ---------------------------------------------------------------- the job


def main(argv):
    cli.run_job(lambda: run(validate_flags()), argv)


def run(geom) -> None:
    from tqdm import tqdm

    from specjax import jsonl_io
    from specjax.engine.loop import ServingEngine, summarize
    from specjax.engine.scheduler import Request, Scheduler
    from specjax.errors import SpecjaxError
    from specjax.goodput import DraftPrefillGate
    from specjax.models.loader import load_model

    wall0 = time.perf_counter()
    records = list(jsonl_io.read_records(FLAGS.input_jsonl))
    done = jsonl_io.done_ids(FLAGS.output_jsonl)
    seen: set[str] = set()
    todo, dups = [], []
    n_done = 0
    for rec in records:
        if rec.id in seen:
            dups.append(rec.id)
            continue
        seen.add(rec.id)
        if rec.id in done:
            n_done += 1
        else:
            todo.append(rec)
    if dups:
        shown = ", ".join(repr(d) for d in dups[:5]) + (", ..." if len(dups) > 5 else "")
        print(f"note: {len(dups)} records repeat an earlier id and are skipped (the first record of an id is "
              f"served): {shown}", file=sys.stderr)

    model = load_model(FLAGS.model)
    print(f"[loaded {model.cfg.name} ({model.cfg.num_params() / 1e6:.0f}M params) in {model.load_seconds:.1f} s]",
          file=sys.stderr)
    tok = model.tokenizer
    if FLAGS.chat:
        tok.encode_chat("hi", FLAGS.system)  # a model without a chat template fails here, not on every record
    backend = registry.make_backend(model, FLAGS.drafter, fwd=cli.forward_options_from_flags(), **geom,
                                    **registry.backend_options([FLAGS.policy]),
                                   **cli.drafter_kwargs(model, FLAGS.drafter, max(geom["k_buckets"])))
    policy, policy_label = cli.policy_from_flags(model, FLAGS.drafter)
    gate = DraftPrefillGate() if policy_label.startswith("SmartSpec") else None
    check = Scheduler(backend.num_rows, backend.slots, backend.k_max + 1).check  # the engine's admission rule

    n_err = n_tok = 0
    with jsonl_io.ResumableWriter(FLAGS.output_jsonl) as out, \
            tqdm(total=len(todo), unit="rec", disable=None, file=sys.stderr) as bar:
        prompt_of: dict[str, str] = {}

        def error(rid: str, msg: str) -> None:
            nonlocal n_err
            n_err += 1
            out.write({"id": rid, "error": msg})
            bar.update(1)

        def on_finish(o) -> None:
            nonlocal n_tok
            if o.error is not None:
                error(o.id, o.error)
                return
            n_tok += len(o.tokens)
            out.write({"id": o.id, "prompt": prompt_of[o.id], "output": tok.decode(o.tokens),
                       "output_ids": [int(t) for t in o.tokens], "num_prompt_tokens": o.prompt_len,
                       "num_tokens": len(o.tokens), "finish_reason": o.finish_reason})
            bar.update(1)

        requests = []
        for rec in todo:
            try:
                if rec.error:
                    raise SpecjaxError(rec.error)
                ids = tok.encode_chat(rec.prompt, FLAGS.system) if FLAGS.chat else tok.encode(rec.prompt)
                req = Request(rec.id, ids, int(rec.overrides.get("max_new_tokens", FLAGS.max_new_tokens)),
                              cli.sampling_from_flags(rec.overrides), arrival=0.0, ignore_eos=FLAGS.ignore_eos)
                check(req)
                bad = [t for t in ids if not 0 <= int(t) < model.cfg.vocab_size]
                if bad:
                    raise SpecjaxError(f"prompt token ids out of range [0, {model.cfg.vocab_size}): {bad[:5]}")
            except (SpecjaxError, ValueError, TypeError, OverflowError) as e:
                error(rec.id, str(e))
                continue
            prompt_of[rec.id] = rec.prompt
            requests.append(req)

        engine = None
        serve_s = compile_s = 0.0
        if requests:
            bar.clear()
            t0 = time.perf_counter()
            backend.warmup(prompt_lens=sorted({len(r.prompt) for r in requests}),
                           greedy_modes=tuple(sorted({r.sampling.greedy for r in requests}, reverse=True)),
                           progress=True)
            compile_s = time.perf_counter() - t0
            print(f"[compiled {len(backend.table)} executables in {compile_s:.1f} s; serving {len(requests)} "
                  f"requests, policy {policy_label}, drafter {FLAGS.drafter}, {backend.num_rows} KV rows x "
                  f"{backend.slots} slots]", file=sys.stderr)
            engine = ServingEngine(backend, policy, eos_ids=tok.eos_ids, prefill_gate=gate, on_finish=on_finish)
            t0 = time.perf_counter()
            try:
                outputs = engine.run(requests)
            except KeyboardInterrupt:
                bar.close()
                print(f"\ninterrupted: {bar.n} of {len(todo)} records written to {FLAGS.output_jsonl}; run the same "
                      "command again to finish the rest", file=sys.stderr)
                sys.exit(130)
            serve_s = time.perf_counter() - t0
    wall = time.perf_counter() - wall0

    line = (f"{len(records)} records ({n_done} already done, {len(todo)} to do, {n_err} errors"
            + (f", {len(dups)} duplicate ids skipped" if dups else "") + f"); {n_tok} tokens")
    if engine is None:
        print(line + f"; nothing to serve ({wall:.1f} s)", file=sys.stderr)
        return
    s = summarize(outputs, engine.steps)
    ok = s["requests"] - s["errors"]
    print(line + f" in {serve_s:.1f} s serving = {n_tok / max(serve_s, 1e-9):.1f} tok/s "
          f"(+ {compile_s:.1f} s compilation; {wall:.1f} s wall in all)", file=sys.stderr)
    if ok:
        print(f"latency mean {s['mean_latency_s']:.2f} s, p90 {s['p90_latency_s']:.2f} s (queueing included); "
              f"acceptance rate {s['acceptance_rate']:.3f}; mean K {s['mean_k']:.2f}; mean batch "
              f"{s['mean_batch']:.2f} over {s['steps']} steps; policy {policy_label}", file=sys.stderr)


if __name__ == "__main__":
    define_flags()
    app.run(main)
