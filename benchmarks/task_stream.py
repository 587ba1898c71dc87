"""What the online distillation benchmarks share (online_distill.py: task blocks in order, the
distribution shifting at each boundary; multi_draft.py: the same blocks interleaved): prompt
streams from ../shared/data, their flags, the training schedule and the serving backend."""

from __future__ import annotations

import json
import os

from absl import flags


def _jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def stream(data_dir: str, blocks):
    """[(block name, text)] in block order; a block is "name:count" with name one of gsm8k
    (GSM8K train questions), gsm8k2 (the same file from its end: other questions), humaneval
    (HumanEval prompts), specbench (Spec-Bench first turns, file order)."""
    gsm = [r["question"] for r in _jsonl(os.path.join(data_dir, "gsm8k", "train.jsonl"))]
    he = [r["prompt"] for r in _jsonl(os.path.join(data_dir, "humaneval", "HumanEval.jsonl"))]
    sb = [r["turns"][0] for r in _jsonl(os.path.join(data_dir, "spec_bench", "question.jsonl"))]
    sources = {"gsm8k": gsm, "gsm8k2": gsm[::-1], "humaneval": he, "specbench": sb}
    out = []
    for b in blocks:
        name, n = b.split(":")
        out += [(name, t) for t in sources[name][:int(n)]]
    return out


def define_stream_flags(blocks, draft_layers: int, every: int, steps: int, lr: float) -> None:
    """The flags both stream benchmarks share: the prompts, the draft, the online schedule."""
    flags.DEFINE_string("data_dir", "../shared/data", "The shared prompt sets.")
    flags.DEFINE_list("blocks", blocks, "Task blocks (name:count).")
    flags.DEFINE_integer("draft_layers", draft_layers, "Layers of the self-draft.")
    flags.DEFINE_integer("k", 3, "Drafts per step.")
    flags.DEFINE_integer("max_new_tokens", 32, "Tokens per answer.")
    flags.DEFINE_integer("max_prompt", 384, "Prompts longer than this many tokens keep their last ones.")
    flags.DEFINE_integer("every", every, "Finished requests between updates (the seed's I).")
    flags.DEFINE_integer("steps", steps, "Optimizer steps per update.")
    flags.DEFINE_float("lr", lr, "Peak learning rate.")
    flags.DEFINE_integer("batch", 8, "Records per optimizer step.")
    flags.DEFINE_integer("length", 64, "Tokens per record in a batch.")
    flags.DEFINE_integer("teacher_topk", 8, "Teacher logits kept per verified position.")


def online_configs(drafts: int = 1, checkpoint_every: int = 0):
    """(TrainConfig, OnlineConfig) of the flags; with several drafts each updates after every/n
    of its own requests, so each gets as many updates as a single draft does."""
    from specjax.distill.online import OnlineConfig
    from specjax.distill.train import TrainConfig

    return (TrainConfig(lr=flags.FLAGS.lr, warmup_steps=4, total_steps=10_000),
            OnlineConfig(every=max(1, flags.FLAGS.every // drafts), steps=flags.FLAGS.steps, batch=flags.FLAGS.batch,
                         length=flags.FLAGS.length, checkpoint_every=checkpoint_every))


def stream_backend(model, draft):
    """The backend both benchmarks serve on: batch 4, 512 slots, K in {0, --k}, the steps keeping
    the target's top-k for the draft (a distill.train.TrainableDraft) to learn from."""
    from specjax import registry

    return registry.make_backend(model, "layer_skip", k_buckets=(0, flags.FLAGS.k), batch_buckets=(4,), slots=512,
                                 teacher_topk=flags.FLAGS.teacher_topk,
                                 parts={"draft": draft.draft, "draft_params": draft.params(draft.trainable)})
