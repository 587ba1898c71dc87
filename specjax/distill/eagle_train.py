"""Training an EAGLE feature head (drafters.eagle) toward its target: the data, EAGLE-3's
training-time test, and one pure jitted optax step (train.make_optimizer, train.apply_if_finite).

Data: sequences the target writes itself (greedy or sampled continuations of prompts, written
through the engine: ``distill.head_data.TargetWriter``), then ONE teacher-forced target forward
per sequence with ``features=`` (``target_signal``): the three feature layers at every position
and the target's top-k logits there (the teacher, as the self-draft distiller keeps it;
restricted to a reduced head's tokens by divergences.restrict).

Training-time test (``unrolled_logits``): the head is unrolled ``steps`` times past its
teacher-forced pass, each time on its OWN output hidden states, exactly as ``EagleDraft``
drafts a chain. Entry (j, q) is unroll step j at position q: token x_q at rope position q, with
feature g^0_q = fc(F_{q-1}) (the target's real feature of the position before) for j = 0 and
g^j_q = h^{j-1}_{q-1} (the head's own output of step j - 1 at the previous position) for j >= 1;
its logits predict x_{q+1} (teacher: the target's distribution at q). When drafting from the
pending token at p, draft j is entry (j, p + j): it attends to the committed entries (real
features, positions <= p) and to its own chain's earlier entries (i, p + i), i = 1..j - 1. So
entry (j, q) attends to (0, r) for r <= q - j and to (i, q - j + i) for 1 <= i <= j
(``ttt_mask``). Step j runs the head's layers (``llama._layer``, as serving runs them) on its T
entries, each attending over its concatenated K/V of steps 0..j with that mask (``kv_before``).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax.config import ModelConfig
from specjax.distill import divergences as dv
from specjax.distill.train import TrainConfig, apply_if_finite, compute_view
from specjax.drafters.eagle import EagleDraft
from specjax.models import llama

STEP_DECAY = 0.8  # loss weight of unroll step j: 0.8^j (EAGLE-3's), later drafts matter less


def ttt_mask(T: int, steps: int) -> np.ndarray:
    """[(steps + 1) T, (steps + 1) T] bool: which entries entry (j, q) (row j T + q) attends to."""
    j = np.repeat(np.arange(steps + 1), T)
    q = np.tile(np.arange(T), steps + 1)
    J, Q, I, R = j[:, None], q[:, None], j[None, :], q[None, :]
    real = (I == 0) & (R <= Q - J)  # committed entries, up to the chain's base
    chain = (I >= 1) & (I <= J) & (R - I == Q - J)  # this chain's own earlier entries and itself
    return real | chain


def unrolled_logits(draft: EagleDraft, dparams, tokens, prev_feats, positions, steps: int) -> list[jax.Array]:
    """Reduced-vocabulary logits [B, T, N] of unroll steps 0..``steps`` (module docstring).
    ``tokens`` [B, T]; ``prev_feats`` [B, T, 3D]: the target's features of the position before
    each token (zeros before the first); ``positions`` [B, T]."""
    B, T = tokens.shape
    g = draft._fuse(dparams, prev_feats)
    # where the layer writes a step's K/V (read back); T + 1 slots: never a multiple of the attention
    # chunk, so the plain XLA attention runs (the chunked one's dynamic loop has no reverse mode)
    cache = llama.init_cache_for(draft.cfg, B, T + 1, g.dtype)
    full = ttt_mask(T, steps)
    L = draft.cfg.num_layers
    ks, vs, out = [[] for _ in range(L)], [[] for _ in range(L)], []  # per layer, per step
    for j in range(steps + 1):
        before = tuple((jnp.concatenate(ks[i], 1), jnp.concatenate(vs[i], 1)) for i in range(L)) if j else None
        mask = jnp.broadcast_to(jnp.asarray(full[j * T:(j + 1) * T, :(j + 1) * T]), (B, T, (j + 1) * T))
        h, dc = draft._forward(dparams, cache, tokens, g, positions, mask, use_prefix=False, kv_before=before)
        for i in range(L):
            ks[i].append(dc.k[i, :, :, :T].transpose(0, 2, 1, 3))  # [B, Hkv, T, hd] -> [B, T, Hkv, hd]
            vs[i].append(dc.v[i, :, :, :T].transpose(0, 2, 1, 3))
        out.append(draft._reduced(dparams, h))
        g = jnp.concatenate([jnp.zeros_like(h[:, :1]), h[:, :-1]], axis=1)  # step j + 1's features
    return out


def loss_fn(trainable, frozen, tokens, prev_feats, positions, teacher, mask, *, draft: EagleDraft, tc: TrainConfig,
            steps: int):
    """Mean over unroll steps (weights STEP_DECAY^j) of the divergence between the teacher
    (TopK at every position, restricted to the head's tokens) and step j's logits, over the
    positions where ``mask`` [B, T] holds and step j's chain starts inside the window."""
    dparams, prev_feats = compute_view(({**frozen, **trainable}, prev_feats), tc)
    teacher, covered = dv.restrict(jax.lax.stop_gradient(teacher), frozen["vocab_ids"], draft.cfg.vocab_size)
    T = tokens.shape[1]
    total, weight = 0.0, 0.0
    for j, lg in enumerate(unrolled_logits(draft, dparams, tokens, prev_feats, positions, steps)):
        per = dv.divergence(tc.divergence, teacher, lg.astype(jnp.float32), temperature=tc.temperature, beta=tc.beta)
        total += STEP_DECAY ** j * dv.mean_over(per, mask & covered & (jnp.arange(T) >= j)[None, :])
        weight += STEP_DECAY ** j
    return total / weight


@partial(jax.jit, static_argnames=("draft", "tc", "optimizer", "steps"))
def train_step(trainable, opt_state, frozen, tokens, prev_feats, positions, teacher, mask, *, draft: EagleDraft,
               tc: TrainConfig, optimizer: optax.GradientTransformation, steps: int):
    """One optimizer step of the head; returns (trainable, opt_state, loss, ok) as train.train_step."""
    loss, grads = jax.value_and_grad(loss_fn)(trainable, frozen, tokens, prev_feats, positions, teacher, mask,
                                              draft=draft, tc=tc, steps=steps)
    return apply_if_finite(trainable, opt_state, loss, grads, optimizer)


def batch_step(trainable, opt_state, frozen, batch, *, draft: EagleDraft, tc: TrainConfig,
               optimizer: optax.GradientTransformation, unroll: int):
    """``train_step`` on a ``make_batch`` batch (the EAGLE kind's HeadKind.train_step)."""
    return train_step(trainable, opt_state, frozen, *batch, draft=draft, tc=tc, optimizer=optimizer, steps=unroll)


def shift_left(x, j: int, fill=False):
    """``x`` [B, T, ...] moved j positions earlier along T (``fill`` past the end): entry p of the
    result is entry p + j of ``x``."""
    if j == 0:
        return x
    pad = jnp.full((x.shape[0], j) + x.shape[2:], fill, x.dtype)
    return jnp.concatenate([x[:, j:], pad], axis=1)


@partial(jax.jit, static_argnames=("draft", "k"))
def chain_hits(dparams, batch, *, draft: EagleDraft, k: int):
    """Which drafts of a greedy chain agree with the target (the EAGLE kind's
    HeadKind.chain_hits): (hits, valid) [B, T, k] for the chain whose pending token is at window
    entry p. Draft j of that chain is unroll entry (j, p + j) (module docstring); it hits when its
    top-1 is the target's top-1 there. On greedy text (the drafts that hit are the text's own
    tokens) the leading hits are what verification accepts, up to the window's attention context.
    ``valid``: entry p + j is in the window and its next token is trained on (``mask``)."""
    tokens, prev, pos, teacher, mask = batch
    top1 = teacher.ids[..., 0]
    hits, valid = [], []
    for j, lg in enumerate(unrolled_logits(draft, dparams, tokens, prev, pos, k - 1)):
        hit = dparams["vocab_ids"][jnp.argmax(lg, axis=-1)] == top1
        hits.append(shift_left(hit, j))
        valid.append(shift_left(mask, j))
    return jnp.stack(hits, -1), jnp.stack(valid, -1)


# ------------------------------------------------------------------------------------------ data


@partial(jax.jit, static_argnames=("cfg", "features", "k"))
def target_signal(params, tokens, *, cfg: ModelConfig, features: tuple[int, ...], k: int):
    """One teacher-forced target forward over ``tokens`` [B, T]: (features [B, T, 3D], top-k ids
    [B, T, k], their logits [B, T, k]) at every position."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    logits, _, feats = llama.forward(params, tokens, positions, llama.init_cache_for(cfg, B, T),
                                     llama.causal_mask(B, T), cfg=cfg, use_prefix=False, features=features)
    vals, ids = jax.lax.top_k(logits.astype(jnp.float32), k)
    return feats, ids.astype(jnp.int32), vals


@dataclasses.dataclass
class HeadSequence:
    """One training sequence: ``tokens`` [L] (prompt then the target's continuation), ``start``
    (the first position whose next token the target wrote: prompt length - 1), the target's
    ``feats`` [L, 3D] (bfloat16: half the memory) and top-k ``ids`` / ``logits`` [L, k]."""

    tokens: np.ndarray
    start: int
    feats: np.ndarray
    ids: np.ndarray
    logits: np.ndarray


def make_sequences(cfg: ModelConfig, params, prompts, outputs, *, topk: int, batch: int = 4, length_bucket: int = 64,
                   progress: Callable[[int], None] | None = None, features: tuple[int, ...] | None = None
                   ) -> list[HeadSequence]:
    """Features and teacher of every (prompt, output) pair: one target forward per sequence, in
    batches padded to a multiple of ``length_bucket`` (few compiled shapes). ``features``: the
    layers whose inputs are kept (default: the EAGLE head's; Medusa's: the last layer's output)."""
    feats_at = llama.feature_layers(cfg.num_layers) if features is None else tuple(features)
    seqs = [(list(p) + list(o), len(p) - 1) for p, o in zip(prompts, outputs)]
    out: list[HeadSequence] = []
    for i in range(0, len(seqs), batch):
        chunk = seqs[i:i + batch]
        T = -(-max(len(t) for t, _ in chunk) // length_bucket) * length_bucket
        toks = np.zeros((batch, T), np.int32)
        for r, (t, _) in enumerate(chunk):
            toks[r, :len(t)] = t
        f, ids, vals = target_signal(params, jnp.asarray(toks), cfg=cfg, features=feats_at, k=topk)
        f, ids, vals = np.asarray(f.astype(jnp.bfloat16)), np.asarray(ids), np.asarray(vals)
        for r, (t, s) in enumerate(chunk):
            L = len(t)
            out.append(HeadSequence(np.asarray(t, np.int32), s, f[r, :L].copy(), ids[r, :L].copy(), vals[r, :L].copy()))
        if progress:
            progress(len(chunk))
    return out


def save_texts(path: str, seqs: Sequence[HeadSequence]) -> bool:
    """The sequences' tokens and starts (not their features: ``load_texts`` recomputes them), so
    a resumed run trains on all the text earlier runs had the target write."""
    import io

    from specjax import ondisk

    buf = io.BytesIO()
    np.savez(buf, tokens=np.concatenate([s.tokens for s in seqs]) if seqs else np.zeros(0, np.int32),
             lengths=np.asarray([len(s.tokens) for s in seqs], np.int64), starts=np.asarray([s.start for s in seqs]))
    return ondisk.write(path, buf.getvalue())


def load_texts(path: str) -> list[tuple[list[int], list[int]]]:
    """(prompt, output) pairs saved by ``save_texts`` (none if the file is missing or damaged)."""
    import io

    from specjax import ondisk

    blob = ondisk.read(path)
    if blob is None:
        return []
    z = np.load(io.BytesIO(blob))
    cuts = np.cumsum(z["lengths"])[:-1]
    return [(t[:s + 1].tolist(), t[s + 1:].tolist()) for t, s in zip(np.split(z["tokens"], cuts), z["starts"])]


def make_batch(seqs: Sequence[HeadSequence], rng: np.random.Generator, B: int, T: int, dtype=np.float32,
               prompt_loss: bool = False):
    """B random sequences as a training batch of windows of T positions (each sequence's last T,
    padded at the end): ``window_batch``, the loss on the positions whose next token the target
    wrote (``prompt_loss``: every real position, the target's distribution over the prompt's next
    tokens too)."""
    rows = []
    for i in rng.integers(0, len(seqs), size=B):
        s = seqs[i]
        rows.append((s, max(0, len(s.tokens) - T), 0 if prompt_loss else s.start))
    return window_batch(rows, T, dtype)


def window_batch(rows, T: int, dtype=np.float32):
    """A training batch of one window of T positions per row: ``rows`` holds (HeadSequence, a,
    loss_from), the window covering positions a .. a + T - 1 (padded past the sequence's end).
    Returns (tokens, prev_feats, positions, dv.TopK teacher, mask) [B, T, ...]: ``prev_feats`` at
    entry u the target's features of position a + u - 1 (zeros before position 0), ``mask`` the
    real positions >= ``loss_from`` (the positions before it, inside the window, are context a
    head's attention reads, not trained on)."""
    B = len(rows)
    D3 = rows[0][0].feats.shape[1]
    k = rows[0][0].ids.shape[1]
    toks = np.zeros((B, T), np.int32)
    prev = np.zeros((B, T, D3), dtype)
    pos = np.zeros((B, T), np.int32)
    ids = np.zeros((B, T, k), np.int32)
    lg = np.zeros((B, T, k), np.float32)
    mask = np.zeros((B, T), bool)
    for r, (s, a, loss_from) in enumerate(rows):
        L = min(len(s.tokens), a + T)
        n = L - a
        toks[r, :n] = s.tokens[a:L]
        pos[r, :n] = np.arange(a, L)
        pos[r, n:] = np.arange(L, L + T - n)
        prev[r, 1 if a == 0 else 0:n] = s.feats[max(a - 1, 0):L - 1]
        ids[r, :n], lg[r, :n] = s.ids[a:L], s.logits[a:L]
        mask[r, :n] = np.arange(a, L) >= loss_from
    return (jnp.asarray(toks), jnp.asarray(prev), jnp.asarray(pos), dv.TopK(jnp.asarray(ids), jnp.asarray(lg)),
            jnp.asarray(mask))
