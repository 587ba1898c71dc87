"""The jitted speculative step and its table of precompiled variants.

One step, for every row of a batch bucket:
  1. draft K tokens (device drafters run here; host drafters pass them in),
  2. run the target on the block ``[pending, d_1..d_K]`` at per-row positions,
  3. verify (greedy / lossless sampling, see verify.py),
  4. commit ``n + 1`` cache entries per active row (rollback = not advancing).

K = 0 is plain autoregressive decoding through the same code path; ``spec_decode`` runs several
steps in one call (an on-device loop over that same step: plain ones, or a device drafter's). K, the batch
bucket, the cache slots and greedy-only are static; every variant the generator may
use is lowered and compiled ahead of time into ``StepTable`` so that generation
never traces or compiles.

Every static choice (shapes, K, verify rule, device drafter, forward options) is one
``CompileKey``. Device drafters (``drafters.device``: a draft model or layer skip) are part of
it, with pure ``prefill`` / ``draft`` functions the step calls with the draft's own params.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax import cache as kv
from specjax.engine.compile_key import CompileKey
from specjax.models import llama
from specjax.sampling import SamplingArrays, sample
from specjax.verify import verify_chain
from specjax.verify_tree import verify_tree


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepState:
    cache: kv.KVCache
    dcache: Any  # KVCache of the draft model, or None
    prev: jax.Array  # [B] last committed token
    pending: jax.Array  # [B] sampled, not yet in the cache


def pin(layout, state: StepState) -> StepState:
    """A returned state constrained to a sharded engine's layout (every variant, row operations
    included, hands the next one its state in the same shardings: the live state never reshards)."""
    return state if layout is None else layout.pin_state(state)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
    tokens: jax.Array  # [B, K+1]: accepted drafts then the correction/bonus token
    n_accepted: jax.Array  # [B]
    num_draft: jax.Array  # [B] drafts actually proposed
    host: jax.Array  # [B, K+3] int32: tokens | n_accepted | num_draft, what the host reads in one transfer
    # key.teacher = k > 0: the target's k largest logits and their token ids at each block
    # position [B, K+1, k] (online distillation's teacher signal; positions past n_accepted were
    # computed after a rejected draft and mean nothing)
    teacher_ids: jax.Array | None = None
    teacher_logits: jax.Array | None = None
    # tree steps: [B, K] the accepted drafts' node numbers (1-based, in path order; 0 past
    # n_accepted), in ``host`` between the tokens and the counts (TreeNodeRates learns from them)
    path: jax.Array | None = None

    @staticmethod
    def of(tokens, n_accepted, num_draft, logits=None, teacher: int = 0, path=None) -> "StepOutput":
        cols = [tokens] + ([path] if path is not None else []) + [n_accepted[:, None], num_draft[:, None]]
        host = jnp.concatenate(cols, axis=1).astype(jnp.int32)
        ids = vals = None
        if teacher:
            vals, ids = jax.lax.top_k(logits.astype(jnp.float32), teacher)
        return StepOutput(tokens=tokens, n_accepted=n_accepted, num_draft=num_draft, host=host,
                          teacher_ids=ids, teacher_logits=vals, path=path)


def spec_step(params, dparams, state: StepState, draft_tokens, num_draft, active, samp: SamplingArrays, q=None,
              pack=None, *, key: CompileKey):
    """``key.draft``: the device drafter (None: the drafts are ``draft_tokens``, from the host or,
    for op "verify", from a draft call with their draft distributions ``q`` [B, width, V] when
    sampling). ``pack`` [key.tokens]: the block positions of the real tokens (each active row's
    pending token and its num_draft drafts), when rows carry different draft counts: the
    target's dense layers then run on those rows only (llama.forward)."""
    cfg, K, draft, greedy_only, fwd = key.cfg, key.k, key.draft, key.greedy_only, key.fwd
    B = state.pending.shape[0]
    if q is not None:
        q = q[:, :K]
    dcache, carry = state.dcache, None
    if K > 0 and draft is not None:  # the drafter's own drafts (and what its upkeep needs after the step)
        draft_tokens, q, dcache, carry = draft.chain_drafts(dparams, dcache, state, draft_tokens[:, :K], num_draft,
                                                            active, K, samp, greedy_only)
        # num_draft from the host: K for speculating rows, 0 for rows served without speculation.
        num_draft = jnp.minimum(num_draft, K)
    num_draft = jnp.where(active, num_draft, 0)
    cache = state.cache
    block = jnp.concatenate([state.pending[:, None], draft_tokens[:, :K]], axis=1)  # [B, K+1]
    pos = cache.lengths[:, None] + jnp.arange(K + 1, dtype=jnp.int32)[None, :]
    logits, cache, *feats = llama.forward(params, block, pos, cache, llama.causal_mask(B, K + 1), cfg=cfg,
                                          fwd=fwd, pack=pack, layout=key.layout, features=key.features)
    tokens, n, _ = verify_chain(logits, draft_tokens[:, :K], num_draft, samp, cache.lengths + 1, q, greedy_only)
    if draft is not None:  # (K = 0 too: a plain step the draft keeps up with)
        dcache = draft.after_chain(dparams, dcache, carry, block, feats[0] if feats else None, cache.lengths,
                                   jnp.where(active, n + 1, 0), active, K)
    cache = kv.advance(cache, jnp.where(active, n + 1, 0))
    prev = jnp.where(active, jnp.take_along_axis(block, n[:, None], axis=1)[:, 0], state.prev)
    pending = jnp.where(active, jnp.take_along_axis(tokens, n[:, None], axis=1)[:, 0], state.pending)
    new_state = pin(key.layout, StepState(cache=cache, dcache=dcache, prev=prev, pending=pending))
    return new_state, StepOutput.of(tokens, n, num_draft, logits, key.teacher)


def spec_decode(params, dparams, state: StepState, active, num_draft, left, eos_rows, eos_mask, samp: SamplingArrays,
                limit, stop_first, *, key: CompileKey):
    """Up to ``min(key.steps, limit)`` steps in one call: the chain ``spec_step`` of ``key.k``
    drafts in a ``while_loop``, so the host pays one dispatch and one transfer for them. K = 0 is
    plain decoding; K > 0 needs a device drafter (its drafts are made inside each step; row b
    drafts ``num_draft[b]`` <= K of them, 0 for a row served without speculation). Row b runs
    while it is ``active``, has emitted fewer than ``left[b]`` tokens and (``eos_rows[b]``) no EOS
    (``eos_mask`` [V]: the EOS ids) among them, the rule the engine applies to emitted tokens
    (the host cuts a step's tokens where it stops); a row that stops stays inactive, so its cache
    does not advance. ``stop_first`` (a bool scalar): the call also ends after the first step at
    which some row stops, so that a request waiting for a row takes it exactly when single steps
    would give it one. Sampling keys follow positions, so the tokens are those of single steps.
    Returns (state, [B, steps * (K + 1) + steps + 1] int32): per step its K + 1 token slots, then
    per step the drafts it accepted (-1: the row did not run it), then the steps the row ran."""
    B, n, K = state.pending.shape[0], key.steps, key.k
    one = dataclasses.replace(key, op="step", steps=0)  # the chain step, compiled key and all
    no_drafts, zeros = jnp.zeros((B, max(K, 1)), jnp.int32), jnp.zeros((B,), jnp.int32)
    slots = jnp.arange(K + 1)[None, :]

    start = active & (left > 0)

    def go(c):
        i, _, _, _, _, _, live = c
        return (i < jnp.minimum(limit, n)) & jnp.any(live) & ~(stop_first & jnp.any(start & ~live))

    def body(c):
        i, st, toks, acc, count, ran, live = c
        st, out = spec_step(params, dparams, st, no_drafts, jnp.where(live, num_draft, 0), live, samp, key=one)
        toks = jax.lax.dynamic_update_slice_in_dim(toks, jnp.where(live[:, None], out.tokens, 0)[:, None], i, axis=1)
        acc = jax.lax.dynamic_update_slice_in_dim(acc, jnp.where(live, out.n_accepted, -1)[:, None], i, axis=1)
        emitted = slots <= out.n_accepted[:, None]
        count = count + jnp.where(live, out.n_accepted + 1, 0)
        ran = ran + live.astype(jnp.int32)
        eos = jnp.any(eos_mask[out.tokens] & emitted, axis=1)
        live = live & (count < left) & ~(eos_rows & eos)
        return i + 1, st, toks, acc, count, ran, live

    c = (jnp.int32(0), state, jnp.zeros((B, n, K + 1), jnp.int32), jnp.full((B, n), -1, jnp.int32), zeros, zeros,
         start)
    _, state, toks, acc, _, ran, _ = jax.lax.while_loop(go, body, c)
    return state, jnp.concatenate([toks.reshape(B, n * (K + 1)), acc, ran[:, None]], axis=1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftOutput:
    tokens: jax.Array  # [B, P] drafts (0 past a row's proposal)
    q: Any  # [B, P, V] draft distributions, or None when greedy-only
    host: jax.Array  # [B, 2P + 1] float32: tokens | confidences | proposed, read in one transfer


def spec_draft(params, dparams, state: StepState, active, samp: SamplingArrays, threshold, *, key: CompileKey):
    """A device drafter's confidence-cut proposal (Algorithm 3) as its own call, before the policy
    chooses K: up to ``key.k`` drafts per active row into the draft cache; the target is untouched
    (the verify step that follows reads the drafts from the device)."""
    del params
    P = key.k
    toks, q, conf, n, dcache = key.draft.propose(dparams, state.dcache, state.prev, state.pending,
                                                 state.cache.lengths, P, samp, key.greedy_only, active, threshold)
    host = jnp.concatenate([toks.astype(jnp.float32), conf, n[:, None].astype(jnp.float32)], axis=1)
    if key.layout is not None:  # placed as the verify step that reads them expects them
        toks, q = (None if a is None else jax.lax.with_sharding_constraint(a, key.layout.rows(a.shape))
                   for a in (toks, q))
    return pin(key.layout, dataclasses.replace(state, dcache=dcache)), DraftOutput(tokens=toks, q=q, host=host)


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
                   pack=None, *, key: CompileKey):
    """One step with a host-proposed token tree of N nodes per row (node 0 = the pending token;
    tree_tokens[:, 0] is ignored). The tree runs at positions ``lengths + depth`` under its
    ancestor mask, is verified (verify_tree), and the accepted path's K/V entries are moved
    to contiguous slots before the length advances. Returns (state, StepOutput) with
    ``tokens[B, N]`` = accepted drafts then the correction/bonus. ``pack``: as for spec_step
    (the valid nodes of every active row). ``key.draft``: a device tree drafter (Medusa's static
    tree, EAGLE-2's dynamic one) whose tree replaces ``tree_tokens`` / ``parents`` (``node_valid``
    still says how many nodes each row verifies; ModelDraft.tree_drafts / after_tree)."""
    cfg, N, greedy_only, fwd = key.cfg, key.k + 1, key.greedy_only, key.fwd
    cache, dcache = state.cache, state.dcache
    B = state.pending.shape[0]
    if key.draft is not None:
        tree_tokens, parents, dcache = key.draft.tree_drafts(dparams, dcache, state.pending, cache.lengths, N - 1)
        parents = jnp.broadcast_to(parents, (B, N))
    tokens = tree_tokens.at[:, 0].set(state.pending)
    node_valid = node_valid & active[:, None]
    mask, depth = tree_mask_and_depth(parents)
    pos = cache.lengths[:, None] + depth
    logits, cache, *feats = llama.forward(params, tokens, pos, cache, mask, cfg=cfg, fwd=fwd, pack=pack,
                                          layout=key.layout, features=key.features)
    path, out, n, valid = verify_tree(logits, tokens, parents, node_valid, samp, cache.lengths + 1, None, greedy_only)
    if key.draft is not None:
        dcache = key.draft.after_tree(dparams, dcache, tokens, path, feats[0] if feats else None, cache.lengths,
                                      jnp.where(active, n + 1, 0))
    # Accepted node path[i] was written at slot lengths + path[i]; it belongs at lengths + i.
    cache = kv.gather_block(cache, path, jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (B, N)),
                            valid & (path != jnp.arange(N)[None, :]))
    cache = kv.advance(cache, jnp.where(active, n + 1, 0))
    last = jnp.take_along_axis(path, n[:, None], axis=1)[:, 0]
    prev = jnp.where(active, jnp.take_along_axis(tokens, last[:, None], axis=1)[:, 0], state.prev)
    pending = jnp.where(active, jnp.take_along_axis(out, n[:, None], axis=1)[:, 0], state.pending)
    num_draft = jnp.sum(node_valid[:, 1:], axis=1).astype(jnp.int32)
    new_state = pin(key.layout, StepState(cache=cache, dcache=dcache, prev=prev, pending=pending))
    accepted_nodes = jnp.where(jnp.arange(1, N)[None, :] <= n[:, None], path[:, 1:], 0)
    return new_state, StepOutput.of(out, n, num_draft, path=accepted_nodes)


def fresh_state(params, dparams, B: int, key: CompileKey) -> StepState:
    """Empty caches (target, and the draft's when ``key.draft``) of ``key.slots`` slots for B rows:
    what a first prefill chunk writes into, and, under ``jax.eval_shape``, the abstract state every
    step is compiled for (without tracing the model)."""
    cache = llama.init_cache_for(key.cfg, B, key.slots, params["embed"].dtype)
    dcache = None if key.draft is None else key.draft.init_cache(B, key.slots, dparams["embed"].dtype)
    zeros = jnp.zeros((B,), jnp.int32)
    return StepState(cache=cache, dcache=dcache, prev=zeros, pending=zeros)


def spec_prefill(params, dparams, tokens, n_valid, samp: SamplingArrays, state: StepState | None = None, *,
                 key: CompileKey) -> StepState:
    """One prefill chunk: row b's next ``n_valid[b]`` prompt tokens (``tokens`` [B, C], padded) at
    positions from its cache length on; they attend to the row's cached prefix and to one another
    (causal). ``state`` None (op "prefill"): the first chunk, into fresh target (and, with
    ``key.draft``, draft) caches; otherwise (op "chunk") the state the earlier chunks left.
    A prompt longer than the largest chunk runs as several calls (buckets.prefill_chunks), so its
    cost follows its length and the attention scores of a call are [C, prefix + C], never the
    whole prompt's square. ``pending`` / ``prev`` are each row's first sampled token and its last
    prompt token once its prompt is done (rows with no token in a chunk keep theirs).
    The whole chunk as one program; ``prefill_embed`` + ``prefill_layer`` per layer +
    ``prefill_finish`` are the same computation as 2 + L calls (StepTable's layered prefill)."""
    first = state is None
    if first:
        state = fresh_state(params, dparams, tokens.shape[0], key)
    B, C = tokens.shape
    pos = state.cache.lengths[:, None] + jnp.arange(C, dtype=jnp.int32)[None, :]
    # (float32 activations under int8 / bfloat16 rows: a prompt token's values do not depend on its chunk)
    logits, cache, *feats = llama.forward(params, tokens, pos, state.cache, llama.causal_mask(B, C), cfg=key.cfg,
                                          use_prefix=not first, logits_at=_last(n_valid), fwd=key.fwd.for_prefill(),
                                          layout=key.layout, features=key.features)
    return _prefill_end(dparams, tokens, n_valid, samp, dataclasses.replace(state, cache=cache), logits, feats, first,
                        key)


def _last(n_valid):
    return jnp.maximum(n_valid - 1, 0)[:, None]


def _prefill_end(dparams, tokens, n_valid, samp: SamplingArrays, state: StepState, logits, feats, first: bool,
                 key: CompileKey) -> StepState:
    """A prefill chunk after the target's forward (``state.cache`` holds the chunk's entries, not
    yet counted): advance, sample each finished row's first token, the draft's own prefill."""
    B, C = tokens.shape
    pos = state.cache.lengths[:, None] + jnp.arange(C, dtype=jnp.int32)[None, :]
    cache = kv.advance(state.cache, n_valid)
    has = n_valid > 0
    pending = jnp.where(has, sample(logits[:, 0], samp, cache.lengths, key.greedy_only), state.pending)
    prev = jnp.where(has, jnp.take_along_axis(tokens, _last(n_valid), axis=1)[:, 0], state.prev)
    dcache = state.dcache
    if layered_draft(key):  # its layers ran as calls of their own: its chunk is written, not yet counted
        dcache = kv.advance(dcache, n_valid)
    elif key.draft is not None:
        # (a feature head also takes the target's features)
        dcache = key.draft.prefill(dparams, dcache, tokens, pos, llama.causal_mask(B, C), n_valid, first, *feats)
    return pin(key.layout, StepState(cache=cache, dcache=dcache, prev=prev, pending=pending))


def layered_draft(key: CompileKey) -> bool:
    """Whether a layered prefill's draft runs its layers as calls of ``prefill_layer`` too
    (``prefill_as_layers``): embed gives its embeddings and finish only counts its chunk."""
    return bool(key.part) and key.draft is not None and key.draft.prefill_as_layers


# A layered prefill: the chunk as 2 + L calls of three small programs instead of one program of
# L layers. On XLA:CPU a 30-layer prefill program takes 2-3 s to compile and one layer about a
# tenth of a second, while a prefill chunk is compute-bound, so the L - 1 extra calls cost
# nothing measurable; a cold job waits for several chunk sizes before its first answer.
# (One device, XLA attention: the layer index is a run-time value.)
def prefill_embed(params, dparams, tokens, *, key: CompileKey):
    """The chunk's token embeddings, the draft model's (``layered_draft``; else None), and (op
    "prefill") the fresh state the layers write into (else None)."""
    dx = dparams["embed"][tokens] if layered_draft(key) else None
    state = fresh_state(params, dparams, tokens.shape[0], key) if key.op == "prefill" else None
    return params["embed"][tokens], dx, state


def prefill_layer(lp, x, cache: kv.KVCache, layer, *, key: CompileKey):
    """Decoder layer ``layer`` (traced) of the chunk: (x, cache); the cache is donated."""
    return llama.decoder_layer(lp, x, cache, layer, cfg=key.cfg, fwd=key.fwd.for_prefill(),
                               use_prefix=key.op == "chunk")


def prefill_finish(params, dparams, tokens, n_valid, samp: SamplingArrays, x, state: StepState, feats, *,
                   key: CompileKey) -> StepState:
    """The last layer's output through the head, then ``_prefill_end``; ``feats``: the inputs
    of ``key.features``' layers, in order (a feature head's signal)."""
    logits, _ = llama.final_logits(params, x, cfg=key.cfg, fwd=key.fwd.for_prefill(), logits_at=_last(n_valid))
    feats = (jnp.concatenate(feats, axis=-1),) if key.features else ()
    return _prefill_end(dparams, tokens, n_valid, samp, state, logits, feats, key.op == "prefill", key)


spec_step_jit = jax.jit(spec_step, static_argnames=("key",), donate_argnames=("state",))
spec_tree_step_jit = jax.jit(spec_tree_step, static_argnames=("key",), donate_argnames=("state",))
spec_prefill_jit = jax.jit(spec_prefill, static_argnames=("key",))
spec_chunk_jit = jax.jit(spec_prefill, static_argnames=("key",), donate_argnames=("state",))
spec_draft_jit = jax.jit(spec_draft, static_argnames=("key",), donate_argnames=("state",))
spec_decode_jit = jax.jit(spec_decode, static_argnames=("key",), donate_argnames=("state",))
prefill_embed_jit = jax.jit(prefill_embed, static_argnames=("key",))
prefill_layer_jit = jax.jit(prefill_layer, static_argnames=("key",), donate_argnames=("cache",))
prefill_finish_jit = jax.jit(prefill_finish, static_argnames=("key",), donate_argnames=("state",))
