"""Training Medusa heads (drafters.medusa) toward their target, on the data the EAGLE trainer
makes (``eagle_train.make_sequences`` with ``features=(num_layers,)``: the target's last hidden
state at every position, and its top-k teacher there).

Head i (0-based) reads the hidden state h_t and predicts the token at t + 2 + i, which the
target's distribution at position t + 1 + i predicts (the teacher there: Medusa-2's
self-distillation, with the target's own distribution instead of the text's token). In a
``make_batch`` window, entry u carries h_{u-1} as its "previous feature", so head i at entry u is
trained toward the teacher at entry u + i. Heads are weighted 0.8^i (later drafts matter less, as
in the EAGLE trainer's unroll)."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import optax

from specjax.distill import divergences as dv
from specjax.distill.eagle_train import STEP_DECAY
from specjax.distill.train import TrainConfig, apply_if_finite, compute_view
from specjax.drafters.medusa import TREE_NODES, MedusaDraft, best_tree


def loss_fn(trainable, frozen, prev_feats, teacher, mask, *, draft: MedusaDraft, tc: TrainConfig):
    """Weighted mean over heads of the divergence between the teacher (TopK, restricted to the
    heads' tokens) at entry u + i and head i's logits from the hidden state of entry u - 1,
    over the entries where ``mask`` [B, T] holds at u + i (and u > 0: entry 0 of a window that
    starts a sequence has no hidden state before it)."""
    dparams, prev_feats = compute_view(({**frozen, **trainable}, prev_feats), tc)
    teacher, covered = dv.restrict(jax.lax.stop_gradient(teacher), frozen["vocab_ids"], draft.cfg.vocab_size)
    T = prev_feats.shape[1]
    lg = draft.reduced(dparams, prev_feats).astype(jnp.float32)  # [B, T, H, N]
    ok = mask & covered
    total, weight = 0.0, 0.0
    for i in range(min(draft.heads, T - 1)):
        t_i = jax.tree_util.tree_map(lambda a: a[:, i:], teacher)
        per = dv.divergence(tc.divergence, t_i, lg[:, :T - i, i], temperature=tc.temperature, beta=tc.beta)
        total += STEP_DECAY ** i * dv.mean_over(per, ok[:, i:] & (jnp.arange(T - i) > 0)[None, :])
        weight += STEP_DECAY ** i
    return total / weight


@partial(jax.jit, static_argnames=("draft", "tc", "optimizer"))
def train_step(trainable, opt_state, frozen, prev_feats, teacher, mask, *, draft: MedusaDraft, tc: TrainConfig,
               optimizer: optax.GradientTransformation):
    """One optimizer step of the heads; returns (trainable, opt_state, loss, ok) as train.train_step."""
    loss, grads = jax.value_and_grad(loss_fn)(trainable, frozen, prev_feats, teacher, mask, draft=draft, tc=tc)
    return apply_if_finite(trainable, opt_state, loss, grads, optimizer)


def batch_step(trainable, opt_state, frozen, batch, *, draft: MedusaDraft, tc: TrainConfig,
               optimizer: optax.GradientTransformation, unroll: int = 0):
    """``train_step`` on an ``eagle_train.make_batch`` batch (the Medusa kind's
    HeadKind.train_step): the heads read only the hidden states; ``unroll`` does not apply."""
    _, prev, _, teacher, mask = batch
    return train_step(trainable, opt_state, frozen, prev, teacher, mask, draft=draft, tc=tc, optimizer=optimizer)


@partial(jax.jit, static_argnames=("draft", "k"))
def chain_hits(dparams, batch, *, draft: MedusaDraft, k: int):
    """Which drafts of a greedy chain agree with the target (the Medusa kind's
    HeadKind.chain_hits): (hits, valid) [B, T, k] for the chain whose pending token is at window
    entry u. Draft j is head j on the hidden state entry u carries (h_{u-1}); it hits when its
    top-1 is the target's top-1 at entry u + j. ``valid``: u > 0 (entry 0 of a window that starts
    a sequence has no hidden state) and entry u + j is in the window and trained on (``mask``)."""
    from specjax.distill.eagle_train import shift_left

    _, prev, _, teacher, mask = batch
    T = mask.shape[1]
    top = dparams["vocab_ids"][jnp.argmax(draft.reduced(dparams, prev, k), axis=-1)]  # [B, T, k]
    top1 = teacher.ids[..., 0]
    after0 = (jnp.arange(T) > 0)[None, :]
    hits = [top[:, :, j] == shift_left(top1, j, -1) for j in range(k)]
    valid = [shift_left(mask, j) & after0 for j in range(k)]
    return jnp.stack(hits, -1), jnp.stack(valid, -1)


def accuracy(draft: MedusaDraft, dparams, seqs, ranks: int = 4):
    """[heads, ranks]: how often head i's rank-r token is the target's own greedy choice i + 1
    positions after the hidden state's (the chance ``medusa.best_tree`` builds its tree from),
    over the positions of ``seqs`` (``eagle_train.HeadSequence`` with Medusa's features) whose
    next token the target wrote."""
    import numpy as np

    H = draft.heads
    hits, total = np.zeros((H, ranks)), np.zeros(H)
    top = jax.jit(lambda dp, h: jax.lax.top_k(draft.reduced(dp, h), ranks)[1])
    ids = np.asarray(dparams["vocab_ids"])
    for s in seqs:
        L = len(s.tokens)
        if L < 3:
            continue
        got = ids[np.asarray(top(dparams, jnp.asarray(s.feats, dparams["w"].dtype)))]  # [L, H, ranks]
        best = s.ids[:, 0]
        for i in range(H):
            t = np.arange(max(s.start - 1 - i, 0), L - 1 - i)  # position t + 1 + i: the target wrote its next
            if t.size == 0:
                continue
            hits[i] += (got[t, i, :] == best[t + 1 + i, None]).sum(axis=0)
            total[i] += t.size
    return hits / np.maximum(total, 1)[:, None]


def after_round(draft: MedusaDraft, dparams, seqs) -> tuple[MedusaDraft, str]:
    """The heads with the tree their held-out accuracy on ``seqs`` makes best (saved with them:
    what they serve), and that accuracy as a report line (the Medusa kind's HeadKind.after_round)."""
    acc = accuracy(draft, dparams, seqs)
    report = "  held-out top-1..4 accuracy per head: " + "; ".join(
        f"head {i}: " + " ".join(f"{a:.2f}" for a in row) for i, row in enumerate(acc))
    return dataclasses.replace(draft, tree=best_tree(acc, TREE_NODES)), report
