"""Training a draft toward the target: a trainable draft, the optimizer, and one pure jitted
optax step.

A self-draft (``TrainableDraft.of``) is the target's embeddings and vocab head (shared, frozen)
with its own copies of the target's first n layers and of the final norm, the "exit", trained;
an independent draft model (``TrainableDraft.of_model``) trains its layers and norm the same
way. With ``vocab_ids`` the head is reduced to those N target tokens
(drafters.device.reduced_vocab) and the draft learns the teacher restricted to them
(divergences.restrict). Either runs in the engine as a ``ModelDraft`` whose trained params
swap in without recompiling any serving variant (same shapes).

``train_step`` minimises a divergence (divergences.py) between the teacher's distribution and
the draft's at the masked positions of token sequences. It is pure: params, optimizer state and
data in, new params and state out. A non-finite loss or gradient drops the update (params and
state come back unchanged) and says so in the returned ``ok`` flag, so a bad batch never leaves
a half-updated draft.
"""

from __future__ import annotations

import dataclasses
import functools
from functools import partial

import jax
import jax.numpy as jnp
import optax

from specjax.config import ModelConfig
from specjax.distill import divergences as dv
from specjax.drafters.device import ModelDraft, layer_skip, reduced_vocab
from specjax.errors import require
from specjax.models import llama


COMPUTE_DTYPES = ("float32", "bfloat16")


def default_compute_dtype() -> str:
    """The ``--distill_compute_dtype auto`` choice: bfloat16 on accelerators and on CPUs that
    multiply it natively (AVX512_BF16: an EAGLE step on SmolLM2 1.24x faster there, the log of
    2026-12-07, evening), float32 elsewhere (XLA:CPU's bfloat16 dot converts to float32 first)."""
    if jax.default_backend() != "cpu":
        return "bfloat16"
    from specjax.models.cpu import rows_dot

    return "bfloat16" if rows_dot.native_bf16() else "float32"


def compute_view(tree, tc: "TrainConfig"):
    """``tree``'s floating arrays in ``tc.compute_dtype``: what a loss computes with. The cast is
    inside the differentiated function, so gradients come back in each param's own dtype."""
    if tc.compute_dtype == "float32":
        return tree
    dt = jnp.dtype(tc.compute_dtype)
    return jax.tree_util.tree_map(lambda a: a.astype(dt) if jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating) else a,
                                  tree)


def run_record(tc: "TrainConfig") -> dict:
    """``tc`` as a run's record holds it (head_pipeline): float32 compute, the only one before
    ``compute_dtype`` existed, is left out, so runs recorded then resume."""
    d = dataclasses.asdict(tc)
    if d["compute_dtype"] == "float32":
        del d["compute_dtype"]
    return d


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """divergence: one of divergences.DIVERGENCES, at ``temperature`` (JSD with ``beta``).
    AdamW at ``lr`` with a linear warm-up over ``warmup_steps`` and cosine decay to
    ``lr * final_lr_fraction`` at ``total_steps``; gradients clipped to global norm ``clip_norm``.
    ``compute_dtype``: what the loss multiplies in (``compute_view``); the params, their
    gradients and the optimizer's state stay float32 (mixed precision, "bfloat16")."""

    divergence: str = "fkl"
    temperature: float = 1.0
    beta: float = 0.5
    lr: float = 1e-3
    warmup_steps: int = 10
    total_steps: int = 1000
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    compute_dtype: str = "float32"

    def __post_init__(self):
        require(self.compute_dtype in COMPUTE_DTYPES,
                f"unknown compute dtype {self.compute_dtype!r}; use one of {', '.join(COMPUTE_DTYPES)}")
        require(self.divergence in dv.DIVERGENCES,
                f"unknown divergence {self.divergence!r}; use one of {', '.join(dv.DIVERGENCES)}")
        require(self.temperature > 0, f"temperature must be > 0, got {self.temperature}")
        require(0 <= self.beta <= 1, f"JSD beta must be in [0, 1], got {self.beta}")
        require(self.lr > 0 and self.clip_norm > 0, "lr and clip_norm must be > 0")
        require(0 <= self.warmup_steps < self.total_steps,
                f"warmup_steps ({self.warmup_steps}) must be below total_steps ({self.total_steps})")


def schedule(tc: TrainConfig):
    """The learning rate at each step: 0 rising linearly to ``lr`` over ``warmup_steps``, then a
    cosine down to ``lr * final_lr_fraction`` at ``total_steps`` (and there after)."""
    return optax.warmup_cosine_decay_schedule(0.0, tc.lr, tc.warmup_steps, tc.total_steps,
                                              end_value=tc.lr * tc.final_lr_fraction)


@functools.lru_cache(maxsize=None)
def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """The optimizer of ``tc``: one object per config, so that drafts trained with the same
    config share train_step's compiled executable (the optimizer is a static argument)."""
    return optax.chain(optax.clip_by_global_norm(tc.clip_norm),
                       optax.adamw(schedule(tc), weight_decay=tc.weight_decay))


@dataclasses.dataclass(frozen=True)
class TrainableDraft:
    """A draft being trained: ``frozen`` params (the embedding and vocab head: for a self-draft
    the target's own, shared) and the initial ``trainable`` ones (the layers and the final norm,
    always copies). ``of``: a self-draft of the target's first ``num_layers`` layers; ``of_model``:
    an independent draft model sharing the target's tokenizer."""

    draft: ModelDraft
    frozen: dict
    trainable: dict

    @staticmethod
    def of(cfg: ModelConfig, params, num_layers: int, vocab_ids=None) -> "TrainableDraft":
        return TrainableDraft.of_model(*layer_skip(cfg, params, num_layers), vocab_ids=vocab_ids)

    @staticmethod
    def of_model(draft: ModelDraft, dparams, vocab_ids=None) -> "TrainableDraft":
        if vocab_ids is not None:
            draft, dparams = reduced_vocab(draft, dparams, vocab_ids)
        frozen = {k: v for k, v in dparams.items() if k in ("embed", "lm_head", "vocab_ids")}
        # copies, not the given arrays: training must never write into the target (or a loaded model)
        trainable = jax.tree_util.tree_map(jnp.array, {"layers": dparams["layers"], "final_norm": dparams["final_norm"]})
        return TrainableDraft(draft, frozen, trainable)

    def params(self, trainable: dict) -> dict:
        """The params pytree the engine's ModelDraft runs on."""
        return {**self.frozen, **trainable}


def sequence_logits(cfg: ModelConfig, params, tokens: jax.Array) -> jax.Array:
    """Next-token logits [B, T, V] at every position of ``tokens`` [B, T] (a causal forward from
    an empty cache)."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    cache = llama.init_cache_for(cfg, B, T)
    logits, _ = llama.forward(params, tokens, positions, cache, llama.causal_mask(B, T), cfg=cfg, use_prefix=False)
    return logits


def loss_fn(trainable, frozen, tokens, teacher, mask, *, cfg: ModelConfig, tc: TrainConfig):
    """Mean divergence between ``teacher`` (logits [B, T, V] or a divergences.TopK) and the
    draft's logits over the positions where ``mask`` [B, T] is true."""
    q = sequence_logits(cfg, compute_view({**frozen, **trainable}, tc), tokens).astype(jnp.float32)
    teacher = jax.lax.stop_gradient(teacher)
    if "vocab_ids" in frozen:  # a reduced head: its N columns against the teacher over those tokens
        teacher, covered = dv.restrict(teacher, frozen["vocab_ids"], cfg.vocab_size)
        mask = mask & covered
    per = dv.divergence(tc.divergence, teacher, q, temperature=tc.temperature, beta=tc.beta)
    return dv.mean_over(per, mask)


@partial(jax.jit, static_argnames=("cfg", "tc", "optimizer"))
def train_step(trainable, opt_state, frozen, tokens, teacher, mask, *, cfg: ModelConfig, tc: TrainConfig,
               optimizer: optax.GradientTransformation):
    """One optimizer step; returns (trainable, opt_state, loss, ok). ``cfg``: the draft's
    config (``TrainableDraft.draft.cfg``). Not ok (a non-finite loss or gradient): the inputs come
    back unchanged."""
    loss, grads = jax.value_and_grad(loss_fn)(trainable, frozen, tokens, teacher, mask, cfg=cfg, tc=tc)
    return apply_if_finite(trainable, opt_state, loss, grads, optimizer)


def apply_if_finite(trainable, opt_state, loss, grads, optimizer: optax.GradientTransformation):
    """The optimizer update of every trainer's step (this one's, distill.eagle_train's):
    (trainable, opt_state, loss, ok), the inputs unchanged where the loss or a gradient is not
    finite."""
    ok = jnp.isfinite(loss) & jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree_util.tree_leaves(grads)]))
    updates, new_state = optimizer.update(grads, opt_state, trainable)
    new = optax.apply_updates(trainable, updates)

    def keep(n, o):
        return jnp.where(ok, n, o)

    return jax.tree_util.tree_map(keep, new, trainable), jax.tree_util.tree_map(keep, new_state, opt_state), loss, ok


def update_or_none(step, trainable, opt_state, n: int):
    """An online update: ``n`` calls of ``step(trainable, opt_state) -> (trainable, opt_state,
    loss, ok)`` (each on a fresh batch). (trainable, opt_state, [losses]) after all of them, or
    (None, the first non-finite loss) when one was dropped: an update is applied whole or not at
    all (distill.online, distill.head_online)."""
    losses = []
    for _ in range(n):
        trainable, opt_state, loss, ok = step(trainable, opt_state)
        if not bool(ok):
            return None, float(loss)
        losses.append(float(loss))
    return trainable, opt_state, losses


def train_round(step, trainable, opt_state, n: int, desc: str):
    """A warm-up round (distill.offline, distill.heads_offline): ``n`` calls of ``step`` as for
    ``update_or_none``, but a step with a non-finite loss or gradient is skipped alone (it
    changed nothing) and the round goes on. Returns (trainable, opt_state, the kept steps'
    losses, how many were dropped); ``desc`` labels the progress bar."""
    from tqdm import tqdm

    losses, dropped = [], 0
    for _ in tqdm(range(n), desc=desc, unit="step", disable=None):
        trainable, opt_state, loss, ok = step(trainable, opt_state)
        if not bool(ok):
            dropped += 1
            continue
        losses.append(float(loss))
    return trainable, opt_state, losses, dropped
