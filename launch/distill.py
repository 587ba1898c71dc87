"""Warm-up distillation of a draft before serving (seed 003, Algorithm 1 line 2).

  python launch/distill.py --input_jsonl prompts.jsonl --checkpoint_dir ck --chat --draft_layers 8
  python launch/distill.py --input_jsonl prompts.jsonl --checkpoint_dir ck --drafter draft_model --draft_model d.gguf
  python launch/distill.py --input_jsonl prompts.jsonl --checkpoint_dir ck --chat --draft_vocab 8192 \\
      --sampling mixed --mix_beta 0.5 --rounds 3 --plot distill.png
  # then serve with it, and go on training online:
  python launch/batch.py --input_jsonl jobs.jsonl --output_jsonl out.jsonl --chat \\
      --drafter layer_skip --online_distill ck

Reads prompts (a JSONL with a ``prompt`` text, or ``--field``, per line), keeps the last
``--eval_prompts`` aside, and runs ``--rounds`` rounds of data sampling (``--sampling``) then
``--steps`` optimizer steps, printing the mean loss and the held-out greedy acceptance at K =
``--k`` after each (specjax.distill.offline). The draft goes to ``--checkpoint_dir`` (orbax, with
``draft.json`` naming it), where the batch job's ``--online_distill`` starts from it; ``--plot``
draws loss per step and acceptance per round.

A feature head (``--drafter eagle`` / ``medusa``) trains the same way on the target's own text
and features (specjax.distill.heads_offline); the same command with a larger ``--rounds`` resumes:

  python launch/distill.py --drafter eagle --chat --input_jsonl prompts.jsonl --self_prompts 32 \\
      --round_prompts 16 --draft_vocab 4096 --checkpoint_dir head --rounds 30 --steps 60 --plot head.png
  python launch/generate.py --chat --drafter eagle --eagle_head head --prompt "..."

For hours of training on a data set of verified shards, resumable exactly, add ``--pipeline``
(specjax.distill.head_pipeline's docstring has the commands).

User mistakes print one line ("error: ...") and exit with status 2.
"""

from __future__ import annotations

import dataclasses
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

from specjax import cli, registry  # noqa: E402
from specjax.distill import pipeline_flags  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("input_jsonl", None, "Prompts: one JSON object with a --field text per line.")
    flags.DEFINE_string("field", "prompt", "The text field of each --input_jsonl line.")
    flags.DEFINE_string("checkpoint_dir", None, "Where the trained draft goes (orbax checkpoints + draft.json).")
    cli.define_model_flags()
    cli.define_drafter_flags("layer_skip")
    cli.define_prompt_flags()
    flags.DEFINE_integer("draft_vocab", 0, "Reduced-vocabulary head of this many tokens (0: the full head; "
                         "--pipeline: the smallest reaching its coverage target, measured).")
    flags.DEFINE_integer("limit", 0, "Use the first N prompts (0: all).")
    flags.DEFINE_integer("max_prompt", 384, "Prompts longer than this many tokens keep their last ones.")
    flags.DEFINE_integer("max_new_tokens", 64, "Tokens sampled per prompt.")
    flags.DEFINE_enum("sampling", "teacher", ["teacher", "student", "mixed"], "Who writes the distillation data.")
    flags.DEFINE_float("mix_beta", 0.5, "--sampling mixed: each token from beta p + (1 - beta) q.")
    flags.DEFINE_float("sample_temperature", 0.0, "Temperature of the data sampling (0: the mixture's argmax).")
    flags.DEFINE_enum("teacher", "topk", ["topk", "full"], "Train on the kept top-k (fkl, tvd) or on the target's "
                      "whole distribution recomputed per batch (every divergence).")
    flags.DEFINE_integer("topk", 8, "Teacher logits kept per position (--teacher topk).")
    flags.DEFINE_integer("rounds", 2, "Rounds of data sampling then training.")
    flags.DEFINE_integer("steps", 60, "Optimizer steps per round.")
    flags.DEFINE_integer("eval_prompts", 16, "Held-out prompts (the file's last) for the acceptance rate.")
    flags.DEFINE_integer("k", 3, "Drafts per step when measuring acceptance.")
    flags.DEFINE_integer("seed", 0, "Data sampling and batch order seed.")
    flags.DEFINE_string("plot", None, "Write a loss / acceptance plot here (PNG).")
    pipeline_flags.define_flags()  # --drafter eagle / medusa: the rounds' flags and --pipeline's
    cli.define_distill_flags(online=False)


def validate_flags():
    """(engine spec, the head kind or None, the WarmUp settings, the TrainConfig), or a SpecjaxError."""
    from specjax.distill.offline import WarmUp
    from specjax.errors import SpecjaxError

    kind = registry.entry(FLAGS.drafter).head_kind()
    opts = WarmUp(**{f.name: FLAGS[f.name].value for f in dataclasses.fields(WarmUp)})
    for name, lo in (("rounds", 1), ("steps", 1), ("max_new_tokens", 1), ("max_prompt", 1), ("topk", 1),
                     ("k", 1), ("eval_prompts", 1), ("draft_vocab", 0), ("limit", 0), ("distill_batch", 1),
                     ("distill_length", 2)):
        cli.check_range(name, lo)
    pipeline_flags.check_ranges()
    cli.check_range("mix_beta", 0.0, 1.0)
    cli.check_range("sample_temperature", 0.0)
    opts.check(kind)
    tc, _ = cli.distill_configs_from_flags(FLAGS.rounds * FLAGS.steps, full_teacher=FLAGS.teacher == "full")
    spec = cli.engine_spec_from_flags(policy="none")
    if not registry.entry(spec.drafter.name).trains:  # (host drafters have no parameters)
        raise SpecjaxError(f"launch/distill.py trains a device draft ({', '.join(registry.TRAINED_DRAFTERS)}); "
                           f"drafter {spec.drafter.name} has nothing it can train")
    if spec.drafter.draft_checkpoint:
        raise SpecjaxError("--draft_checkpoint serves a distilled draft; distill.py writes one to --checkpoint_dir")
    return spec, kind, opts, tc


def run() -> int:
    if FLAGS.pipeline:
        return pipeline_flags.run_from_flags(FLAGS, registry.entry(FLAGS.drafter).head_kind(),
                                             cli.engine_spec_from_flags(policy="none"))
    spec, kind, opts, tc = validate_flags()

    def load_target():
        return cli.load_target(spec)[0]

    if kind is not None:
        from specjax.distill.heads_offline import train_head

        return train_head(kind, opts, tc, load_target)
    from specjax.distill.offline import train_draft

    return train_draft(opts, tc, load_target, spec.drafter.name, draft_model=spec.drafter.draft_model,
                       dtype=spec.dtype)


def main(argv):
    cli.run_job(run, argv)


if __name__ == "__main__":
    define_flags()
    app.run(main)
