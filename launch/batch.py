"""Batch offline inference on the continuous-batching engine: JSONL in, JSONL out.

  python launch/batch.py --input_jsonl in.jsonl --output_jsonl out.jsonl --chat
  python launch/batch.py --input_jsonl in.jsonl --output_jsonl out.jsonl --chat --drafter layer_skip --draft_layers 8
  python launch/batch.py --input_jsonl in.jsonl --output_jsonl out.jsonl --chat --policy 4 --num_spec_tokens 4
  python launch/batch.py --input_jsonl in.jsonl --output_jsonl out.jsonl --drafter none          # no speculation

The job (input and output records, errors, resume, continuous batching, executables compiled
when first reached and ahead in the background) is specjax.serve_job's, as for
launch/generate.py's JSONL mode.

Speculation (``--policy``): ``auto`` uses SmartSpec's goodput selector when ``--perf_models``
has a performance model for this model, drafter, hardware and compiled code (make one with
launch/profile.py and the same forward flags), else a fixed K = ``--num_spec_tokens`` (said on stderr); ``smartspec``
requires the model; ``none`` is K = 0; an integer is that fixed K (one of ``--k_buckets``).
Greedy outputs are the target model's greedy outputs whatever the policy (lossless).

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
With ``--drafter eagle`` or ``medusa`` the head is refined the same way (specjax.distill.head_online:
every ``--distill_every`` finished requests a teacher-forced target forward over them gives its
data, ``--distill_steps`` steps train it) from the head in DIR, if any, and saved to DIR at the end.

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

import dataclasses
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
    cli.define_model_flags()
    cli.define_drafter_flags("prompt_lookup", num_spec_tokens=3, k_buckets="0,1,2,3,4,5")
    cli.define_engine_flags(slots=0)
    cli.define_request_flags()
    cli.define_forward_flags()
    cli.define_distributed_flags()
    cli.define_policy_flags()
    cli.define_distill_flags()


def validate_flags():
    """Every check that needs no model (before the slow load). Returns the EngineSpec."""
    from specjax.errors import SpecjaxError

    if not FLAGS.input_jsonl:
        raise SpecjaxError("--input_jsonl is required")
    if not FLAGS.output_jsonl:
        raise SpecjaxError("--output_jsonl is required")
    if FLAGS.system and not FLAGS.chat:
        raise SpecjaxError("--system needs --chat")
    cli.request_defaults()  # --max_new_tokens and the sampling flags
    cli.prefill_budget_from_flags()
    cli.drafters_from_flags()
    spec = cli.engine_spec_from_flags(mesh_ok=True)
    cli.check_online_distill_flags(FLAGS.drafter)
    if FLAGS.num_processes == 1:  # (several: jax.distributed must start before jax looks at devices)
        registry.layout(spec)  # more devices than present: before the model load
    if FLAGS.online_distill and (FLAGS.num_processes > 1 or FLAGS.mesh):
        raise SpecjaxError("--online_distill trains one draft on one device; it does not combine with --mesh or "
                           "--num_processes > 1")
    return spec


def main(argv):
    cli.run_job(lambda: run(validate_flags()), argv)


def run(spec) -> int:
    return cli.run_jsonl_job(lambda job: serve(job, spec))


def serve(job, spec) -> int:
    from specjax.errors import SpecjaxError
    from specjax.models.loader import load_model
    from specjax.serve_job import serve_job

    layout = registry.layout(spec)
    model, spec = cli.load_target(spec, layout)
    if spec.slots > model.cfg.max_position:  # (positions past the context; and a huge cache fails to allocate)
        raise SpecjaxError(f"--slots {spec.slots} exceeds {model.cfg.name}'s context of {model.cfg.max_position}")
    drafts, draft = [], None
    kind = registry.entry(FLAGS.drafter).head_kind()  # (a feature head: refined while serving)
    head_dir = FLAGS.online_distill if FLAGS.online_distill and kind is not None else None
    if head_dir:  # a feature head refined while serving: from its directory when it holds one
        import os

        if os.path.exists(os.path.join(head_dir, kind.file)):
            spec = dataclasses.replace(spec, drafter=dataclasses.replace(spec.drafter, **{f"{kind.name}_head": head_dir}))
        spec = spec if spec.slots else dataclasses.replace(spec, slots=512)  # (one backend, refined in place)
    elif FLAGS.online_distill:  # the drafts its checkpoint directory names, trained while serving
        from specjax.distill.routing import open_drafts

        draft = load_model(spec.drafter.draft_model) if spec.drafter.draft_model else None
        router, drafts = open_drafts(FLAGS.online_distill, model.cfg, model.params, draft_layers=FLAGS.draft_layers,
                                     draft_model=draft, tags=FLAGS.distill_tags, clusters=FLAGS.distill_clusters)
    first = drafts[0][1] if drafts else None
    if drafts and not spec.slots:  # (online distillation trains on one backend's steps: one row size)
        spec = dataclasses.replace(spec, slots=512)
    if not spec.slots:  # KV rows sized from the job's records (serve_job's slot classes)
        def backend(slots):
            return registry.build_backend(dataclasses.replace(spec, slots=slots), model, draft=draft, layout=layout)
    else:
        backend = registry.build_backend(spec, model, draft=draft, layout=layout,
                                         teacher_topk=FLAGS.distill_topk if drafts else 0,
                                         parts=None if first is None else {"draft": first.draft,
                                                                           "draft_params": first.params(first.trainable)})
    policy, policy_label = cli.policy_from_spec(spec, model)
    md = None
    if head_dir:
        from specjax.distill.head_online import HeadRefiner

        tc, oc = cli.distill_configs_from_flags()
        md = HeadRefiner(backend, policy, model.cfg, model.params, tc, oc, topk=FLAGS.distill_topk)
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
    t0 = time.perf_counter()
    code = serve_job(job, model, backend, policy, policy_label, drafter=spec.drafter.name, chat=FLAGS.chat,
                     system=FLAGS.system, ignore_eos=FLAGS.ignore_eos, drafts=md, **cli.serving_from_flags())
    if head_dir:
        md.save(head_dir)
        job_s = time.perf_counter() - t0
        print(f"[online head refinement: {md.updates} updates ({md.dropped} dropped), {md.update_s:.1f} s = "
              f"{100 * md.update_s / max(job_s, 1e-9):.1f}% of the job; the head saved to {head_dir}]", file=sys.stderr)
    elif md is not None:
        job_s = time.perf_counter() - t0
        for (where, _, _), od, saved in zip(drafts, md.distillers, md.save()):
            print(f"[online distillation: {od.updates} updates ({od.idle_updates} between steps at light load, "
                  f"{od.dropped} dropped), {od.update_s:.1f} s = {100 * od.update_s / max(job_s, 1e-9):.1f}% of "
                  f"the job; " + (f"checkpoint {saved} in {where}]" if saved is not None else
                                  "nothing to checkpoint]"), file=sys.stderr)
    return code


if __name__ == "__main__":
    define_flags()
    app.run(main)
