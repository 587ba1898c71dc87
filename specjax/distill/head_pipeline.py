"""A feature head trained for real: hours in the background on a CPU, minutes on a GPU, with the
same command (``launch/distill.py --drafter eagle|medusa --pipeline data|train|all``).

  python launch/distill.py --drafter eagle --chat --pipeline all --data_dir runs/eagle-data \\
      --prompt_files ../shared/data/gsm8k/train.jsonl,../shared/data/humaneval/HumanEval.jsonl \\
      --self_prompts 4000 --max_new_tokens 256 --checkpoint_dir runs/eagle-head --train_tokens 8e6 \\
      --distill_batch 8 --distill_length 256 --distill_lr 1e-3 --time_budget_hours 12 --plot runs/eagle.png
  # Medusa heads on the same text (features recomputed, nothing generated):
  python launch/distill.py --drafter medusa --chat --pipeline all --data_dir runs/medusa-data \\
      --data_texts_from runs/eagle-data --max_new_tokens 256 --checkpoint_dir runs/medusa-head \\
      --train_tokens 1e7 --distill_batch 16 --distill_length 256 --distill_lr 1e-3 --plot runs/medusa.png
  # more data later: prompts from openings, then the head fine-tuned on both data sets
  python launch/distill.py --drafter eagle --chat --pipeline data --data_dir runs/chat-data \\
      --self_prompts 1600 --self_prompt_starters configs/data/chat_starters.txt --max_new_tokens 192
  python launch/distill.py --drafter eagle --chat --pipeline train --data_dir runs/eagle-data,runs/chat-data \\
      --init_head runs/eagle-head --checkpoint_dir runs/eagle-tuned --epochs 2 --distill_lr 3e-4

(Spec-Bench's questions stay out of the data: they are the held-out benchmark.) The same command
started again goes on where it stopped; ``--data_parallel N`` splits each step over N devices (on
a GPU host, with a larger ``--distill_batch`` and ``--gen_batch``).

``--pipeline data`` writes the data set (``distill.head_data``: prompts, the target's answers
through the engine, features and top-k teacher at every position, verified shards, resumable by
shard) and prints the draft-vocabulary table; ``train`` trains on it; ``all`` does both.

Training is the anchors' recipe on stored data: every sequence cut into windows of
``window`` positions (an attending head's windows after a sequence's first overlap the one
before by ``context`` positions, read by its attention and not trained on again), the windows of
an epoch in a permutation keyed by (seed, epoch), ``batch`` of them per optimizer step (the
kind's step: EAGLE's training-time test, Medusa's heads, soft targets from the top-k teacher),
AdamW with a linear warm-up over ``warmup_fraction`` of the PLANNED steps and a cosine decay
to their end (planned from the token budget: ``train_tokens``, else ``epochs`` passes), gradients
clipped. "Training tokens" are trained positions (a window's positions whose next-token
distribution is a target), the x axis of every curve.

A run lives in ``checkpoint_dir``: ``pipeline.json`` (the head's vocabulary and settings and the
run's plan, written when it starts: a later run with other settings is refused, in one line),
``pipeline_state/`` (orbax: the head's params, the optimizer state and a record of the step, the
data cursor (epoch, batch), the seed, the tokens seen and the curves; every
``checkpoint_minutes`` and at the end; the data order and every step are functions of these, so
a run killed at any point and started again with the same command reproduces the uninterrupted
run exactly, on one device), and the head itself, saved at every checkpoint as its kind serves
it (``--<kind>_head DIR``) with the training tokens it has seen in its file; ``snapshots/`` keeps
the heads of checkpoints at geometrically spaced token counts and the final one (the points of a
curve measured later). SIGTERM finishes the step in progress, checkpoints and exits 0;
``time_budget_hours`` does the same when it runs out.

Progress: a tqdm bar, a line every ``log_every`` steps (tokens seen, tokens/s, loss, learning
rate), every ``eval_every`` steps the held-out estimate on the stored held-out shard (the head's
top-1 agreement with the target, and the tokens per verify step at K = ``k`` that verifying its
greedy chains along that greedy text gives: ``chain_walk`` of ``HeadKind.chain_hits``, an
estimate of the engine's that runs no generation), every ``engine_eval_every`` steps the real
greedy tokens per verify step through the engine at K = ``k`` on held-out prompts
(``heads_offline.HeldOut``), and ``plot`` redrawn (loss and acceptance vs training tokens).

Scale-out: ``data_parallel`` N runs every step on a 1-D ``data`` mesh of N devices
(``sharding.make_mesh``): the global batch split over it, the head's params and optimizer state
replicated, the gradient averaged across devices by the compiled step; N = 1 is the plain step.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import signal
import sys
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax import ondisk
from specjax.distill import eagle_train as et
from specjax.distill import train as tr
from specjax.distill.head_data import DataSet, choose_vocab, differ, format_vocab_table, vocab_table
from specjax.errors import SpecjaxError, require

PIPELINE_FILE = "pipeline.json"
STATE_DIR = "pipeline_state"
SNAPSHOT_GROWTH = 1.5  # a snapshot of the head when the tokens seen grew this much since the last
ENGINE_EVAL_TOKENS = 128  # new tokens per held-out prompt in the engine's measurement (at most)


def say(msg: str) -> None:
    from tqdm import tqdm

    tqdm.write(msg, file=sys.stderr)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A training run's settings (each a launch/distill.py flag, named in the module docstring
    or by the field: ``batch`` is --distill_batch, ``window`` --distill_length, ``context``
    --window_context, ``settings`` the kind's own (HeadKind.options) as (name, value) pairs)."""

    checkpoint_dir: str
    batch: int = 8
    window: int = 256
    context: int = 64
    train_tokens: float = 0
    epochs: float = 4.0
    time_budget_hours: float = 0.0
    checkpoint_minutes: float = 5.0
    checkpoint_steps: int = 0
    log_every: int = 50
    eval_every: int = 500
    engine_eval_every: int = 5000
    eval_prompts: int = 8
    k: int = 3
    unroll: int = 3
    seed: int = 0
    data_parallel: int = 1
    draft_vocab: int = 0
    shared_head: bool = True
    head_dtype: str = "bfloat16"
    prompt_loss: bool = False
    warmup_fraction: float = 0.02
    plot: str | None = None
    settings: tuple = ()
    init_head: str | None = None  # a saved head (its weights and vocabulary) a new run starts from

    def check(self) -> None:
        for name, lo in (("batch", 1), ("window", 2), ("context", 0), ("checkpoint_steps", 0), ("log_every", 1),
                         ("eval_every", 0), ("engine_eval_every", 0), ("eval_prompts", 1), ("k", 1), ("unroll", 0),
                         ("data_parallel", 1), ("draft_vocab", 0)):
            require(getattr(self, name) >= lo, f"--{_FLAG.get(name, name)} must be >= {lo}, got {getattr(self, name)}")
        require(self.context < self.window, f"--window_context ({self.context}) must be below --distill_length "
                f"({self.window})")
        require(self.train_tokens > 0 or self.epochs > 0, "--train_tokens or --epochs must be > 0")
        require(self.train_tokens >= 0 and self.epochs >= 0 and self.time_budget_hours >= 0
                and self.checkpoint_minutes >= 0, "budgets and --checkpoint_minutes must be >= 0")
        require(0 <= self.warmup_fraction < 1, f"--warmup_fraction must be in [0, 1), got {self.warmup_fraction}")
        require(self.batch % self.data_parallel == 0, f"--distill_batch {self.batch} does not split evenly over "
                f"--data_parallel {self.data_parallel} devices")


_FLAG = {"batch": "distill_batch", "window": "distill_length", "context": "window_context"}


# ------------------------------------------------------------------------------------ data order


def windows(shards, T: int, C: int, prompt_loss: bool, skip: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Every training window of ``shards``: ([n, 4] int64 rows (shard, sequence, first position a,
    first trained position), [n] trained positions per window). A sequence's trained positions
    (from its prompt's last unless ``prompt_loss``, plus ``skip``) are covered once, by windows of
    T positions whose first C (after the first window) are context only."""
    require(0 <= C < T, f"a window's context ({C}) must be below its length ({T})")
    rows, counts = [], []
    for si, sh in enumerate(shards):
        lens, starts = sh.lengths(), sh.starts
        for q in range(len(sh)):
            L = int(lens[q])
            first = (0 if prompt_loss else int(starts[q])) + skip
            a = max(0, first - C)
            while first < L:
                end = min(a + T, L)
                rows.append((si, q, a, first))
                counts.append(end - first)
                first, a = end, end - C
    return np.asarray(rows, np.int64).reshape(-1, 4), np.asarray(counts, np.int64)


class Order:
    """The data order: epoch e's windows in the permutation ``default_rng([seed, e])`` draws,
    ``batch`` per step (an epoch's last incomplete batch left out). Step s reads epoch s //
    steps_per_epoch, batch s % steps_per_epoch: the order is a function of the step alone."""

    def __init__(self, rows: np.ndarray, counts: np.ndarray, batch: int, seed: int):
        self.rows, self.counts, self.batch, self.seed = rows, counts, batch, seed
        self.steps_per_epoch = len(rows) // batch
        require(self.steps_per_epoch >= 1, f"the data set has {len(rows)} training windows: fewer than one batch of "
                f"--distill_batch {batch}")
        self._perm: tuple[int, np.ndarray] | None = None
        self._lock = threading.Lock()

    def cursor(self, step: int) -> tuple[int, int]:
        return divmod(step, self.steps_per_epoch)

    def at(self, step: int) -> np.ndarray:
        """Indices into ``rows`` of step ``step``'s batch."""
        e, b = self.cursor(step)
        with self._lock:
            if self._perm is None or self._perm[0] != e:
                self._perm = (e, np.random.default_rng([self.seed, e]).permutation(len(self.rows)))
            perm = self._perm[1]
        return perm[b * self.batch:(b + 1) * self.batch]

    @property
    def tokens_per_step(self) -> float:
        """Trained positions per step, on average over the data set."""
        return float(self.counts.mean()) * self.batch

    def steps_for(self, tokens: float) -> int:
        return max(2, math.ceil(tokens / self.tokens_per_step))


def plan(order: Order, rc: RunConfig, tc: tr.TrainConfig) -> tr.TrainConfig:
    """``tc`` with the run's schedule: ``total_steps`` the planned steps (the token budget over
    the mean training tokens of a step, else ``epochs`` passes), a linear warm-up over
    ``warmup_fraction`` of them, the cosine decay over the rest."""
    planned = order.steps_for(rc.train_tokens) if rc.train_tokens else \
        max(2, math.ceil(rc.epochs * order.steps_per_epoch))
    return dataclasses.replace(tc, total_steps=planned,
                               warmup_steps=min(planned - 1, max(1, round(rc.warmup_fraction * planned))))


class Placement:
    """Where a step's arrays live: the default device, or with ``data_parallel`` N > 1 a data
    mesh of N devices (a batch's rows split over it; params and optimizer state replicated, so
    the compiled step averages the gradient across devices itself)."""

    def __init__(self, data_parallel: int = 1):
        self.mesh = None
        if data_parallel > 1:
            from jax.sharding import NamedSharding, PartitionSpec as P

            from specjax.sharding import make_mesh

            self.mesh = make_mesh(data_parallel, 1)
            self._rows, self._repl = NamedSharding(self.mesh, P("data")), NamedSharding(self.mesh, P())

    def replicated(self, tree):
        if self.mesh is None:
            return jax.tree_util.tree_map(jnp.asarray, tree)
        return jax.device_put(tree, self._repl)

    def rows(self, tree):
        """A batch (every leaf [B, ...]) split over the data axis."""
        if self.mesh is None:
            return jax.tree_util.tree_map(jnp.asarray, tree)
        return jax.device_put(tree, self._rows)


# --------------------------------------------------------------------------------------- helpers


def chain_walk(hits: np.ndarray, valid: np.ndarray) -> tuple[float, float]:
    """(top-1 agreement of draft 1, tokens per verify step) of greedy chains of k drafts, given
    ``HeadKind.chain_hits``' (hits, valid) [B, T, k]: in each row, verification as the engine runs
    it, from its first valid position (each step accepts its chain's leading hits, where valid,
    and the target's token after them, and the next step starts past them). The mean over every
    position instead would overweight the easy stretches the engine crosses in few steps."""
    h1, n1 = int((hits[..., 0] & valid[..., 0]).sum()), int(valid[..., 0].sum())
    tokens = steps = 0
    for h, v in zip(hits, valid):
        at = np.flatnonzero(v[:, 0])
        if at.size == 0:
            continue
        p, end = int(at[0]), int(at[-1])
        while p <= end:
            n = int(np.cumprod(h[p] & v[p]).sum())
            tokens, steps, p = tokens + n + 1, steps + 1, p + n + 1
    return h1 / max(n1, 1), tokens / max(steps, 1)



def shard_estimate(kind, draft, dparams, shard, rc: RunConfig, pl: Placement | None = None) -> tuple[float, float]:
    """(top-1 agreement of draft 1, estimated tokens per verify step at K = ``rc.k``) of the head
    on a stored shard: ``chain_walk`` of its greedy chains' hits over the answers' drafted
    positions (from the first token the target wrote: the pending token of the first step), in
    windows of ``rc.window``. On the held-out shard it is a run's held-out estimate; on a
    training shard, how well the head fits what it trained on (benchmarks/head_fit.py)."""
    pl = pl or Placement(1)
    C = rc.context if kind.attends else 1
    rows, _ = windows([shard], rc.window, C, prompt_loss=False, skip=1)
    hits_fn = kind.resolve("chain_hits")
    out = []
    for i in range(0, len(rows), rc.batch):
        part = [(shard.sequence(int(q)), int(a), int(f)) for _, q, a, f in rows[i:i + rc.batch]]
        part += [(part[0][0], part[0][1], 1 << 30)] * (rc.batch - len(part))  # (padding rows: nothing valid)
        hits, valid = hits_fn(dparams, pl.rows(et.window_batch(part, rc.window)), draft=draft, k=rc.k)
        out.append((np.asarray(hits), np.asarray(valid)))
    return chain_walk(np.concatenate([h for h, _ in out]), np.concatenate([v for _, v in out]))


def _host(tree):
    return jax.tree_util.tree_map(lambda a: np.asarray(jax.device_get(a)), tree)


def head_cost(kind, cfg, params, settings: dict, shared_head: bool) -> Callable[[int], tuple[float, float]]:
    """n -> (MB of the vocabulary rows, MB of the whole head) a draft forward of this kind's head
    with n vocabulary rows reads (its arrays in the target's dtype, as served; the embedding table
    aside: a forward reads one row of it)."""
    def size(n: int) -> int:
        shapes = jax.eval_shape(lambda p: kind.init(cfg, p, np.arange(n), shared_head=shared_head, **settings)[1],
                                params)
        return sum(int(np.prod(x.shape)) for name, v in shapes.items() if name not in ("embed", "vocab_ids")
                   for x in jax.tree_util.tree_leaves(v))

    base, row = size(1), size(2) - size(1)
    item = jnp.dtype(params["embed"].dtype).itemsize
    return lambda n: (row * n * item / 1e6, (base + row * (n - 1)) * item / 1e6)


def _given_vocab(kind, model, ds: DataSet, settings: dict, rc: "RunConfig", log) -> np.ndarray:
    """The vocabulary of ``rc.draft_vocab`` tokens: the whole one at the model's size, else the
    tokens the target ranks highest most often on the training shards (the EOS tokens always
    kept), with the coverage table of that size against others."""
    V = model.cfg.vocab_size
    require(rc.draft_vocab <= V, f"--draft_vocab {rc.draft_vocab} exceeds {model.cfg.name}'s {V} tokens")
    if rc.draft_vocab == V:
        return np.arange(V, dtype=np.int32)
    from specjax.drafters.device import frequent_tokens

    ids = frequent_tokens([s.ids for s in ds.train], V, rc.draft_vocab, keep=model.tokenizer.eos_ids)
    print_vocab_table(kind, model, ds, settings, rc.shared_head, rc.draft_vocab, log)
    return ids


def print_vocab_table(kind, model, ds: DataSet, settings: dict, shared_head: bool, chosen: int | None = None,
                      log: Callable[[str], None] = say) -> list[dict]:
    rows = vocab_table(ds, model.cfg.vocab_size, model.tokenizer.eos_ids,
                       head_cost(kind, model.cfg, model.params, settings, shared_head))
    pick = chosen or choose_vocab(rows)["size"]
    log(f"[draft vocabulary: the target's top-k ids counted on the training shards; coverage of its top-1 on the "
        f"held-out answers]\n{format_vocab_table(rows, pick)}")
    return rows


# ------------------------------------------------------------------------------------------ train


def _write_pipeline(ck: str, kind, ids, settings: dict, shared: bool, run: dict) -> None:
    spec = {"kind": kind.name, "vocab_ids": [int(i) for i in ids], "settings": settings, "shared_head": shared,
            "run": run}
    if not ondisk.write(os.path.join(ck, PIPELINE_FILE), json.dumps(spec).encode()):
        raise SpecjaxError(f"cannot write {ck}/{PIPELINE_FILE}")


def train(kind, model, ds: DataSet, rc: RunConfig, tc: tr.TrainConfig, log: Callable[[str], None] = say,
          kill_after: int = 0) -> dict:
    """Train (or go on training) a head of ``kind`` for the target ``model`` on ``ds`` as the
    module docstring says. Returns {"step", "tokens", "planned", "trainable" (host arrays),
    "stopped" (why it returned before the plan's end, or None)}. ``kill_after`` (tests): return
    after that many steps of this call without saving anything, as a kill would."""
    from tqdm import tqdm

    from specjax import plots
    from specjax.distill import head_online
    from specjax.distill.checkpoint import DistillCheckpoints, fingerprint
    from specjax.drafters import heads

    rc.check()
    cfg, ck = model.cfg, rc.checkpoint_dir
    trained_settings = tuple(s for s, _ in kind.options)  # (not what a head derives after training: Medusa's tree)
    settings = heads.settings_of(kind, dict(rc.settings), cfg, trained_settings)  # (those not given: defaults)
    if kind.check is not None:
        kind.check(rc.k, settings)
    feats = kind.features(cfg, **settings)
    if ds.features != tuple(feats):
        raise SpecjaxError(f"{ds.directory} keeps the target features of layers {list(ds.features)}; a "
                           f"{kind.title} head reads {list(feats)}: make its data set with --drafter {kind.name} "
                           "(--data_texts_from reuses this one's text)")
    # (a head that does not attend trains from its windows' second entry: the first reads the hidden state
    # of the position before the window, which the loss of Medusa-like heads leaves out)
    C = rc.context if kind.attends else 1
    rows, counts = windows(ds.train, rc.window, C, rc.prompt_loss)
    order = Order(rows, counts, rc.batch, rc.seed)
    tc = plan(order, rc, tc)
    planned = tc.total_steps
    opt = tr.make_optimizer(tc)
    run = {"kind": kind.name, "data": ds.digest(), "batch": rc.batch, "window": rc.window, "context": C,
           "planned_steps": planned, "seed": rc.seed, "unroll": rc.unroll if kind.unrolls else None,
           "prompt_loss": rc.prompt_loss, "train": tr.run_record(tc)}
    if rc.init_head:  # (only then: the runs before it resume with the record they wrote)
        run["init_head"] = os.path.abspath(rc.init_head)

    # the head: a new one (its vocabulary measured), or the one this directory's run trains
    os.makedirs(ck, exist_ok=True)
    blob = ondisk.read(os.path.join(ck, PIPELINE_FILE))
    if blob is not None:
        saved = json.loads(blob)
        ids, shared = np.asarray(saved["vocab_ids"], np.int32), saved["shared_head"]
        # (a run of before a setting: that setting's default)
        was = heads.settings_of(kind, saved["settings"], cfg, trained_settings)
        had = dict(saved["run"], **{f"settings.{k}": v for k, v in was.items()}, shared_head=shared,
                   draft_vocab=rc.draft_vocab and len(ids))
        now = dict(run, **{f"settings.{k}": v for k, v in settings.items()}, shared_head=rc.shared_head,
                   draft_vocab=rc.draft_vocab)
        bad = differ(had, now)
        if bad:
            raise SpecjaxError(f"{ck} trains a run of other settings ({', '.join(bad[:4])} differ: {bad[0]} "
                               f"{had.get(bad[0])} there, {now.get(bad[0])} now); give the same ones to go on, or a "
                               "new --checkpoint_dir")
    elif rc.init_head:
        start = heads.read_spec(kind, rc.init_head, cfg)
        # (the settings a run trains with; what a head derives after training, Medusa's tree, is not one)
        head_settings = {k: start[k] for k in settings}
        grows = head_settings != settings and kind.grow is not None
        require((head_settings == settings or grows) and bool(start.get("shared_head")) == rc.shared_head,
                f"--init_head {rc.init_head} is a head of other settings ({head_settings}, shared_head "
                f"{bool(start.get('shared_head'))}) than this run's ({settings}, shared_head {rc.shared_head})")
        if grows:
            log(f"[--init_head {rc.init_head}: its head ({head_settings}) grown to this run's settings ({settings})]")
        ids, shared = start["vocab_ids"], rc.shared_head
        if rc.draft_vocab:
            # a shared head's vocabulary rows are the target's own (rebuilt from the ids, never
            # trained), so it can draft from a vocabulary counted again on this run's data, of its
            # own size too (new data, new frequent tokens)
            require(shared, f"--init_head {rc.init_head} has trained vocabulary rows, so it keeps its "
                    f"{len(ids):,} tokens: leave --draft_vocab out")
            ids = _given_vocab(kind, model, ds, settings, rc, log)
        _write_pipeline(ck, kind, ids, settings, shared, run)
    else:
        if rc.draft_vocab:
            ids = _given_vocab(kind, model, ds, settings, rc, log)
        else:
            table = print_vocab_table(kind, model, ds, settings, rc.shared_head, log=log)
            ids = choose_vocab(table)["ids"]
        shared = rc.shared_head
        _write_pipeline(ck, kind, ids, settings, shared, run)
    draft, dparams = kind.init(cfg, model.params, ids, seed=rc.seed, shared_head=shared, **settings)
    if rc.init_head:  # (fine-tuning: the saved head's own arrays in place of a new head's)
        saved = heads.trainable_of(draft, heads.load_head(kind, rc.init_head, cfg, model.params)[1])
        # (a kind that grows heads takes the saved arrays through its grow: the same ones where the
        # settings match, and a resumed run of a grown head needs the grown shapes to restore into)
        dparams = {**dparams, **(kind.grow(heads.trainable_of(draft, dparams), saved) if kind.grow else saved)}
    trainer = head_online.HeadTrainer(draft, tc, opt, rc.unroll)
    trainable = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), heads.trainable_of(draft, dparams))
    frozen = {k: v for k, v in dparams.items() if k not in trainable}
    state = opt.init(trainable)
    fp = {**fingerprint(cfg, draft.cfg, trainable, ids), "pipeline": run["data"]}
    store = DistillCheckpoints(os.path.join(ck, STATE_DIR), fp, max_to_keep=2)
    record = {"step": 0, "epoch": 0, "batch": 0, "tokens": 0, "seed": rc.seed, "dropped": 0, "train_s": 0.0,
              "history": [], "evals": [], "snapshot_tokens": 0, "run": run}
    got = store.restore(_host(trainable), _host(state))
    if got is not None:
        _, trainable, state, record = got
        if record.get("run") != run:
            raise SpecjaxError(f"{ck}/{STATE_DIR} holds a run of other settings or data "
                               f"({', '.join(differ(record.get('run') or {}, run)[:4])} differ)")
        log(f"[resumed {ck} at step {record['step']:,} of {planned:,} (epoch {record['epoch']}, batch "
            f"{record['batch']}; {record['tokens']:,} training tokens)]")

    pl = Placement(rc.data_parallel)
    if pl.mesh is not None:
        log(f"[data parallel over {rc.data_parallel} {jax.devices()[0].platform} devices: "
            f"{rc.batch // rc.data_parallel} windows per device per step]")
    trainable, state, frozen_d = pl.replicated(trainable), pl.replicated(state), pl.replicated(frozen)

    def batch_at(step: int):
        idx = order.at(step)
        b = et.window_batch([(ds.train[int(s)].sequence(int(q)), int(a), int(f)) for s, q, a, f in rows[idx]],
                            rc.window)
        return pl.rows(b), int(counts[idx].sum())

    def stored_eval(trainable) -> tuple[float, float]:
        """``shard_estimate`` on the held-out shard, with the head as served (its saved dtype)."""
        own = jax.tree_util.tree_map(lambda a: a.astype(rc.head_dtype).astype(a.dtype), trainable)
        return shard_estimate(kind, draft, {**frozen_d, **own}, ds.eval, rc, pl)

    dt = model.params["embed"].dtype

    def serving(trainable):  # the params as served: the saved dtype, the target's dtype at run time
        own = jax.tree_util.tree_map(lambda a: jnp.asarray(jnp.asarray(np.asarray(a), rc.head_dtype), dt),
                                     _host(trainable))
        return {**frozen, **own}

    held = None
    prompts = [ds.eval.prompt(i) for i in range(min(rc.eval_prompts, len(ds.eval)))]

    def engine_eval(trainable) -> tuple[float, int]:
        nonlocal held
        from specjax.distill.heads_offline import HeldOut
        from specjax.drafters.device import FeatureHeadDrafter

        if held is None:
            new = min(ENGINE_EVAL_TOKENS, int(ds.spec["settings"]["max_new_tokens"]))
            held = HeldOut(model, FeatureHeadDrafter(draft, serving(trainable)), prompts, new, rc.k)
        else:
            held.backend.swap_draft_params(serving(trainable))
        return held.measure()

    def evaluate(step, tokens, engine: bool):
        top1, est = stored_eval(trainable)
        line = (f"held-out at step {step:,} ({tokens:,} tokens): top-1 agreement {top1:.3f}, estimated "
                f"{est:.3f} tokens per verify step at K={rc.k} (stored data)")
        acc = same = None
        if engine:
            acc, same = engine_eval(trainable)
            line += f"; engine {acc:.3f} ({same}/{len(prompts)} identical to AR)"
        record["evals"].append([step, tokens, top1, est, acc, same])
        log(line)
        draw()

    title = (f"{kind.title} head on {cfg.name}: {len(ids):,}-token head, batch {rc.batch} x {rc.window}, "
             f"{planned:,} steps planned")

    def draw():
        if rc.plot:
            plots.head_training(rc.plot, record["history"], record["evals"], rc.k, title)

    after_round = kind.resolve("after_round")

    def save(final: bool = False):
        host_t = _host(trainable)
        snapshot = record["tokens"] > 0 and (final or record["tokens"] >= SNAPSHOT_GROWTH * record["snapshot_tokens"])
        if snapshot:
            record["snapshot_tokens"] = record["tokens"]
        store.save_next(host_t, _host(state), record)
        to_save = draft
        if after_round is not None:
            to_save, report = after_round(draft, serving(trainable), [ds.eval.sequence(i) for i in range(len(ds.eval))])
            log(report)
        last = record["evals"][-1] if record["evals"] else None
        training = {"tokens": record["tokens"], "steps": record["step"], "planned_steps": planned,
                    "heldout": None if last is None else {"step": last[0], "top1": last[2], "estimate": last[3],
                                                          "engine": last[4]}}
        full = {**frozen, **host_t}
        heads.save_head(kind, ck, cfg, full, to_save, dtype=jnp.dtype(rc.head_dtype), training=training)
        if snapshot:
            heads.save_head(kind, os.path.join(ck, "snapshots", f"tokens-{record['tokens']:012d}"), cfg, full,
                            to_save, dtype=jnp.dtype(rc.head_dtype), training=training)
        draw()

    step, tokens = int(record["step"]), int(record["tokens"])
    log(f"[{kind.title} head, {len(ids):,} tokens, {ds.summary()}; {len(rows):,} windows of {rc.window} "
        f"({C} context), {order.steps_per_epoch:,} steps per epoch; plan: {planned:,} steps of {rc.batch} windows "
        f"(~{order.tokens_per_step:,.0f} training tokens each, {planned * order.tokens_per_step:,.0f} in all), "
        f"warm-up {tc.warmup_steps:,} steps, peak lr {tc.lr:g}]")
    if step >= planned:
        log(f"[{ck} has trained its {planned:,} planned steps already; a longer run needs a new --checkpoint_dir]")
        return {"step": step, "tokens": tokens, "planned": planned, "trainable": _host(trainable), "stopped": None}
    if step == 0 and not record["evals"] and rc.eval_every:
        evaluate(0, 0, rc.engine_eval_every > 0)

    stop: dict = {"why": None}
    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, lambda *_: stop.update(why="SIGTERM")) if main else None
    sched = tr.schedule(tc)
    t_start = t_ck = time.perf_counter()
    train_s0, this_run = float(record["train_s"]), 0
    t_log, tok_log, losses = t_start, tokens, []
    pool = concurrent.futures.ThreadPoolExecutor(1)
    nxt = pool.submit(batch_at, step)
    bar = tqdm(total=planned, initial=step, desc=f"{kind.name} head", unit="step", disable=None, file=sys.stderr)
    try:
        while step < planned:
            batch, n_tok = nxt.result()
            if step + 1 < planned:
                nxt = pool.submit(batch_at, step + 1)
            trainable, state, loss, ok = trainer.step(trainable, state, frozen_d, batch)
            step, tokens, this_run = step + 1, tokens + n_tok, this_run + 1
            if bool(ok):
                losses.append(float(loss))
            else:
                record["dropped"] += 1
            e, b = order.cursor(step)
            record.update(step=step, epoch=e, batch=b, tokens=tokens,
                          train_s=train_s0 + time.perf_counter() - t_start)
            bar.update(1)
            if kill_after and this_run >= kill_after:
                return {"step": step, "tokens": tokens, "planned": planned, "trainable": _host(trainable),
                        "stopped": "killed"}
            if step % rc.log_every == 0 or step == planned:
                now = time.perf_counter()
                rate = (tokens - tok_log) / max(now - t_log, 1e-9)
                mean = float(np.mean(losses)) if losses else float("nan")
                record["history"].append([step, tokens, mean])
                bar.set_postfix(loss=f"{mean:.4f}", tok_s=f"{rate:,.0f}")
                log(f"step {step:,}/{planned:,} | epoch {step / order.steps_per_epoch:.2f} | {tokens:,} tokens | "
                    f"{rate:,.0f} tokens/s | loss {mean:.4f} | lr {float(sched(step)):.2e}" +
                    (f" | {record['dropped']} steps dropped (non-finite)" if record["dropped"] else ""))
                t_log, tok_log, losses = now, tokens, []
            if rc.eval_every and (step % rc.eval_every == 0 or step == planned):
                evaluate(step, tokens, rc.engine_eval_every > 0 and (step % rc.engine_eval_every == 0
                                                                      or step == planned))
            over = rc.time_budget_hours and time.perf_counter() - t_start >= rc.time_budget_hours * 3600
            if over and stop["why"] is None:
                stop["why"] = "time budget"
            due = (rc.checkpoint_steps and step % rc.checkpoint_steps == 0) or \
                (rc.checkpoint_minutes and time.perf_counter() - t_ck >= rc.checkpoint_minutes * 60)
            if step == planned or due or stop["why"]:
                save(final=step == planned)
                t_ck = time.perf_counter()
            if stop["why"]:
                break
    finally:
        bar.close()
        pool.shutdown(wait=True)
        if main:
            signal.signal(signal.SIGTERM, old)
    if stop["why"]:
        log(f"{stop['why']}: stopped after step {step:,} of {planned:,} ({tokens:,} training tokens), checkpointed "
            f"in {ck}; the same command goes on from there")
    else:
        log(f"[trained {planned:,} steps ({tokens:,} training tokens, {record['train_s'] / 3600:.2f} h of training); "
            f"head saved to {ck} ({rc.head_dtype})]")
    return {"step": step, "tokens": tokens, "planned": planned, "trainable": _host(trainable), "stopped": stop["why"]}
