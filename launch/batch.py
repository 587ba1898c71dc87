"""Batch offline inference on the continuous-batching engine: JSONL in, JSONL out.

  python launch/batch.py --input_jsonl in.jsonl --output_jsonl out.jsonl --chat
  python launch/batch.py --input_jsonl in.jsonl --output_jsonl out.jsonl --chat --drafter layer_skip --draft_layers 8
  python launch/batch.py --input_jsonl in.jsonl --output_jsonl out.jsonl --chat --policy 4 --num_spec_tokens 4
  python launch/batch.py --input_jsonl in.jsonl --output_jsonl out.jsonl --drafter none          # no speculation

Input: one JSON object per line with a ``prompt`` (string), an optional ``id`` (a string or an
integer; default ``#<line number>``) and optional per-record overrides of the sampling flags
(``temperature``, ``top_k``, ``top_p``, ``seed``, ``max_new_tokens``). Output: exactly one line
per non-blank input line, as launch/generate.py writes it: {"id", "prompt", "output",
"output_ids", "num_prompt_tokens", "num_tokens", "finish_reason"}, or {"id", "error"} for a
line that is not valid UTF-8 or JSON, a bad or repeated id, a bad override, an empty prompt or a
prompt that does not fit the engine's ``--slots`` KV slots. None of these stops the job. The job
layer (``specjax.jobs``; README "JSONL jobs") holds the rules: ids, duplicates, resume, the lock
on the output, retries and exit statuses.

Every record arrives at t = 0 and the engine (``specjax.engine``) serves them with continuous
batching: the first ``max(--batch_buckets)`` run, the rest queue and are admitted as rows free
up. Each finished request is appended to ``--output_jsonl`` (flushed and fsynced) the moment it
finishes, so a killed job loses only its in-flight requests: run the same command again and it
skips every id already in the output (error records included; delete those lines to retry them).
Ctrl-C stops after the current engine step (exit status 130); the same command resumes.

Speculation (``--policy``): ``auto`` uses SmartSpec's goodput selector when ``--perf_models``
has a performance model for this model, drafter and hardware (make one with
launch/profile.py), else a fixed K = ``--num_spec_tokens`` (said on stderr); ``smartspec``
requires the model; ``none`` is K = 0; an integer is that fixed K (one of ``--k_buckets``).
Greedy outputs are the target model's greedy outputs whatever the policy (lossless).

Everything the run needs (every batch bucket x compiled K x the prompt buckets present, greedy
and/or sampled) is compiled once before serving; the compile time is printed separately and is
not in the reported tok/s. The persistent XLA cache (``$SPECJAX_CACHE_DIR``) makes a resumed
run's compilation fast.

Online speculative decoding (``--online_distill DIR --drafter layer_skip``, or ``draft_model``):
the draft trains while the job serves, from the target's top-k logits the verify steps keep
(specjax.distill.online): every ``--distill_every`` finished requests (and, with
``--distill_idle_rows``, between steps when the load is light) it takes a few optimizer steps
and the new params swap in between engine steps, nothing recompiled. orbax checkpoints go to
DIR every ``--distill_checkpoint_every`` updates and at the end; a killed job resumed with the
same command continues from the latest one (a draft trained by launch/distill.py included).
``--distill_tags a,b`` trains a draft per record ``tag`` (DIR/a, DIR/b; other records go to the
first), ``--distill_clusters N`` a draft per cluster of prompts (DIR/cluster<i>; a
nearest-centroid classifier that tagged records train); a batch runs one draft, the engine
switches between batches. Outputs are the target's whatever the draft (greedy: bit for bit).

Sharding and several processes: ``--mesh DATAxMODEL`` shards the engine over this process's
devices (tensor parallel over ``model``, rows over ``data``). ``--num_processes N --process_id K
--coordinator_address host:port`` (jax.distributed.initialize) makes each process a data-parallel
replica: process K serves input records K, K + N, ... (ids and duplicates are checked over the
whole input) into ``OUT.replicaKofN``, resumable on its own like any output, and the last process
to finish writes ``--output_jsonl``: every part's lines in input order, byte for byte, renamed
into place atomically. Running a finished process's command again merges again (same bytes).

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
    cli.define_job_flags()
    flags.DEFINE_integer("max_new_tokens", 128, "Maximum tokens to generate per prompt (records may override).")
    flags.DEFINE_enum("drafter", "prompt_lookup", list(registry.DRAFTERS), "Speculative drafter; none = plain decoding.")
    flags.DEFINE_string("batch_buckets", "1,2,4,8", "Batch buckets; the engine's KV rows = the largest.")
    flags.DEFINE_integer("slots", 512, "KV slots per request row (prompt + max_new_tokens + K + 1 must fit).")
    cli.define_request_flags()
    cli.define_spec_flags(num_spec_tokens=3, k_buckets="0,1,2,3,4,5")
    cli.define_forward_flags()
    cli.define_distributed_flags()
    flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter/activation dtype.")
    cli.define_prefill_flags()
    cli.define_policy_flags()
    cli.define_distill_flags()


# ---------------------------------------------------------------- flags


def validate_flags() -> dict:
    """Every check that needs no model (before the slow load). Returns the parsed geometry."""
    from specjax.errors import SpecjaxError

    if not FLAGS.input_jsonl:
        raise SpecjaxError("--input_jsonl is required")
    if not FLAGS.output_jsonl:
        raise SpecjaxError("--output_jsonl is required")
    if FLAGS.system and not FLAGS.chat:
        raise SpecjaxError("--system needs --chat")
    cli.request_defaults()  # --max_new_tokens and the sampling flags
    cli.prefill_options_from_flags()
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
    cli.check_online_distill_flags(FLAGS.drafter)
    if FLAGS.num_processes == 1:  # (several: jax.distributed must start before jax looks at devices)
        cli.layout_from_flags()  # a malformed mesh, or more devices than present: before the model load
    if FLAGS.online_distill and (FLAGS.num_processes > 1 or FLAGS.mesh):
        raise SpecjaxError("--online_distill trains one draft on one device; it does not combine with --mesh or "
                           "--num_processes > 1")
    return dict(k_buckets=ks, batch_buckets=bbs, slots=FLAGS.slots)


# ---------------------------------------------------------------- the job


def main(argv):
    cli.run_job(lambda: run(validate_flags()), argv)


def run(geom) -> int:
    replica = cli.init_distributed()  # (this process, processes): each serves its share of the records
    # The output is locked, repaired and scanned before the model load: a second job on it, or
    # an unwritable path, is a one-line error at once.
    with cli.open_job(replica=replica) as job:
        if not job.todo:
            job.notes()
            print(job.summary() + " (nothing to serve)", file=sys.stderr)
            code = 0
        else:
            code = serve(job, geom)
    if code == 0:
        cli.merge_job_replicas(replica)
    return code


def serve(job, geom) -> int:
    import dataclasses

    from specjax.engine.loop import ServingEngine, summarize
    from specjax.engine.scheduler import Request, Scheduler
    from specjax.errors import SpecjaxError
    from specjax.generate import validate_request
    from specjax.goodput import DraftPrefillGate
    from specjax.models.loader import load_model

    wall0 = time.perf_counter()
    layout = cli.layout_from_flags()
    model = load_model(FLAGS.model, FLAGS.dtype, layout=layout)  # (an HF directory: straight into the shards)
    print(f"[loaded {model.cfg.name} ({model.cfg.num_params() / 1e6:.0f}M params) in {model.load_seconds:.1f} s]",
          file=sys.stderr)
    if FLAGS.slots > model.cfg.max_position:  # (positions past the context; and a huge cache fails to allocate)
        raise SpecjaxError(f"--slots {FLAGS.slots} exceeds {model.cfg.name}'s context of {model.cfg.max_position}")
    tok = model.tokenizer
    if FLAGS.chat:
        tok.encode_chat("hi", FLAGS.system)  # a model without a chat template fails here, not on every record
    prefill_chunk, prefill_budget = cli.prefill_options_from_flags()
    drafts, draft = [], None
    if FLAGS.online_distill:  # the drafts its checkpoint directory names, trained while serving
        from specjax.distill.routing import open_drafts

        draft = load_model(FLAGS.draft_model) if FLAGS.drafter == "draft_model" else None
        router, drafts = open_drafts(FLAGS.online_distill, model.cfg, model.params, draft_layers=FLAGS.draft_layers,
                                     draft_model=draft, tags=FLAGS.distill_tags, clusters=FLAGS.distill_clusters)
    first = drafts[0][1] if drafts else None
    fwd = cli.forward_options_from_flags(model, mesh_ok=True)
    backend = registry.make_backend(model, FLAGS.drafter, fwd=fwd, **geom,
                                    prefill_chunk=prefill_chunk,
                                    **registry.backend_options([FLAGS.policy]),
                                    parts=None if first is None else {"draft": first.draft,
                                                                      "draft_params": first.params(first.trainable)},
                                    teacher_topk=FLAGS.distill_topk if drafts else 0, layout=layout,
                                    **cli.drafter_kwargs(model, FLAGS.drafter, max(geom["k_buckets"]), draft=draft))
    policy, policy_label = cli.policy_from_flags(model, FLAGS.drafter)
    md = None
    if drafts:  # each draft learns its own requests, with its own policy (its own acceptance estimate)
        import copy

        from specjax.distill.online import OnlineDistiller
        from specjax.distill.routing import MultiDraft

        tc, oc = cli.distill_configs_from_flags()
        md = MultiDraft(router, [OnlineDistiller(backend, copy.deepcopy(policy), td, tc, oc, checkpoints=ck)
                                 for _, td, ck in drafts])
        for (where, td, _), step, od in zip(drafts, md.resume(), md.distillers):
            print(f"[online distillation of {td.draft.label} in {where}: "
                  + (f"resumed from checkpoint {step} ({od.updates} updates, {od.finished} requests seen)]"
                     if step is not None else "a new draft]"), file=sys.stderr)
    gate = DraftPrefillGate() if policy_label.startswith("SmartSpec") else None
    check = Scheduler(backend.num_rows, backend.slots, backend.k_max + 1).check  # the engine's admission rule

    def prepare(rec):
        ids = tok.encode_chat(rec.prompt, FLAGS.system) if FLAGS.chat else tok.encode(rec.prompt)
        mnt = rec.fields["max_new_tokens"]
        validate_request(ids, mnt, model.cfg)
        req = Request("r", ids, mnt, cli.sampling_from_flags(rec.fields), arrival=0.0, ignore_eos=FLAGS.ignore_eos,
                      tag=rec.fields["tag"])
        try:
            check(req)
        except SpecjaxError as e:  # (the job layer names the line; the engine's request id means nothing here)
            raise SpecjaxError(str(e).removeprefix("request r: ")) from None
        return req

    warmed: set = set()
    runs = []  # (engine, outputs) of every engine run (one, unless a failure was retried)
    t = dict(compile=0.0, serve=0.0)
    n_tok = 0

    def generate(items, emit):
        nonlocal n_tok
        shapes = {(len(r.prompt), r.sampling.greedy) for r in items} - warmed
        if shapes:  # everything this run needs, compiled before serving (a retry needs nothing new)
            t0 = time.perf_counter()
            backend.warmup(prompt_lens=sorted({n for n, _ in shapes}),
                           greedy_modes=tuple(sorted({g for _, g in shapes}, reverse=True)), progress=True)
            t["compile"] += time.perf_counter() - t0
            warmed.update(shapes)
            job.note(f"[compiled {len(backend.table)} executables in {t['compile']:.1f} s; serving {len(items)} "
                     f"requests, policy {policy_label}, drafter {FLAGS.drafter}, {backend.num_rows} KV rows x "
                     f"{backend.slots} slots]")

        def on_finish(o):
            nonlocal n_tok
            i = int(o.id)
            if o.error is not None:
                emit(i, error=o.error)
            else:
                n_tok += len(o.tokens)
                emit(i, result={"output": tok.decode(o.tokens), "output_ids": [int(x) for x in o.tokens],
                                "num_prompt_tokens": o.prompt_len, "num_tokens": len(o.tokens),
                                "finish_reason": o.finish_reason})
            if md is not None:  # after the record is on disk: an update never delays a result
                md.on_finish(o)

        backend.reset()  # a fresh live state (also after a failed run)
        reqs = [dataclasses.replace(r, id=str(i)) for i, r in enumerate(items)]
        if md is not None:
            md.expect(reqs)
        engine = ServingEngine(backend, policy, eos_ids=tok.eos_ids, prefill_gate=gate, on_finish=on_finish,
                               prefill_budget=prefill_budget, should_stop=job.should_stop,
                               on_step=None if md is None else md.on_step, drafts=md)
        t0 = time.perf_counter()
        try:
            runs.append((engine, engine.run(reqs)))
        finally:
            t["serve"] += time.perf_counter() - t0

    code = job.serve(prepare, generate)
    if md is not None:
        for (where, _, _), od, saved in zip(drafts, md.distillers, md.save()):
            print(f"[online distillation: {od.updates} updates ({od.idle_updates} between steps at light load, "
                  f"{od.dropped} dropped), {od.update_s:.1f} s = {100 * od.update_s / max(t['serve'], 1e-9):.1f}% of "
                  f"serving; " + (f"checkpoint {saved} in {where}]" if saved is not None else
                                  "nothing to checkpoint]"), file=sys.stderr)
    wall = time.perf_counter() - wall0
    serve_s = t["serve"]
    print(f"{n_tok} tokens in {serve_s:.1f} s serving = {n_tok / max(serve_s, 1e-9):.1f} tok/s "
          f"(+ {t['compile']:.1f} s compilation; {wall:.1f} s wall in all)", file=sys.stderr)
    outputs = [o for _, outs in runs for o in outs]
    s = summarize(outputs, [st for eng, _ in runs for st in eng.steps]) if outputs else None
    if s and s["requests"] - s["errors"]:
        print(f"latency mean {s['mean_latency_s']:.2f} s, p90 {s['p90_latency_s']:.2f} s (queueing included); "
              f"acceptance rate {s['acceptance_rate']:.3f}; mean K {s['mean_k']:.2f}; mean batch "
              f"{s['mean_batch']:.2f} over {s['steps']} steps; policy {policy_label}", file=sys.stderr)
    return code


if __name__ == "__main__":
    define_flags()
    app.run(main)
