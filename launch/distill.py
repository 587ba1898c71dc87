"""Warm-up distillation of a self-draft before serving (seed 003, Algorithm 1 line 2).

  python launch/distill.py --input_jsonl prompts.jsonl --checkpoint_dir ck --chat --draft_layers 8
  python launch/distill.py --input_jsonl prompts.jsonl --checkpoint_dir ck --drafter draft_model --draft_model d.gguf
  python launch/distill.py --input_jsonl prompts.jsonl --checkpoint_dir ck --chat --draft_vocab 8192 \\
      --sampling mixed --mix_beta 0.5 --rounds 3 --plot distill.png
  # then serve with it, and go on training online:
  python launch/batch.py --input_jsonl jobs.jsonl --output_jsonl out.jsonl --chat \\
      --drafter layer_skip --online_distill ck

Reads prompts (a JSONL with a ``prompt`` text, or ``--field``, per line), keeps the last
``--eval_prompts`` of them aside, and runs ``--rounds`` rounds. Each samples distillation data
on the training prompts (``--sampling``: the target writes (teacher), the draft writes
(student) or a token-level mixture (mixed); the target's top-k logits at every output position are kept, as serving keeps
them), then takes ``--steps`` optimizer steps of the draft on it. With ``--teacher full`` the
target's whole distribution is recomputed for each training batch instead (slower, and what
``--distill_divergence rkl`` / ``jsd`` need).

After every round it measures the draft's greedy acceptance rate with K = ``--k`` on the
held-out prompts (speculation with the target verifying, outputs checked against the target's
own), and prints the mean loss. The trained draft goes to ``--checkpoint_dir`` as an orbax
checkpoint (params, optimizer state, a JSON record) with ``draft.json`` naming the draft; the
batch job's ``--online_distill`` on that directory starts from it. ``--plot`` draws loss per step
and held-out acceptance per round.

``--draft_vocab N`` gives the draft a reduced-vocabulary head: the N tokens the target most
often puts first at the training positions (and its end-of-sequence ids), counted on round 1's
data (sampled by the full-head draft when the draft writes).

``--drafter eagle`` trains an EAGLE feature head (specjax.distill.eagle_train) instead:

  python launch/distill.py --drafter eagle --chat --input_jsonl prompts.jsonl --self_prompts 32 \
      --round_prompts 16 --draft_vocab 4096 --checkpoint_dir head --rounds 30 --steps 60 --plot head.png
  python launch/generate.py --chat --drafter eagle --eagle_head head --prompt "..."

Each round the target answers prompts (the next ``--round_prompts`` of the file, and
``--self_prompts`` it wrote itself from its chat template's user prefix; greedy unless
``--sample_temperature``), one target forward per sequence gives the features and the top-k
teacher at every position, and ``--steps`` steps train the head with EAGLE-3's training-time
test (``--unroll`` steps on its own predicted features). After every round: the held-out greedy
tokens per verify step of the engine with the head at K = ``--k`` (and how many held-out outputs
are identical to the target's own), and the head saved to ``--checkpoint_dir`` (``--head_dtype``;
what ``--eagle_head`` serves), its optimizer state and the run's record under ``state/``. The same
command with a larger ``--rounds`` resumes after the last finished round. ``--draft_vocab N``: the
N tokens the target ranks in its top-k most often on round 1's data; ``--shared_head`` (default)
keeps those rows the target's own (not trained, not saved).

``--drafter medusa`` trains Medusa heads (specjax.distill.medusa_train) the same way, on the
target's last hidden state: ``--medusa_heads`` heads, head i toward the target's distribution
i + 1 positions later (the same data, rounds, checkpoints and held-out measure; served with
``--medusa_head``; ``--k`` at most the heads).

User mistakes print one line ("error: ...") and exit with status 2.
"""

from __future__ import annotations

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

from specjax import cli, plots, registry  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("input_jsonl", None, "Prompts: one JSON object with a --field text per line.")
    flags.DEFINE_string("field", "prompt", "The text field of each --input_jsonl line.")
    flags.DEFINE_string("checkpoint_dir", None, "Where the trained draft goes (orbax checkpoints + draft.json).")
    cli.define_model_flags()
    cli.define_drafter_flags("layer_skip")
    cli.define_prompt_flags()
    flags.DEFINE_integer("draft_vocab", 0, "Reduced-vocabulary head of this many tokens (0: the full head).")
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
    # --drafter eagle / medusa (feature heads; specjax.distill.eagle_train, medusa_train)
    flags.DEFINE_integer("medusa_heads", 4, "medusa: how many heads (the largest K it drafts).")
    flags.DEFINE_integer("unroll", 3, "eagle: training-time-test steps past the teacher-forced pass (the head on "
                         "its own predicted features, as it drafts).")
    flags.DEFINE_integer("round_prompts", 0, "heads: --input_jsonl training prompts written per round (0: all in "
                         "round 1, then the same data every round); later rounds take the next ones, cycling.")
    flags.DEFINE_integer("self_prompts", 0, "heads: prompts per round the model writes itself from its chat "
                         "template's user prefix (sampled at T = 1), then answers (needs --chat).")
    flags.DEFINE_integer("self_prompt_tokens", 48, "heads: the longest self-written prompt, in tokens.")
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
    cli.define_distill_flags(online=False)


HEADS = ("eagle", "medusa")


def validate_flags():
    from specjax.errors import SpecjaxError

    eagle = FLAGS.drafter in HEADS  # (a feature head: eagle or medusa)
    for name in ("checkpoint_dir",) if eagle else ("input_jsonl", "checkpoint_dir"):
        if not FLAGS[name].value:
            raise SpecjaxError(f"--{name} is required")
    if eagle and not FLAGS.input_jsonl and not FLAGS.self_prompts:
        raise SpecjaxError(f"--drafter {FLAGS.drafter} needs prompts: --input_jsonl and/or --self_prompts")
    if FLAGS.texts_from and not eagle:
        raise SpecjaxError("--texts_from trains a head (--drafter eagle / medusa) on an earlier head run's text")
    if FLAGS.answer_field and not (eagle and FLAGS.input_jsonl):
        raise SpecjaxError("--answer_field reads answers for --drafter eagle / medusa from --input_jsonl")
    if eagle and FLAGS.self_prompts and not FLAGS.chat:
        raise SpecjaxError("--self_prompts writes prompts from the chat template: it needs --chat")
    if eagle and FLAGS.sampling != "teacher":
        raise SpecjaxError(f"--drafter {FLAGS.drafter} trains on the target's own text: --sampling teacher")
    if eagle and FLAGS.teacher != "topk":
        raise SpecjaxError(f"--drafter {FLAGS.drafter} trains on the target's top-k kept per position: --teacher topk")
    if FLAGS.drafter == "medusa" and FLAGS.k > FLAGS.medusa_heads:
        raise SpecjaxError(f"--k {FLAGS.k} drafts more than --medusa_heads {FLAGS.medusa_heads} heads can")
    if FLAGS.system and not FLAGS.chat:
        raise SpecjaxError("--system needs --chat")
    for name, lo in (("rounds", 1), ("steps", 1), ("max_new_tokens", 1), ("max_prompt", 1), ("topk", 1),
                     ("k", 1), ("eval_prompts", 1), ("draft_vocab", 0), ("limit", 0), ("distill_batch", 1),
                     ("distill_length", 2), ("unroll", 0), ("round_prompts", 0), ("self_prompts", 0),
                     ("self_prompt_tokens", 1), ("medusa_heads", 1)):
        cli.check_range(name, lo)
    if not eagle and os.path.exists(os.path.join(FLAGS.checkpoint_dir, "draft.json")):
        raise SpecjaxError(f"{FLAGS.checkpoint_dir} already holds a draft; give a new --checkpoint_dir")
    cli.check_range("mix_beta", 0.0, 1.0)
    cli.check_range("sample_temperature", 0.0)
    cli.distill_configs_from_flags(FLAGS.rounds * FLAGS.steps, full_teacher=FLAGS.teacher == "full")
    spec = cli.engine_spec_from_flags(policy="none")
    if not registry.DRAFTERS[spec.drafter.name].trains:  # (host drafters have no parameters)
        raise SpecjaxError(f"launch/distill.py trains a device draft ({', '.join(registry.TRAINED_DRAFTERS)}); "
                           f"drafter {spec.drafter.name} has nothing it can train")
    if spec.drafter.draft_checkpoint:
        raise SpecjaxError("--draft_checkpoint serves a distilled draft; distill.py writes one to --checkpoint_dir")
    return spec


def main(argv):
    cli.run_job(lambda: (run_head if FLAGS.drafter in HEADS else run)(validate_flags()), argv)


def run(spec) -> int:
    import jax.numpy as jnp
    import numpy as np
    from tqdm import tqdm

    from specjax.distill import data as dd
    from specjax.distill import train as tr
    from specjax.distill.buffer import ReplayBuffer
    from specjax.distill.checkpoint import open_draft
    from specjax.distill.divergences import TopK
    from specjax.drafters.device import ModelDraft, frequent_tokens, layer_skip
    from specjax.errors import SpecjaxError
    from specjax.jobs import read_outputs
    from specjax.models.loader import load_model
    from specjax.spec_generate import SpecGenerator, SpecStats

    texts = read_outputs(FLAGS.input_jsonl, flag="--input_jsonl", limit=FLAGS.limit, field=FLAGS.field)
    if len(texts) < FLAGS.eval_prompts + 1:
        raise SpecjaxError(f"{FLAGS.input_jsonl} has {len(texts)} prompts: need more than --eval_prompts "
                           f"({FLAGS.eval_prompts}) to train on")
    model, _ = cli.load_target(spec)
    cfg, tok = model.cfg, model.tokenizer
    draft = load_model(spec.drafter.draft_model, spec.dtype) if spec.drafter.draft_model else None
    if draft is None and not 1 <= FLAGS.draft_layers < cfg.num_layers:
        raise SpecjaxError(f"--draft_layers must be in 1..{cfg.num_layers - 1} for {cfg.name}, "
                           f"got {FLAGS.draft_layers}")
    if FLAGS.draft_vocab > cfg.vocab_size:
        raise SpecjaxError(f"--draft_vocab {FLAGS.draft_vocab} exceeds {cfg.name}'s {cfg.vocab_size} tokens")
    room = cfg.max_position - FLAGS.max_new_tokens
    prompts = [(tok.encode_chat(t, FLAGS.system) if FLAGS.chat else tok.encode(t))[-min(FLAGS.max_prompt, room):]
               for t in texts]
    if any(not p for p in prompts):
        raise SpecjaxError(f"{FLAGS.input_jsonl} has an empty prompt")
    train_p, eval_p = prompts[:-FLAGS.eval_prompts], prompts[-FLAGS.eval_prompts:]
    print(f"[{cfg.name}: {len(train_p)} training prompts, {len(eval_p)} held out; {FLAGS.sampling} sampling, "
          f"{draft.cfg.name if draft else f'{FLAGS.draft_layers}-layer self-'} draft]", file=sys.stderr)
    tc, _ = cli.distill_configs_from_flags(FLAGS.rounds * FLAGS.steps, full_teacher=FLAGS.teacher == "full")
    opt = tr.make_optimizer(tc)

    def sample(draft, dparams, rnd):
        with tqdm(total=len(train_p), desc=f"round {rnd}: sampling", unit="prompt", disable=None) as bar:
            return dd.sample_records(cfg, model.params, draft, dparams, train_p, max_new_tokens=FLAGS.max_new_tokens,
                                     mode=FLAGS.sampling, beta=FLAGS.mix_beta, temperature=FLAGS.sample_temperature,
                                     topk=FLAGS.topk, eos_ids=tok.eos_ids, batch=8, seed=FLAGS.seed + rnd,
                                     progress=bar.update)

    records, vocab = None, None
    if FLAGS.draft_vocab:  # the target's most frequent first choices on round 1's data
        records = sample(*((ModelDraft(draft.cfg), draft.params) if draft else
                           layer_skip(cfg, model.params, FLAGS.draft_layers)), 1)
        vocab = frequent_tokens([r.ids[:, 0] for r in records], cfg.vocab_size, FLAGS.draft_vocab, keep=tok.eos_ids)
    sd, checkpoints = open_draft(FLAGS.checkpoint_dir, cfg, model.params, FLAGS.draft_layers, vocab, draft_model=draft)
    trainable, state = sd.trainable, opt.init(sd.trainable)

    gen = SpecGenerator(cfg, model.params, draft=sd.draft, draft_params=sd.params(trainable), k_buckets=(0, FLAGS.k),
                         eos_ids=tok.eos_ids)

    def acceptance():
        stats = SpecStats()
        gen.generate(eval_p, max_new_tokens=FLAGS.max_new_tokens, num_spec_tokens=FLAGS.k, stats=stats)
        return stats.acceptance_rate

    t0 = time.perf_counter()
    accs = [acceptance()]
    print(f"held-out acceptance before training: {accs[0]:.3f} (K={FLAGS.k}, greedy)", file=sys.stderr)
    full_teacher = FLAGS.teacher == "full"
    teacher_logits = None
    if full_teacher:
        import jax
        from functools import partial

        teacher_logits = jax.jit(partial(tr.sequence_logits, cfg))
    rng = np.random.default_rng(FLAGS.seed)
    losses, dropped = [], 0
    for rnd in range(1, FLAGS.rounds + 1):
        if records is None or (rnd > 1 and FLAGS.sampling != "teacher"):  # (the target's text does not change)
            records = sample(sd.draft, sd.params(trainable), rnd)
        buf = ReplayBuffer(max_rows=sum(r.rows for r in records) + 1)
        for r in records:
            buf.add(r)
        for _ in tqdm(range(FLAGS.steps), desc=f"round {rnd}: training", unit="step", disable=None):
            tokens, ids, logits, mask = buf.batch(rng, FLAGS.distill_batch, FLAGS.distill_length)
            teacher = teacher_logits(model.params, jnp.asarray(tokens)) if full_teacher else TopK(ids, logits)
            trainable, state, loss, ok = tr.train_step(trainable, state, sd.frozen, tokens, teacher, mask,
                                                       cfg=sd.draft.cfg, tc=tc, optimizer=opt)
            if not bool(ok):
                dropped += 1
                continue
            losses.append(float(loss))
        gen.swap_draft_params(sd.params(trainable))
        accs.append(acceptance())
        print(f"round {rnd}: mean loss {np.mean(losses[-FLAGS.steps:]):.4f}, held-out acceptance {accs[-1]:.3f}"
              + (f" ({dropped} steps dropped: non-finite)" if dropped else ""), file=sys.stderr)
    checkpoints.save_next(trainable, state, {"finished": 0, "updates": 0, "dropped": 0,
                                           "offline": {"rounds": FLAGS.rounds, "steps": FLAGS.steps,
                                                       "sampling": FLAGS.sampling, "acceptance": accs}})
    print(f"[{time.perf_counter() - t0:.0f} s; draft {sd.draft.label} saved to {FLAGS.checkpoint_dir}]",
          file=sys.stderr)
    if FLAGS.plot:
        plots.distill_curves(FLAGS.plot, losses, accs, FLAGS.distill_divergence, FLAGS.k,
                             f"warm-up distillation: {FLAGS.drafter} draft" + (f", {FLAGS.draft_vocab}-token head"
                             if FLAGS.draft_vocab else "") + f", {FLAGS.sampling} sampling")
    return 0


TEXTS = "texts.npz"  # (under the eagle checkpoint's state/: every sequence the target wrote so far)


def run_head(spec) -> int:
    """--drafter eagle / medusa: warm-up training of a feature head (distill.eagle_train,
    distill.medusa_train), resumable from --checkpoint_dir (the head there, <kind>.json + orbax,
    is what --eagle_head / --medusa_head serves; the optimizer state and the run's record are
    under its state/)."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    from tqdm import tqdm

    from specjax.distill import eagle_train as et
    from specjax.distill import head_online
    from specjax.distill import train as tr
    from specjax.distill.checkpoint import DistillCheckpoints, fingerprint
    from specjax.drafters import heads
    from specjax.drafters.device import FeatureHeadDrafter, frequent_tokens
    from specjax.engine.jax_backend import JaxBackend
    from specjax.engine.loop import ServingEngine
    from specjax.engine.scheduler import Request
    from specjax.errors import SpecjaxError
    from specjax.goodput import FixedK
    from specjax.jobs import read_outputs
    from specjax import buckets as bk

    texts = read_outputs(FLAGS.input_jsonl, flag="--input_jsonl", limit=FLAGS.limit, field=FLAGS.field) \
        if FLAGS.input_jsonl else []
    if texts and len(texts) <= FLAGS.eval_prompts and not FLAGS.self_prompts:
        raise SpecjaxError(f"{FLAGS.input_jsonl} has {len(texts)} prompts: need more than --eval_prompts "
                           f"({FLAGS.eval_prompts}) to train on")
    model, _ = cli.load_target(spec)
    cfg, tok = model.cfg, model.tokenizer
    # the one difference between the kinds: the head, the target features it reads, its loss
    if FLAGS.drafter == "medusa":
        from specjax.distill import medusa_train
        from specjax.drafters import medusa as head_kind

        settings, fp_extra = {"heads": FLAGS.medusa_heads}, {}

        def finish_round(draft, params):
            """The tree the heads' held-out accuracy makes best (saved with them), and the table."""
            acc = medusa_train.accuracy(draft, params, eval_seqs)
            print("  held-out top-1..4 accuracy per head: " + "; ".join(
                f"head {i}: " + " ".join(f"{a:.2f}" for a in row) for i, row in enumerate(acc)), file=sys.stderr)
            return dataclasses.replace(draft, tree=head_kind.best_tree(acc, head_kind.TREE_NODES))
    else:
        from specjax.drafters import eagle as head_kind

        settings, fp_extra = {}, {"unroll": FLAGS.unroll}

        def finish_round(draft, params):
            return draft
    kind = head_kind.KIND
    feats_at = head_online.head_features(kind.name, cfg.num_layers)
    if FLAGS.draft_vocab > cfg.vocab_size:
        raise SpecjaxError(f"--draft_vocab {FLAGS.draft_vocab} exceeds {cfg.name}'s {cfg.vocab_size} tokens")
    room = cfg.max_position - FLAGS.max_new_tokens
    cut = min(FLAGS.max_prompt, room)

    def encode(t):
        return (tok.encode_chat(t, FLAGS.system) if FLAGS.chat else tok.encode(t))[-cut:]

    prompts = [encode(t) for t in texts]
    if any(not p for p in prompts):
        raise SpecjaxError(f"{FLAGS.input_jsonl} has an empty prompt")
    n_eval = min(FLAGS.eval_prompts, len(prompts))  # (the file's last; none without a file: see below)
    train_p, eval_p = prompts[:len(prompts) - n_eval], prompts[len(prompts) - n_eval:]
    # --answer_field: a line's own answer (teacher-forced; the target's distribution is still the teacher)
    answers = read_outputs(FLAGS.input_jsonl, flag="--input_jsonl", limit=FLAGS.limit, field=FLAGS.answer_field) \
        if FLAGS.answer_field else []
    train_a = [(tok.encode(a, add_bos=False)[:FLAGS.max_new_tokens - 1] + list(tok.eos_ids[:1])) if a.strip() else None
               for a in answers[:len(train_p)]] or [None] * len(train_p)
    tc, _ = cli.distill_configs_from_flags(FLAGS.rounds * FLAGS.steps)
    opt = tr.make_optimizer(tc)
    ck = FLAGS.checkpoint_dir
    gen_kw = dict(max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.sample_temperature, eos_ids=tok.eos_ids)

    def self_prompts(n, seed):
        """The Magpie way: the chat template up to the user's text, and the model writes the rest."""
        marker = "\x00"
        text = tok.apply_chat_template(([{"role": "system", "content": FLAGS.system}] if FLAGS.system else []) +
                                       [{"role": "user", "content": marker}])
        if marker not in text:
            raise SpecjaxError("--self_prompts: this chat template does not show the user's text, so it has no "
                               "user prefix to write prompts from")
        prefix = tok.encode(text[:text.index(marker)], add_bos=False)
        with tqdm(total=n, desc="self-written prompts", unit="prompt", disable=None) as bar:
            outs = et.generate(cfg, model.params, [prefix] * n, max_new_tokens=FLAGS.self_prompt_tokens,
                               temperature=1.0, seed=seed, eos_ids=tok.eos_ids, progress=bar.update, batch=16)
        asks = [tok.decode([t for t in o if t not in tok.eos_ids]).strip() for o in outs]
        return [encode(a) for a in asks if len(a) >= 8]

    def features(ps, outs, desc):
        with tqdm(total=len(ps), desc=desc, unit="seq", disable=None) as bar:
            return et.make_sequences(cfg, model.params, ps, outs, topk=FLAGS.topk, progress=bar.update,
                                     features=feats_at)

    def data(items, rnd):
        """(prompt, its answer from the file or None) -> sequences: the target writes the missing answers."""
        ps = [p for p, a in items if a is None]
        with tqdm(total=len(ps), desc=f"round {rnd}: target writes", unit="prompt", disable=None) as bar:
            outs = iter(et.generate(cfg, model.params, ps, seed=FLAGS.seed + 1000 * rnd, progress=bar.update,
                                    batch=16, **gen_kw))
        return features([p for p, _ in items], [next(outs) if a is None else a for _, a in items],
                        f"round {rnd}: target features")

    def round_prompts(rnd):
        items = []
        if train_p:
            n = FLAGS.round_prompts or len(train_p)
            items = [(train_p[j], train_a[j]) for j in ((i + (rnd - 1) * n) % len(train_p) for i in
                                                         range(min(n, len(train_p)) if not FLAGS.round_prompts else n))]
        if FLAGS.self_prompts:
            items += [(p, None) for p in self_prompts(FLAGS.self_prompts, FLAGS.seed + 7919 * rnd)]
        return items

    seqs: list = []
    ids_counted = False  # round 1's data was written to count the reduced vocabulary on
    resumed = os.path.exists(os.path.join(ck, kind.file))
    if resumed:
        head_spec = heads.read_spec(kind, ck, cfg)
        ids, shared = head_spec["vocab_ids"], bool(head_spec.get("shared_head"))
        settings = {k: head_spec[k] for k in kind.settings}
        if FLAGS.draft_vocab and FLAGS.draft_vocab != len(ids):
            raise SpecjaxError(f"{ck} holds a head of {len(ids)} tokens, not --draft_vocab {FLAGS.draft_vocab}")
        if shared != FLAGS.shared_head:
            raise SpecjaxError(f"{ck} holds a head whose vocab rows are " + ("the target's" if shared else "trained") +
                               "; give the same --[no]shared_head")
    else:
        ids, shared = None, FLAGS.shared_head
        if FLAGS.texts_from:  # the text an earlier head's run had the target write (or read)
            got = et.load_texts(FLAGS.texts_from)
            if not got:
                raise SpecjaxError(f"--texts_from {FLAGS.texts_from} holds no texts (a head run's state/{TEXTS})")
            seqs = features(*zip(*got), "--texts_from: target features")
        if FLAGS.draft_vocab:  # the most frequent tokens of the target's own text on round 1's data
            seqs = seqs or data(round_prompts(1), 1)
            # (the target's top-k at every position: far more ids than its text alone, the tail ranked too)
            ids = frequent_tokens([s.ids for s in seqs], cfg.vocab_size, FLAGS.draft_vocab, keep=tok.eos_ids)
            ids_counted = True
    draft, dparams = kind.init(cfg, model.params, ids, seed=FLAGS.seed, shared_head=shared, **settings)
    trainer = head_online.HeadTrainer(draft, tc, opt, FLAGS.unroll)
    ids = np.asarray(dparams["vocab_ids"])
    trainable = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), heads.trainable_of(draft, dparams))
    frozen = {k: v for k, v in dparams.items() if k not in trainable}
    state = opt.init(trainable)
    fp = {**fingerprint(cfg, draft.cfg, trainable, ids), **fp_extra}
    store = DistillCheckpoints(os.path.join(ck, "state"), fp, max_to_keep=1)
    record = {"round": 0, "losses": [], "accs": [], "sequences": 0}
    if resumed:
        got = store.restore(trainable, state)
        if got is None:
            raise SpecjaxError(f"{ck} holds a head but no training state to resume from (state/)")
        _, trainable, state, record = got
        texts_so_far = et.load_texts(os.path.join(ck, "state", TEXTS))
        if texts_so_far:
            seqs = features(*zip(*texts_so_far), "earlier rounds' text: target features")
        print(f"[resumed {ck} after round {record['round']} ({len(seqs)} sequences of earlier rounds)]",
              file=sys.stderr)
    if record["round"] >= FLAGS.rounds:
        raise SpecjaxError(f"{ck} has trained {record['round']} rounds already: give a larger --rounds to go on")

    def serving(t):  # the params as served: the saved dtype, the target's dtype at run time
        dt = model.params["embed"].dtype
        t = jax.tree_util.tree_map(lambda a: jnp.asarray(jnp.asarray(a, FLAGS.head_dtype), dt), t)
        return {**frozen, **t}

    if not eval_p:  # no prompt file: held-out prompts it writes itself, with a seed no round uses
        eval_p = self_prompts(FLAGS.eval_prompts, FLAGS.seed - 1)
        n_eval = len(eval_p)
    B = min(8, max(1, n_eval))
    slots = bk.slot_bucket(max([len(p) for p in eval_p] + [1]) + FLAGS.max_new_tokens + FLAGS.k + 1, cfg.max_position)
    be = JaxBackend(cfg, model.params, drafter=FeatureHeadDrafter(draft, serving(trainable)), k_buckets=(0, FLAGS.k),
                    batch_buckets=(B,), slots=slots)

    def run_engine(k):
        be.reset()
        eng = ServingEngine(be, FixedK(k))
        return eng, [o.tokens for o in eng.run([Request(f"e{i}", p, FLAGS.max_new_tokens)
                                                for i, p in enumerate(eval_p)])]

    ref = run_engine(0)[1]  # the engine's own AR (K = 0 steps): what speculation must reproduce
    eval_seqs = features(eval_p, ref, "held-out text: target features") if FLAGS.drafter == "medusa" else []

    def tokens_per_step():
        """Greedy tokens per verify step of the engine with the head (K = --k) on the held-out
        prompts, and how many outputs are token-identical to its AR."""
        eng, outs = run_engine(FLAGS.k)
        return 1.0 + eng.counts.accepted / max(eng.counts.offered, 1), sum(o == r for o, r in zip(outs, ref))

    losses, accs = list(record["losses"]), list(record["accs"])
    if not accs:
        acc, same = tokens_per_step()
        accs.append(acc)
        print(f"held-out tokens per verify step before training: {acc:.3f} (K={FLAGS.k}, greedy; {same}/{n_eval} "
              f"identical to AR)", file=sys.stderr)
    t0 = time.perf_counter()
    rng = np.random.default_rng(FLAGS.seed + record["round"])
    first = record["round"] + 1
    for rnd in range(first, FLAGS.rounds + 1):
        fresh = FLAGS.round_prompts or FLAGS.self_prompts or FLAGS.sample_temperature > 0  # (new text each round)
        had = 0 if rnd == 1 else len(seqs)  # (round 1's vocabulary-counting data counts as round 1's)
        if not seqs or (fresh and not (rnd == 1 and ids_counted)):
            seqs = seqs + data(round_prompts(rnd), rnd)
        dropped = 0
        for _ in tqdm(range(FLAGS.steps), desc=f"round {rnd}: training", unit="step", disable=None):
            batch = et.make_batch(seqs, rng, FLAGS.distill_batch, FLAGS.distill_length, prompt_loss=FLAGS.prompt_loss)
            trainable, state, loss, ok = trainer.step(trainable, state, frozen, batch)
            if not bool(ok):
                dropped += 1
                continue
            losses.append(float(loss))
        be.swap_draft_params(serving(trainable))
        acc, same = tokens_per_step()
        accs.append(acc)
        print(f"round {rnd}: {len(seqs)} sequences, mean loss {np.mean(losses[-FLAGS.steps:]):.4f}, held-out tokens "
              f"per verify step {acc:.3f} ({same}/{n_eval} identical to AR)" +
              (f" ({dropped} steps dropped: non-finite)" if dropped else ""), file=sys.stderr)
        record = {"round": rnd, "losses": losses, "accs": accs, "sequences": record["sequences"] + len(seqs) - had}
        heads.save_head(kind, ck, cfg, {**frozen, **trainable}, finish_round(draft, serving(trainable)),
                        dtype=jnp.dtype(FLAGS.head_dtype))
        store.save_next(trainable, state, record)
        et.save_texts(os.path.join(ck, "state", TEXTS), seqs)
        if FLAGS.plot:  # (every round: a run stopped between rounds has its plot too)
            plots.distill_curves(FLAGS.plot, losses, accs, FLAGS.distill_divergence, FLAGS.k,
                                 f"{kind.title} head warm-up: {len(ids)}-token head, " +
                                 (f"{draft.heads} heads" if FLAGS.drafter == "medusa" else f"unroll {FLAGS.unroll}"),
                                 acc_label=f"held-out tokens per verify step, K={FLAGS.k}")
    print(f"[{time.perf_counter() - t0:.0f} s; head saved to {ck} ({FLAGS.head_dtype})]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    define_flags()
    app.run(main)
