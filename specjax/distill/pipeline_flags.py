"""launch/distill.py's flags for feature heads (the warm-up rounds' and ``--pipeline``'s) and the
``--pipeline`` entry point: light to import (absl only; the pipeline's modules load when it
runs, after the flags are checked)."""

from __future__ import annotations


def define_flags() -> None:
    """launch/distill.py's flags for feature heads: the warm-up rounds' (distill.heads_offline)
    and the pipeline's (``--pipeline``)."""
    from absl import flags

    flags.DEFINE_integer("medusa_heads", 4, "medusa: how many heads (the largest K it drafts).")
    flags.DEFINE_integer("eagle_mlp_width", 0, "eagle: the head's MLP width, a multiple of 32 (0: the target's); "
                         "with --init_head of a narrower head, that head grown to it, computing the same function.")
    flags.DEFINE_integer("eagle_layers", 1, "eagle: the head's decoder layers (EAGLE's is 1; more are shaped like the "
                         "target's); with --init_head of a shallower head, that head with new layers that pass their "
                         "input through until trained.")
    flags.DEFINE_integer("unroll", 3, "eagle: training-time-test steps past the teacher-forced pass (the head on "
                         "its own predicted features, as it drafts).")
    flags.DEFINE_integer("round_prompts", 0, "heads: --input_jsonl training prompts written per round (0: all in "
                         "round 1, then the same data every round); later rounds take the next ones, cycling.")
    flags.DEFINE_integer("self_prompts", 0, "heads: prompts per round the model writes itself from its chat "
                         "template's user prefix (sampled at T = 1), then answers (needs --chat); --pipeline: in all.")
    flags.DEFINE_integer("self_prompt_tokens", 48, "heads: the longest self-written prompt, in tokens.")
    flags.DEFINE_string("self_prompt_starters", None, "--pipeline: a file of openings, one a line, that the "
                        "self-written prompts start from, spread over them (the model continues each; say "
                        "configs/data/chat_starters.txt).")
    flags.DEFINE_bool("shared_head", True, "heads: the reduced head's rows are the target's own (not trained, not "
                      "saved); --noshared_head trains (and saves) them.")
    flags.DEFINE_string("answer_field", None, "heads: a line's non-blank text in this field is its answer, trained on "
                        "teacher-forced instead of one the target writes (no generation: many more tokens per CPU "
                        "second; the target's distribution at every position is still the teacher).")
    flags.DEFINE_bool("prompt_loss", False, "heads: also train on the prompt's positions (the target's distribution "
                      "of each next prompt token; the head drafts only in answers, but learns the target from more).")
    flags.DEFINE_string("texts_from", None, "heads: start from the text an earlier head run had the target write "
                        "(its checkpoint's state/texts.npz), its features recomputed (no generation).")
    flags.DEFINE_enum("head_dtype", "bfloat16", ["bfloat16", "float32"], "heads: the dtype the head is saved in.")
    # the pipeline (distill.head_pipeline, distill.head_data)
    flags.DEFINE_enum("pipeline", None, ["data", "train", "all"], "heads: instead of rounds, write a data set to "
                      "--data_dir (resumable by shard), train on it for a token or time budget (resumable exactly), "
                      "or both (specjax.distill.head_pipeline).")
    flags.DEFINE_string("data_dir", None, "--pipeline: the data set (verified shards of features and top-k teacher); "
                        "--pipeline train: several, comma-separated, trained on as one (the first one's held-out shard).")
    flags.DEFINE_list("prompt_files", [], "--pipeline: JSONL prompt files, PATH or PATH:FIELD (default: a prompt, "
                      "question, instruction or text field, or Spec-Bench's first turn).")
    flags.DEFINE_integer("answers_per_prompt", 1, "--pipeline: answers the target writes per file prompt (the "
                         "temperatures cycling).")
    flags.DEFINE_list("temperatures", ["0", "0.7", "1.0"], "--pipeline: the answers' temperatures, cycling (0: "
                      "greedy); every answer is sampled with a seed of its own.")
    flags.DEFINE_integer("shard_size", 128, "--pipeline: sequences per data shard (the unit a killed generation "
                         "loses).")
    flags.DEFINE_integer("gen_batch", 32, "--pipeline: the engine's largest batch bucket while writing answers.")
    flags.DEFINE_integer("eval_sequences", 64, "--pipeline: held-out sequences (greedy answers to prompts no "
                         "training shard has).")
    flags.DEFINE_string("data_texts_from", None, "--pipeline: the text of another data set (say an eagle one for a "
                        "medusa head), its features recomputed: no generation.")
    flags.DEFINE_float("train_tokens", 0, "--pipeline: the training budget in trained positions, which plans the "
                       "learning-rate schedule (0: --epochs passes over the data).")
    flags.DEFINE_float("epochs", 4, "--pipeline: passes over the data when --train_tokens is 0.")
    flags.DEFINE_float("time_budget_hours", 0, "--pipeline: stop (checkpointed, resumable) after this long (0: none).")
    flags.DEFINE_float("checkpoint_minutes", 5, "--pipeline: minutes between checkpoints (and at the end).")
    flags.DEFINE_integer("checkpoint_steps", 0, "--pipeline: also checkpoint every this many steps (0: off).")
    flags.DEFINE_integer("log_every", 50, "--pipeline: steps between progress lines.")
    flags.DEFINE_integer("eval_every", 500, "--pipeline: steps between held-out estimates on stored data (0: off).")
    flags.DEFINE_integer("engine_eval_every", 5000, "--pipeline: steps between held-out measurements through the "
                         "engine at K = --k (0: off).")
    flags.DEFINE_integer("data_parallel", 1, "--pipeline: devices the batch is split over (a data mesh; the head "
                         "replicated).")
    flags.DEFINE_integer("window_context", 64, "--pipeline: eagle: positions a window shares with the one before it, "
                         "read by the head's attention, not trained on again.")
    flags.DEFINE_string("init_head", None, "--pipeline train: a new run starts from this saved head (its weights "
                        "and draft vocabulary; say an earlier run's --checkpoint_dir) instead of a new one: fine-tuning "
                        "on more data. With --draft_vocab a shared head's vocabulary is counted again on this "
                        "run's data.")
    flags.DEFINE_float("warmup_fraction", 0.02, "--pipeline: linear learning-rate warm-up, as a fraction of the "
                       "planned steps.")


# (flag, its least value) of the flags define_flags adds that take integers
LOWEST = (("unroll", 0), ("round_prompts", 0), ("self_prompts", 0), ("self_prompt_tokens", 1), ("medusa_heads", 1),
          ("eagle_mlp_width", 0), ("eagle_layers", 1))


def check_ranges() -> None:
    """A one-line SpecjaxError for a flag of ``define_flags`` below its least value."""
    from specjax import cli

    for name, lo in LOWEST:
        cli.check_range(name, lo)


def run_from_flags(FLAGS, kind, spec) -> int:
    """``launch/distill.py --pipeline``: the settings from the flags (a one-line SpecjaxError for
    a mistake, before the model loads), then the data set and / or the training."""
    import jax

    from specjax import cli
    from specjax.distill.head_data import DataSet, DataSettings, build_data, read_starters
    from specjax.distill.head_pipeline import RunConfig, print_vocab_table, say, train
    from specjax.errors import SpecjaxError, require

    require(kind is not None, f"--pipeline trains a feature head: --drafter eagle or medusa, not {FLAGS.drafter}")
    require(FLAGS.data_dir, "--pipeline needs --data_dir")
    require(FLAGS.pipeline == "train" or "," not in FLAGS.data_dir, "--pipeline data and all write one data set: "
            "one --data_dir (several, comma-separated, are for --pipeline train)")
    require(FLAGS.pipeline == "data" or FLAGS.checkpoint_dir, f"--pipeline {FLAGS.pipeline} needs --checkpoint_dir")
    require(not FLAGS.input_jsonl, "--pipeline reads --prompt_files (PATH or PATH:FIELD), not --input_jsonl")
    require(not (FLAGS.answer_field or FLAGS.texts_from or FLAGS.round_prompts),
            "--answer_field, --texts_from and --round_prompts are the warm-up rounds'; --pipeline writes its data set")
    try:
        temps = tuple(float(t) for t in FLAGS.temperatures)
    except ValueError:
        raise SpecjaxError(f"--temperatures must be numbers, got {FLAGS.temperatures}") from None
    st = DataSettings(prompt_files=tuple(FLAGS.prompt_files), self_prompts=FLAGS.self_prompts,
                      self_prompt_tokens=FLAGS.self_prompt_tokens, answers_per_prompt=FLAGS.answers_per_prompt,
                      temperatures=temps, max_new_tokens=FLAGS.max_new_tokens, max_prompt=FLAGS.max_prompt,
                      chat=FLAGS.chat, system=FLAGS.system, topk=FLAGS.topk, eval_sequences=FLAGS.eval_sequences,
                      shard_size=FLAGS.shard_size, seed=FLAGS.seed, texts_from=FLAGS.data_texts_from,
                      gen_batch=FLAGS.gen_batch,
                      self_prompt_starters=read_starters(FLAGS.self_prompt_starters) if FLAGS.self_prompt_starters
                      else ())
    if FLAGS.pipeline != "train":
        st.check()
    settings = {setting: FLAGS[option].value for setting, option in kind.options}
    rc = RunConfig(checkpoint_dir=FLAGS.checkpoint_dir, batch=FLAGS.distill_batch, window=FLAGS.distill_length,
                   context=FLAGS.window_context, train_tokens=FLAGS.train_tokens, epochs=FLAGS.epochs,
                   time_budget_hours=FLAGS.time_budget_hours, checkpoint_minutes=FLAGS.checkpoint_minutes,
                   checkpoint_steps=FLAGS.checkpoint_steps, log_every=FLAGS.log_every, eval_every=FLAGS.eval_every,
                   engine_eval_every=FLAGS.engine_eval_every, eval_prompts=FLAGS.eval_prompts, k=FLAGS.k,
                   unroll=FLAGS.unroll, seed=FLAGS.seed, data_parallel=FLAGS.data_parallel,
                   draft_vocab=FLAGS.draft_vocab, shared_head=FLAGS.shared_head, head_dtype=FLAGS.head_dtype,
                   prompt_loss=FLAGS.prompt_loss, warmup_fraction=FLAGS.warmup_fraction, plot=FLAGS.plot,
                   init_head=FLAGS.init_head,
                   settings=tuple(sorted(settings.items())))
    if FLAGS.pipeline != "data":
        rc.check()
    if kind.check is not None:
        kind.check(FLAGS.k, settings)
    tc, _ = cli.distill_configs_from_flags(full_teacher=False)
    if FLAGS.data_parallel > len(jax.devices()):
        raise SpecjaxError(f"--data_parallel {FLAGS.data_parallel} needs {FLAGS.data_parallel} devices; "
                           f"{len(jax.devices())} {jax.devices()[0].platform} device(s) present")
    model, spec = cli.load_target(spec)
    if FLAGS.pipeline == "train":
        ds = DataSet.union([DataSet.open(d, say) for d in FLAGS.data_dir.split(",")])
    else:
        ds = build_data(model, FLAGS.data_dir, st, kind.features(model.cfg, **settings), fwd=spec.fwd, log=say)
    if FLAGS.pipeline == "data":
        print_vocab_table(kind, model, ds, settings, FLAGS.shared_head)
        return 0
    train(kind, model, ds, rc, tc)
    return 0
