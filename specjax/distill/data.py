"""Distillation data sampled offline (seed 003, section 4.1): who writes the sequences the draft
learns on.

Each output token is drawn from the token-level mixture ``beta p + (1 - beta) q`` of the target
p and the draft q at that position (both softened by ``temperature``; 0 takes the mixture's
most likely token): ``beta = 1`` is teacher sampling (the target's own text, what online
serving sees), ``beta = 0`` student sampling (the draft's, on-policy), in between the mixed
sampling of GKD. Whoever writes, the target's top-k logits at every output position are kept
as the teacher (``buffer.Record``, the same record online serving makes), so the draft then
trains on exactly the data the replay buffer would hold.

Batched with one KV cache per model, on the reference loop's steps (``reference_ar.prefill_logits``
/ ``decode_logits``); nothing shared with the serving engine.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import buckets as bk
from specjax.config import ModelConfig
from specjax.distill.buffer import Record
from specjax.drafters.device import ModelDraft
from specjax.errors import require
from specjax.models.options import ForwardOptions
from specjax.reference_ar import decode_logits, prefill_logits
from specjax.sampling import argmax

MODES = {"teacher": 1.0, "student": 0.0}  # "mixed" takes its beta


@partial(jax.jit, static_argnames=("k", "beta", "temperature"))
def _choose(key, p_logits, q_logits, *, k: int, beta: float, temperature: float):
    """The next token of every row from the mixture, and the target's top-k there."""
    vals, ids = jax.lax.top_k(p_logits.astype(jnp.float32), k)
    t = temperature or 1.0  # (0: the mixture's argmax, of the untempered distributions)
    lp = jax.nn.log_softmax(p_logits.astype(jnp.float32) / t, -1)
    lq = jax.nn.log_softmax(q_logits.astype(jnp.float32) / t, -1)
    lm = lp if beta == 1.0 else lq if beta == 0.0 else jnp.logaddexp(jnp.log(beta) + lp, jnp.log1p(-beta) + lq)
    tok = argmax(lm) if temperature == 0 else jax.random.categorical(key, lm, -1)
    return tok.astype(jnp.int32), ids.astype(jnp.int32), vals


def sample_records(cfg: ModelConfig, params, draft: ModelDraft, dparams, prompts: Sequence[Sequence[int]], *,
                   max_new_tokens: int, mode: str = "teacher", beta: float = 0.5, temperature: float = 1.0,
                   topk: int = 8, eos_ids: Sequence[int] = (), batch: int = 8, seed: int = 0,
                   progress: Callable[[int], None] | None = None) -> list[Record]:
    """One Record per prompt (in order): ``max_new_tokens`` tokens (fewer at an end-of-sequence
    id) written by ``mode`` ("teacher", "student" or "mixed" with ``beta``), with the target's
    top ``topk`` logits at every output position. ``progress(n)``: n more prompts done."""
    require(mode in ("teacher", "student", "mixed"), f"sampling mode must be teacher, student or mixed, got {mode!r}")
    b = MODES.get(mode, beta)
    require(0.0 <= b <= 1.0, f"the mixture's beta must be in [0, 1], got {beta}")
    require(temperature >= 0, f"temperature must be >= 0, got {temperature}")
    require(max_new_tokens >= 1 and topk >= 1 and batch >= 1, "max_new_tokens, topk and batch must be >= 1")
    for p in prompts:
        require(len(p) >= 1 and len(p) + max_new_tokens <= cfg.max_position,
                f"a prompt of {len(p)} tokens and {max_new_tokens} new ones do not fit {cfg.name}'s "
                f"{cfg.max_position} positions")
    eos = {int(e) for e in eos_ids}
    key = jax.random.PRNGKey(seed)
    out: list[Record] = []
    for i in range(0, len(prompts), batch):
        rows = [list(p) for p in prompts[i:i + batch]]
        n, B = len(rows), batch
        lens = np.array([len(p) for p in rows] + [1] * (B - n), np.int32)
        Tp = bk.prompt_bucket(int(lens.max()), cfg.max_position)
        slots = bk.slot_bucket(int(lens.max()) + max_new_tokens, cfg.max_position)
        toks = np.zeros((B, Tp), np.int32)
        for r, p in enumerate(rows):
            toks[r, :len(p)] = p
        fwd = ForwardOptions()
        pl, pc = prefill_logits(params, jnp.asarray(toks), jnp.asarray(lens), cfg=cfg, slots=slots, fwd=fwd)
        ql, qc = (None, None) if b == 1.0 else prefill_logits(dparams, jnp.asarray(toks), jnp.asarray(lens),
                                                              cfg=draft.cfg, slots=slots, fwd=fwd)
        every = jnp.ones((B,), bool)
        gen, ids, logits = [], [], []
        for _ in range(max_new_tokens):
            key, sub = jax.random.split(key)
            q_full = pl if ql is None else draft._full(dparams, ql)
            tok, top_ids, top_vals = _choose(sub, pl, q_full, k=topk, beta=b, temperature=temperature)
            gen.append(np.asarray(tok))
            ids.append(np.asarray(top_ids))
            logits.append(np.asarray(top_vals))
            if len(gen) == max_new_tokens:
                break
            pl, pc = decode_logits(params, pc, tok, every, cfg=cfg, fwd=fwd)
            if ql is not None:
                ql, qc = decode_logits(dparams, qc, tok, every, cfg=draft.cfg, fwd=fwd)
        gen, ids, logits = np.stack(gen, 1), np.stack(ids, 1), np.stack(logits, 1)  # [B, n_new(, k)]
        for r, p in enumerate(rows):
            g = [int(t) for t in gen[r]]
            stop = next((j + 1 for j, t in enumerate(g) if t in eos), len(g))
            P = len(p)
            out.append(Record(np.asarray(p + g[:stop], np.int32), np.arange(P - 1, P - 1 + stop, dtype=np.int32),
                              ids[r, :stop], logits[r, :stop].astype(np.float32), np.zeros(0, np.int32)))
        if progress:
            progress(n)
    return out
