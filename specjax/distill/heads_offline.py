"""Warm-up training of a feature head before serving (``launch/distill.py --drafter <head kind>``):
what ``distill.offline`` does for a draft, for a head of any ``drafters.heads.HeadKind``
(``head_online.HeadTrainer`` takes its steps), resumable.

Each round the target answers prompts (the next ``round_prompts`` of the file, and
``self_prompts`` it writes itself from its chat template's user prefix, the Magpie way; greedy
unless ``sample_temperature``), or a line's own ``answer_field`` is taken teacher-forced; one
target forward per sequence gives the features the kind reads and the top-k teacher at every
position; ``steps`` steps train the head. After every round: the held-out greedy tokens per
verify step of the engine with the head at K = ``k`` (and how many held-out outputs are identical
to the engine's own AR), the kind's ``after_round``, and the head saved to ``checkpoint_dir``
(``head_dtype``; what ``--<kind>_head`` serves), with its optimizer state, the run's record and
every text the target wrote so far under ``state/``, so the same run with more ``rounds``
resumes after the last finished one. ``draft_vocab``: the tokens the target ranks in its top-k
most often on round 1's data; ``shared_head`` keeps those rows the target's own.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from specjax import plots
from specjax.distill import eagle_train as et
from specjax.distill import head_online
from specjax.distill import train as tr
from specjax.distill.checkpoint import DistillCheckpoints, fingerprint
from specjax.distill.head_data import TargetWriter, user_prefix
from specjax.distill.offline import WarmUp, say
from specjax.drafters import heads
from specjax.drafters.device import FeatureHeadDrafter, frequent_tokens
from specjax.errors import SpecjaxError

TEXTS = "texts.npz"  # (under the checkpoint's state/: every sequence the target wrote so far)


class HeadData:
    """Training sequences for a head reading the target features ``features``: prompts, the
    target's answers to them (through the engine: head_data.TargetWriter), and one target forward
    per sequence."""

    def __init__(self, model, opts: WarmUp, features: tuple[int, ...]):
        self.model, self.opts, self.feats_at = model, opts, features
        self.encode = opts.encoder(model)
        self.writer = TargetWriter(model, batch=16)

    def self_prompts(self, n: int, seed: int) -> list[list[int]]:
        """The chat template up to the user's text, and the target writes the rest."""
        prefix = user_prefix(self.model.tokenizer, self.opts.system)
        with tqdm(total=n, desc="self-written prompts", unit="prompt", disable=None) as bar:
            asks = self.writer.self_prompts(prefix, [seed + i for i in range(n)], self.opts.self_prompt_tokens,
                                            progress=bar.update, chunk=64)
        return [self.encode(a) for a in asks if a is not None]

    def features(self, prompts, outputs, desc: str) -> list[et.HeadSequence]:
        with tqdm(total=len(prompts), desc=desc, unit="seq", disable=None) as bar:
            return et.make_sequences(self.model.cfg, self.model.params, prompts, outputs, topk=self.opts.topk,
                                     progress=bar.update, features=self.feats_at)

    def written(self, items, rnd: int) -> list[et.HeadSequence]:
        """(prompt, its answer from the file or None) -> sequences: the target writes the missing answers."""
        o = self.opts
        ps = [p for p, a in items if a is None]
        with tqdm(total=len(ps), desc=f"round {rnd}: target writes", unit="prompt", disable=None) as bar:
            seed = o.seed + 1000 * rnd
            outs = iter(self.writer.write(ps, [o.sample_temperature] * len(ps), [seed + i for i in range(len(ps))],
                                          o.max_new_tokens, progress=bar.update, chunk=64))
        return self.features([p for p, _ in items], [next(outs) if a is None else a for _, a in items],
                             f"round {rnd}: target features")


class HeldOut:
    """The engine with the head (``drafter``) on the held-out prompts, greedy: its own AR
    (K = 0 steps: what speculation must reproduce) once, then at K = ``k`` after each round.
    ``ref``: the AR outputs of an earlier HeldOut on the same prompts (not run again)."""

    def __init__(self, model, drafter, prompts, max_new_tokens: int, k: int, ref: list[list[int]] | None = None):
        from specjax import buckets as bk
        from specjax.engine.jax_backend import JaxBackend

        cfg = model.cfg
        self.prompts, self.max_new_tokens, self.k = prompts, max_new_tokens, k
        slots = bk.slot_bucket(max([len(p) for p in prompts] + [1]) + max_new_tokens + k + 1, cfg.max_position)
        self.backend = JaxBackend(cfg, model.params, drafter=drafter, k_buckets=(0, k),
                                  batch_buckets=(min(8, max(1, len(prompts))),), slots=slots)
        self.ref = ref if ref is not None else [o.tokens for o in self._run(0)[1]]

    def _run(self, k: int):
        from specjax.engine.loop import ServingEngine
        from specjax.engine.scheduler import Request
        from specjax.goodput import FixedK

        self.backend.reset()
        eng = ServingEngine(self.backend, FixedK(k))
        return eng, eng.run([Request(f"e{i}", p, self.max_new_tokens) for i, p in enumerate(self.prompts)])

    def measure(self) -> tuple[float, int]:
        """(tokens per verify step at K = k, how many outputs are token-identical to the AR's)."""
        eng, outs = self._run(self.k)
        return (1.0 + eng.counts.accepted / max(eng.counts.offered, 1),
                sum(o.tokens == r for o, r in zip(outs, self.ref)))

    def per_prompt(self) -> list[tuple[int, int, bool]]:
        """Each prompt's (steps, accepted drafts, output token-identical to the AR's) at K = k."""
        _, outs = self._run(self.k)
        return [(o.steps, o.accepted, o.tokens == r) for o, r in zip(outs, self.ref)]


def train_head(kind: heads.HeadKind, opts: WarmUp, tc: tr.TrainConfig, load_target: Callable,
               log: Callable[[str], None] = say) -> int:
    """Warm up (or resume) a head of ``kind`` in ``opts.checkpoint_dir`` toward the target
    ``load_target()`` returns (called once the prompts are read), as the module docstring says.
    Returns 0."""
    o, ck = opts, opts.checkpoint_dir
    texts = o.read_texts()
    if texts and len(texts) <= o.eval_prompts and not o.self_prompts:
        raise SpecjaxError(f"{o.input_jsonl} has {len(texts)} prompts: need more than --eval_prompts "
                           f"({o.eval_prompts}) to train on")
    model = load_target()
    cfg, tok = model.cfg, model.tokenizer
    o.check_vocab(cfg)
    hd = HeadData(model, o, kind.features(cfg))
    prompts = o.prompts(model, texts)
    n_eval = min(o.eval_prompts, len(prompts))  # (the file's last; none without a file: see below)
    train_p, eval_p = prompts[:len(prompts) - n_eval], prompts[len(prompts) - n_eval:]
    # answer_field: a line's own answer (teacher-forced; the target's distribution is still the teacher)
    answers = dataclasses.replace(o, field=o.answer_field).read_texts() if o.answer_field else []
    train_a = [(tok.encode(a, add_bos=False)[:o.max_new_tokens - 1] + list(tok.eos_ids[:1])) if a.strip() else None
               for a in answers[:len(train_p)]] or [None] * len(train_p)
    opt = tr.make_optimizer(tc)

    def round_items(rnd):
        items = []
        if train_p:
            n = o.round_prompts or len(train_p)
            items = [(train_p[j], train_a[j]) for j in ((i + (rnd - 1) * n) % len(train_p) for i in
                                                         range(min(n, len(train_p)) if not o.round_prompts else n))]
        if o.self_prompts:
            items += [(p, None) for p in hd.self_prompts(o.self_prompts, o.seed + 7919 * rnd)]
        return items

    seqs: list = []
    ids_counted = False  # round 1's data was written to count the reduced vocabulary on
    resumed = os.path.exists(os.path.join(ck, kind.file))
    if resumed:
        head_spec = heads.read_spec(kind, ck, cfg)
        ids, shared = head_spec["vocab_ids"], bool(head_spec.get("shared_head"))
        settings = {k: head_spec[k] for k in kind.settings}
        if o.draft_vocab and o.draft_vocab != len(ids):
            raise SpecjaxError(f"{ck} holds a head of {len(ids)} tokens, not --draft_vocab {o.draft_vocab}")
        if shared != o.shared_head:
            raise SpecjaxError(f"{ck} holds a head whose vocab rows are " + ("the target's" if shared else "trained") +
                               "; give the same --[no]shared_head")
    else:
        ids, shared, settings = None, o.shared_head, o.head_settings(kind)
        if o.texts_from:  # the text an earlier head's run had the target write (or read)
            got = et.load_texts(o.texts_from)
            if not got:
                raise SpecjaxError(f"--texts_from {o.texts_from} holds no texts (a head run's state/{TEXTS})")
            seqs = hd.features(*zip(*got), "--texts_from: target features")
        if o.draft_vocab:  # the most frequent tokens of the target's own text on round 1's data
            seqs = seqs or hd.written(round_items(1), 1)
            # (the target's top-k at every position: far more ids than its text alone, the tail ranked too)
            ids = frequent_tokens([s.ids for s in seqs], cfg.vocab_size, o.draft_vocab, keep=tok.eos_ids)
            ids_counted = True
    draft, dparams = kind.init(cfg, model.params, ids, seed=o.seed, shared_head=shared, **settings)
    trainer = head_online.HeadTrainer(draft, tc, opt, o.unroll)
    ids = np.asarray(dparams["vocab_ids"])
    trainable = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), heads.trainable_of(draft, dparams))
    frozen = {k: v for k, v in dparams.items() if k not in trainable}
    state = opt.init(trainable)
    fp = {**fingerprint(cfg, draft.cfg, trainable, ids), **({"unroll": o.unroll} if kind.unrolls else {})}
    store = DistillCheckpoints(os.path.join(ck, "state"), fp, max_to_keep=1)
    record = {"round": 0, "losses": [], "accs": [], "sequences": 0}
    if resumed:
        got = store.restore(trainable, state)
        if got is None:
            raise SpecjaxError(f"{ck} holds a head but no training state to resume from (state/)")
        _, trainable, state, record = got
        texts_so_far = et.load_texts(os.path.join(ck, "state", TEXTS))
        if texts_so_far:
            seqs = hd.features(*zip(*texts_so_far), "earlier rounds' text: target features")
        log(f"[resumed {ck} after round {record['round']} ({len(seqs)} sequences of earlier rounds)]")
    if record["round"] >= o.rounds:
        raise SpecjaxError(f"{ck} has trained {record['round']} rounds already: give a larger --rounds to go on")

    def serving(t):  # the params as served: the saved dtype, the target's dtype at run time
        dt = model.params["embed"].dtype
        t = jax.tree_util.tree_map(lambda a: jnp.asarray(jnp.asarray(a, o.head_dtype), dt), t)
        return {**frozen, **t}

    if not eval_p:  # no prompt file: held-out prompts it writes itself, with a seed no round uses
        eval_p = hd.self_prompts(o.eval_prompts, o.seed - 1)
        n_eval = len(eval_p)
    held = HeldOut(model, FeatureHeadDrafter(draft, serving(trainable)), eval_p, o.max_new_tokens, o.k)
    after_round = kind.resolve("after_round")
    eval_seqs = hd.features(eval_p, held.ref, "held-out text: target features") if after_round else []
    losses, accs = list(record["losses"]), list(record["accs"])
    if not accs:
        acc, same = held.measure()
        accs.append(acc)
        log(f"held-out tokens per verify step before training: {acc:.3f} (K={o.k}, greedy; {same}/{n_eval} "
            "identical to AR)")
    t0 = time.perf_counter()
    rng = np.random.default_rng(o.seed + record["round"])
    for rnd in range(record["round"] + 1, o.rounds + 1):
        fresh = o.round_prompts or o.self_prompts or o.sample_temperature > 0  # (new text each round)
        had = 0 if rnd == 1 else len(seqs)  # (round 1's vocabulary-counting data counts as round 1's)
        if not seqs or (fresh and not (rnd == 1 and ids_counted)):
            seqs = seqs + hd.written(round_items(rnd), rnd)

        def step(trainable, state):
            batch = et.make_batch(seqs, rng, o.distill_batch, o.distill_length, prompt_loss=o.prompt_loss)
            return trainer.step(trainable, state, frozen, batch)

        trainable, state, got, dropped = tr.train_round(step, trainable, state, o.steps, f"round {rnd}: training")
        losses += got
        held.backend.swap_draft_params(serving(trainable))
        acc, same = held.measure()
        accs.append(acc)
        log(f"round {rnd}: {len(seqs)} sequences, mean loss {np.mean(losses[-o.steps:]):.4f}, held-out tokens "
            f"per verify step {acc:.3f} ({same}/{n_eval} identical to AR)" +
            (f" ({dropped} steps dropped: non-finite)" if dropped else ""))
        record = {"round": rnd, "losses": losses, "accs": accs, "sequences": record["sequences"] + len(seqs) - had}
        saved = draft
        if after_round is not None:
            saved, report = after_round(draft, serving(trainable), eval_seqs)
            log(report)
        heads.save_head(kind, ck, cfg, {**frozen, **trainable}, saved, dtype=jnp.dtype(o.head_dtype))
        store.save_next(trainable, state, record)
        et.save_texts(os.path.join(ck, "state", TEXTS), seqs)
        if o.plot:  # (every round: a run stopped between rounds has its plot too)
            shape = f"unroll {o.unroll}" if kind.unrolls else ", ".join(f"{getattr(draft, s)} {s}"
                                                                        for s, _ in kind.options)
            plots.distill_curves(o.plot, losses, accs, tc.divergence, o.k,
                                 f"{kind.title} head warm-up: {len(ids)}-token head, {shape}",
                                 acc_label=f"held-out tokens per verify step, K={o.k}")
    log(f"[{time.perf_counter() - t0:.0f} s; head saved to {ck} ({o.head_dtype})]")
    return 0
