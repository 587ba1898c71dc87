"""The jitted speculative step and its table of precompiled variants.

One step, for every row of a batch bucket:
  1. draft K tokens (device drafters run here; host drafters pass them in),
  2. run the target on the block ``[pending, d_1..d_K]`` at per-row positions,
  3. verify (greedy / lossless sampling, see verify.py),
  4. commit ``n + 1`` cache entries per active row (rollback = not advancing).

K = 0 is plain autoregressive decoding through the same code path. K, the batch
bucket, the cache slots and greedy-only are static; every variant the generator may
use is lowered and compiled ahead of time into ``StepTable`` so that generation
never traces or compiles.

Draft-model cache invariant: at the start of a step the draft cache holds at least
the first ``L_t - 1`` committed tokens (L_t = target length), so the draft first
re-feeds ``[prev, pending]`` (prev = last committed token) at positions
``L_t - 1, L_t``; this also fills the one entry a fully accepted step left out.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from specjax import cache as kv
from specjax.config import ModelConfig
from specjax.models import llama
from specjax.sampling import SamplingArrays, probs_from_logits, sample
from specjax.verify import SALT_DRAFT, stream_keys, verify_chain, _sample_rows
from specjax.verify_tree import verify_tree


@dataclasses.dataclass(frozen=True)
class DraftSpec:
    """Static description of the drafter as the jitted step sees it.

    kind: "host" (tokens passed in: prompt lookup, suffix, none) or "model"
    (an independent draft model or the target's first ``num_layers`` layers).
    """

    kind: str = "host"
    cfg: ModelConfig | None = None
    num_layers: int | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepState:
    cache: kv.KVCache
    dcache: Any  # KVCache of the draft model, or None
    prev: jax.Array  # [B] last committed token
    pending: jax.Array  # [B] sampled, not yet in the cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
    tokens: jax.Array  # [B, K+1]: accepted drafts then the correction/bonus token
    n_accepted: jax.Array  # [B]
    num_draft: jax.Array  # [B] drafts actually proposed


def _draft_with_model(dparams, state: StepState, K: int, samp: SamplingArrays, draft: DraftSpec, greedy_only: bool):
    """K autoregressive draft steps; returns drafts [B, K], q [B, K, V] (None if greedy_only), dcache."""
    dcfg = draft.cfg
    B = state.pending.shape[0]
    dc = kv.set_lengths(state.dcache, state.cache.lengths - 1)
    blk = jnp.stack([state.prev, state.pending], axis=1)
    pos = dc.lengths[:, None] + jnp.arange(2, dtype=jnp.int32)[None, :]
    logits, dc = llama.forward(dparams, blk, pos, dc, llama.causal_mask(B, 2), cfg=dcfg, num_layers=draft.num_layers,
                               logits_at=jnp.ones((B, 1), jnp.int32))
    dc = kv.advance(dc, jnp.full((B,), 2, jnp.int32))
    toks, qs = [], []
    for j in range(K):
        lg = logits[:, 0]
        if greedy_only:
            d = jnp.argmax(lg, axis=-1).astype(jnp.int32)
        else:
            q = probs_from_logits(lg, samp)
            keys = stream_keys(samp.seed, (state.cache.lengths + 1 + j)[:, None], SALT_DRAFT)[:, 0]
            d = _sample_rows(keys, q)
            qs.append(q)
        toks.append(d)
        if j < K - 1:
            logits, dc = llama.forward(dparams, d[:, None], dc.lengths[:, None], dc, llama.causal_mask(B, 1), cfg=dcfg,
                                       num_layers=draft.num_layers)
            dc = kv.advance(dc, jnp.ones((B,), jnp.int32))
    drafts = jnp.stack(toks, axis=1)
    q_all = None if greedy_only else jnp.stack(qs, axis=1)
    return drafts, q_all, dc


def spec_step(params, dparams, state: StepState, draft_tokens, num_draft, active, samp: SamplingArrays, *,
              cfg: ModelConfig, K: int, draft: DraftSpec, greedy_only: bool, attention_impl: str = "xla"):
    B = state.pending.shape[0]
    q = None
    dcache = state.dcache
    if K > 0 and draft.kind == "model":
        draft_tokens, q, dcache = _draft_with_model(dparams, state, K, samp, draft, greedy_only)
        # num_draft from the host: K for speculating rows, 0 for rows served without speculation.
        num_draft = jnp.minimum(num_draft, K)
    num_draft = jnp.where(active, num_draft, 0)
    cache = state.cache
    block = jnp.concatenate([state.pending[:, None], draft_tokens[:, :K]], axis=1)  # [B, K+1]
    pos = cache.lengths[:, None] + jnp.arange(K + 1, dtype=jnp.int32)[None, :]
    logits, cache = llama.forward(params, block, pos, cache, llama.causal_mask(B, K + 1), cfg=cfg,
                                  attention_impl=attention_impl)
    tokens, n, _ = verify_chain(logits, draft_tokens[:, :K], num_draft, samp, cache.lengths + 1, q, greedy_only)
    cache = kv.advance(cache, jnp.where(active, n + 1, 0))
    prev = jnp.where(active, jnp.take_along_axis(block, n[:, None], axis=1)[:, 0], state.prev)
    pending = jnp.where(active, jnp.take_along_axis(tokens, n[:, None], axis=1)[:, 0], state.pending)
    new_state = StepState(cache=cache, dcache=dcache, prev=prev, pending=pending)
    return new_state, StepOutput(tokens=tokens, n_accepted=n, num_draft=num_draft)


def tree_mask_and_depth(parents):
    """Ancestor mask [B, N, N] and depths [B, N] of per-row trees (parents [B, N], topological,
    parents[:, 0] = -1), built on device so the host only ships the parents array."""
    B, N = parents.shape
    eye = jnp.eye(N, dtype=bool)

    def body(i, c):
        m, d = c
        par = jnp.maximum(parents[:, i], 0)
        row = jnp.take_along_axis(m, par[:, None, None], axis=1)[:, 0] | eye[i][None, :]
        m = jax.lax.dynamic_update_slice_in_dim(m, row[:, None, :], i, axis=1)
        d = jax.lax.dynamic_update_slice_in_dim(d, (jnp.take_along_axis(d, par[:, None], axis=1) + 1), i, axis=1)
        return m, d

    m0 = jnp.broadcast_to(eye[0], (B, 1, N))
    m0 = jnp.concatenate([m0, jnp.zeros((B, N - 1, N), bool)], axis=1)
    return jax.lax.fori_loop(1, N, body, (m0, jnp.zeros((B, N), jnp.int32)))


def spec_tree_step(params, dparams, state: StepState, tree_tokens, parents, node_valid, active, samp: SamplingArrays,
                   *, cfg: ModelConfig, N: int, greedy_only: bool, attention_impl: str = "xla"):
    """One step with a host-proposed token tree of N nodes per row (node 0 = the pending token;
    tree_tokens[:, 0] is ignored). The tree runs at positions ``lengths + depth`` under its
    ancestor mask, is verified (verify_tree), and the accepted path's K/V entries are moved
    to contiguous slots before the length advances. Returns (state, StepOutput) with
    ``tokens[B, N]`` = accepted drafts then the correction/bonus."""
    del dparams  # host drafters only
    cache = state.cache
    B = state.pending.shape[0]
    tokens = tree_tokens.at[:, 0].set(state.pending)
    node_valid = node_valid & active[:, None]
    mask, depth = tree_mask_and_depth(parents)
    pos = cache.lengths[:, None] + depth
    logits, cache = llama.forward(params, tokens, pos, cache, mask, cfg=cfg, attention_impl=attention_impl)
    path, out, n, valid = verify_tree(logits, tokens, parents, node_valid, samp, cache.lengths + 1, None, greedy_only)
    # Accepted node path[i] was written at slot lengths + path[i]; it belongs at lengths + i.
    cache = kv.gather_block(cache, path, jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (B, N)),
                            valid & (path != jnp.arange(N)[None, :]))
    cache = kv.advance(cache, jnp.where(active, n + 1, 0))
    last = jnp.take_along_axis(path, n[:, None], axis=1)[:, 0]
    prev = jnp.where(active, jnp.take_along_axis(tokens, last[:, None], axis=1)[:, 0], state.prev)
    pending = jnp.where(active, jnp.take_along_axis(out, n[:, None], axis=1)[:, 0], state.pending)
    num_draft = jnp.sum(node_valid[:, 1:], axis=1).astype(jnp.int32)
    return StepState(cache=cache, dcache=state.dcache, prev=prev, pending=pending), StepOutput(
        tokens=out, n_accepted=n, num_draft=num_draft)


def spec_prefill(params, dparams, tokens, n_valid, samp: SamplingArrays, *, cfg: ModelConfig, slots: int,
                 draft: DraftSpec, greedy_only: bool, attention_impl: str = "xla") -> StepState:
    """Prompts [B, Tp] (row b valid up to n_valid[b] >= 1) into fresh target (and draft) caches."""
    B, T = tokens.shape
    dtype = params["embed"].dtype
    cache = llama.init_cache_for(cfg, B, slots, dtype)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    mask = llama.causal_mask(B, T)
    last = jnp.maximum(n_valid - 1, 0)[:, None]
    logits, cache = llama.forward(params, tokens, pos, cache, mask, cfg=cfg, use_prefix=False, logits_at=last,
                                  attention_impl=attention_impl)
    cache = kv.set_lengths(cache, n_valid)
    pending = sample(logits[:, 0], samp, n_valid, greedy_only)
    prev = jnp.take_along_axis(tokens, last, axis=1)[:, 0]
    dcache = None
    if draft.kind == "model":
        dcfg = draft.cfg
        dcache = llama.init_cache_for(dcfg, B, slots, dparams["embed"].dtype, num_layers=draft.num_layers)
        # The draft holds the first n_valid - 1 tokens; the next step re-feeds [prev, pending].
        _, dcache = llama.forward(dparams, tokens, pos, dcache, mask, cfg=dcfg, num_layers=draft.num_layers,
                                  use_prefix=False, logits_at=last)
        dcache = kv.set_lengths(dcache, n_valid - 1)
    return StepState(cache=cache, dcache=dcache, prev=prev, pending=pending)


_STATIC = ("cfg", "K", "draft", "greedy_only", "attention_impl")
spec_step_jit = jax.jit(spec_step, static_argnames=_STATIC, donate_argnames=("state",))
spec_tree_step_jit = jax.jit(spec_tree_step, static_argnames=("cfg", "N", "greedy_only", "attention_impl"),
                             donate_argnames=("state",))
spec_prefill_jit = jax.jit(spec_prefill, static_argnames=("cfg", "slots", "draft", "greedy_only", "attention_impl"))
