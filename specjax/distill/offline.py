"""Warm-up distillation before serving (seed 003, Algorithm 1 line 2; ``launch/distill.py``): a
self-draft or a draft model trained offline for ``rounds`` rounds, each sampling data on the
training prompts and taking ``steps`` optimizer steps on it, the held-out greedy acceptance
measured after every round. Feature heads have their own pipeline (``distill.heads_offline``);
the two share the settings (``WarmUp``), the prompts and the step loop here.

Data (``distill.data.sample_records``): the target writes (teacher), the draft writes (student)
or a token-level mixture (mixed); the target's top-k logits are kept at every output position, as
serving keeps them. ``teacher="full"`` recomputes the target's whole distribution for each batch
instead (slower; what rkl and jsd need). A reduced head (``draft_vocab``) takes the tokens the
target most often puts first on round 1's data. The trained draft goes to ``checkpoint_dir``
(``distill.checkpoint.open_draft``), where the batch job's online distillation starts from it.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Callable

import numpy as np

from specjax.errors import SpecjaxError


def say(msg: str) -> None:
    print(msg, file=sys.stderr)


def prompt_encoder(model, chat: bool, system: str | None, max_prompt: int, max_new_tokens: int
                   ) -> Callable[[str], list[int]]:
    """Text -> prompt tokens (chat-templated with ``chat``), the last ones kept where it is longer
    than ``max_prompt`` or than the context leaves room for after ``max_new_tokens``."""
    tok = model.tokenizer
    cut = min(max_prompt, model.cfg.max_position - max_new_tokens)

    def encode(text: str) -> list[int]:
        return (tok.encode_chat(text, system) if chat else tok.encode(text))[-cut:]

    return encode


@dataclasses.dataclass(frozen=True)
class WarmUp:
    """A warm-up run's settings. Each is named as launch/distill.py's flag for it, whose help
    says what it does (no defaults here: the flags are the one place that sets them)."""

    checkpoint_dir: str | None
    input_jsonl: str | None
    field: str
    limit: int
    chat: bool
    system: str | None
    max_prompt: int
    max_new_tokens: int
    draft_vocab: int
    draft_layers: int
    sampling: str
    mix_beta: float
    sample_temperature: float
    teacher: str
    topk: int
    rounds: int
    steps: int
    eval_prompts: int
    k: int
    seed: int
    plot: str | None
    distill_batch: int
    distill_length: int
    # feature heads only (distill.heads_offline)
    medusa_heads: int
    eagle_mlp_width: int
    eagle_layers: int
    unroll: int
    round_prompts: int
    self_prompts: int
    self_prompt_tokens: int
    shared_head: bool
    answer_field: str | None
    prompt_loss: bool
    texts_from: str | None
    head_dtype: str

    def check(self, kind=None) -> None:
        """What is wrong with these settings for training a head of ``kind`` (a HeadKind; None: a
        draft), before anything slow: a one-line SpecjaxError."""
        from specjax import registry
        from specjax.distill.checkpoint import DRAFT_FILE

        head = kind is not None
        for name in ("checkpoint_dir",) if head else ("input_jsonl", "checkpoint_dir"):
            if not getattr(self, name):
                raise SpecjaxError(f"--{name} is required")
        heads = " / ".join(registry.HEAD_DRAFTERS)
        if head and not self.input_jsonl and not self.self_prompts:
            raise SpecjaxError(f"--drafter {kind.name} needs prompts: --input_jsonl and/or --self_prompts")
        if self.texts_from and not head:
            raise SpecjaxError(f"--texts_from trains a head (--drafter {heads}) on an earlier head run's text")
        if self.answer_field and not (head and self.input_jsonl):
            raise SpecjaxError(f"--answer_field reads answers for --drafter {heads} from --input_jsonl")
        if head and self.self_prompts and not self.chat:
            raise SpecjaxError("--self_prompts writes prompts from the chat template: it needs --chat")
        if head and self.sampling != "teacher":
            raise SpecjaxError(f"--drafter {kind.name} trains on the target's own text: --sampling teacher")
        if head and self.teacher != "topk":
            raise SpecjaxError(f"--drafter {kind.name} trains on the target's top-k kept per position: --teacher topk")
        if head and kind.check is not None:
            kind.check(self.k, self.head_settings(kind))
        if self.system and not self.chat:
            raise SpecjaxError("--system needs --chat")
        if not head and os.path.exists(os.path.join(self.checkpoint_dir, DRAFT_FILE)):
            raise SpecjaxError(f"{self.checkpoint_dir} already holds a draft; give a new --checkpoint_dir")

    def head_settings(self, kind) -> dict:
        """The settings of a new head of ``kind`` these options give (HeadKind.options)."""
        return {setting: getattr(self, option) for setting, option in kind.options}

    def read_texts(self) -> list[str]:
        """The prompt texts of ``input_jsonl`` (none without one)."""
        from specjax.jobs import read_outputs

        if not self.input_jsonl:
            return []
        return read_outputs(self.input_jsonl, flag="--input_jsonl", limit=self.limit, field=self.field)

    def encoder(self, model) -> Callable[[str], list[int]]:
        return prompt_encoder(model, self.chat, self.system, self.max_prompt, self.max_new_tokens)

    def prompts(self, model, texts) -> list[list[int]]:
        prompts = [self.encoder(model)(t) for t in texts]
        if any(not p for p in prompts):
            raise SpecjaxError(f"{self.input_jsonl} has an empty prompt")
        return prompts

    def check_vocab(self, cfg) -> None:
        if self.draft_vocab > cfg.vocab_size:
            raise SpecjaxError(f"--draft_vocab {self.draft_vocab} exceeds {cfg.name}'s {cfg.vocab_size} tokens")


def train_draft(opts: WarmUp, tc, load_target: Callable, drafter: str, draft_model: str | None = None,
                dtype: str = "float32", log: Callable[[str], None] = say) -> int:
    """Warm up a self-draft (``draft_layers``) or the draft model ``draft_model`` (loaded in
    ``dtype``) toward the target ``load_target()`` returns (a LoadedModel; called once the
    prompts are read, so a bad file fails first), as the module docstring says; ``tc``: a
    train.TrainConfig; ``drafter``: the kind's name, for the plot. Returns 0."""
    from functools import partial

    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    from specjax import plots
    from specjax.distill import data as dd
    from specjax.distill import train as tr
    from specjax.distill.buffer import ReplayBuffer
    from specjax.distill.checkpoint import open_draft
    from specjax.distill.divergences import TopK
    from specjax.drafters.device import ModelDraft, frequent_tokens, layer_skip
    from specjax.models.loader import load_model
    from specjax.spec_generate import SpecGenerator, SpecStats

    texts = opts.read_texts()
    if len(texts) < opts.eval_prompts + 1:
        raise SpecjaxError(f"{opts.input_jsonl} has {len(texts)} prompts: need more than --eval_prompts "
                           f"({opts.eval_prompts}) to train on")
    model = load_target()
    cfg, tok = model.cfg, model.tokenizer
    draft = load_model(draft_model, dtype) if draft_model else None
    if draft is None and not 1 <= opts.draft_layers < cfg.num_layers:
        raise SpecjaxError(f"--draft_layers must be in 1..{cfg.num_layers - 1} for {cfg.name}, "
                           f"got {opts.draft_layers}")
    opts.check_vocab(cfg)
    prompts = opts.prompts(model, texts)
    train_p, eval_p = prompts[:-opts.eval_prompts], prompts[-opts.eval_prompts:]
    log(f"[{cfg.name}: {len(train_p)} training prompts, {len(eval_p)} held out; {opts.sampling} sampling, "
        f"{draft.cfg.name if draft else f'{opts.draft_layers}-layer self-'} draft]")
    opt = tr.make_optimizer(tc)

    def sample(d, dparams, rnd):
        with tqdm(total=len(train_p), desc=f"round {rnd}: sampling", unit="prompt", disable=None) as bar:
            return dd.sample_records(cfg, model.params, d, dparams, train_p, max_new_tokens=opts.max_new_tokens,
                                     mode=opts.sampling, beta=opts.mix_beta, temperature=opts.sample_temperature,
                                     topk=opts.topk, eos_ids=tok.eos_ids, batch=8, seed=opts.seed + rnd,
                                     progress=bar.update)

    records, vocab = None, None
    if opts.draft_vocab:  # the target's most frequent first choices on round 1's data
        records = sample(*((ModelDraft(draft.cfg), draft.params) if draft else
                           layer_skip(cfg, model.params, opts.draft_layers)), 1)
        vocab = frequent_tokens([r.ids[:, 0] for r in records], cfg.vocab_size, opts.draft_vocab, keep=tok.eos_ids)
    sd, checkpoints = open_draft(opts.checkpoint_dir, cfg, model.params, opts.draft_layers, vocab, draft_model=draft)
    trainable, state = sd.trainable, opt.init(sd.trainable)
    gen = SpecGenerator(cfg, model.params, draft=sd.draft, draft_params=sd.params(trainable), k_buckets=(0, opts.k),
                        eos_ids=tok.eos_ids)

    def acceptance():
        stats = SpecStats()
        gen.generate(eval_p, max_new_tokens=opts.max_new_tokens, num_spec_tokens=opts.k, stats=stats)
        return stats.acceptance_rate

    t0 = time.perf_counter()
    accs = [acceptance()]
    log(f"held-out acceptance before training: {accs[0]:.3f} (K={opts.k}, greedy)")
    full = opts.teacher == "full"
    teacher_logits = jax.jit(partial(tr.sequence_logits, cfg)) if full else None
    rng = np.random.default_rng(opts.seed)
    losses, dropped = [], 0
    for rnd in range(1, opts.rounds + 1):
        if records is None or (rnd > 1 and opts.sampling != "teacher"):  # (the target's text does not change)
            records = sample(sd.draft, sd.params(trainable), rnd)
        buf = ReplayBuffer(max_rows=sum(r.rows for r in records) + 1)
        for r in records:
            buf.add(r)

        def step(trainable, state):
            tokens, ids, logits, mask = buf.batch(rng, opts.distill_batch, opts.distill_length)
            teacher = teacher_logits(model.params, jnp.asarray(tokens)) if full else TopK(ids, logits)
            return tr.train_step(trainable, state, sd.frozen, tokens, teacher, mask, cfg=sd.draft.cfg, tc=tc,
                                 optimizer=opt)

        trainable, state, got, bad = tr.train_round(step, trainable, state, opts.steps, f"round {rnd}: training")
        losses += got
        dropped += bad
        gen.swap_draft_params(sd.params(trainable))
        accs.append(acceptance())
        log(f"round {rnd}: mean loss {np.mean(losses[-opts.steps:]):.4f}, held-out acceptance {accs[-1]:.3f}"
            + (f" ({dropped} steps dropped: non-finite)" if dropped else ""))
    checkpoints.save_next(trainable, state, {"finished": 0, "updates": 0, "dropped": 0,
                                           "offline": {"rounds": opts.rounds, "steps": opts.steps,
                                                       "sampling": opts.sampling, "acceptance": accs}})
    log(f"[{time.perf_counter() - t0:.0f} s; draft {sd.draft.label} saved to {opts.checkpoint_dir}]")
    if opts.plot:
        plots.distill_curves(opts.plot, losses, accs, tc.divergence, opts.k,
                             f"warm-up distillation: {drafter} draft" + (f", {opts.draft_vocab}-token head"
                             if opts.draft_vocab else "") + f", {opts.sampling} sampling")
    return 0
