"""Device drafters: proposers that run inside the jitted speculative step.

A device drafter is a frozen, hashable description (a static argument of the step, so part of
its compile key) with two pure functions the step calls with the draft's *own* params:

  prefill(dparams, dcache, tokens, positions, mask, n_valid, first) -> draft cache
      (one prefill chunk; the step re-feeds [prev, pending] before drafting anyway)
  draft(dparams, dcache, prev, pending, target_lengths, K, samp, greedy_only)
      -> (drafts [B, K], draft probabilities [B, K, V] or None when greedy_only, dcache)
  propose(..., P, samp, greedy_only, active, threshold)
      -> the same drafts for a proposal cut by confidence (SmartSpec Algorithm 3), run as its
         own call before the policy chooses K: (drafts, q, confidences, proposed, dcache)

``ModelDraft`` runs a Llama-family model: an independent draft model sharing the target's
tokenizer, or layer skip (``layer_skip``: the target's first n layers). A layer-skip draft's
params are a params tree of its own whose arrays are, until the draft is trained, the target's
(no copy); training replaces them and can never touch the target's. Either can carry a
reduced-vocabulary head (``reduced_vocab``: the draft's vocab projection over N chosen target
tokens, ``frequent_tokens``), which cuts the draft's largest matmul to N / V of its size; the
draft's logits are scattered back to the target's ids with -inf elsewhere, so tokens outside
the N are never proposed and q, the distribution drafts are drawn from, stays exact.
``DeviceDrafter`` is this kind of the engine's drafter protocol (``drafters.protocol``), the
draft-ahead path of confidence policies included.

Draft-cache invariant: at the start of a step the draft cache holds at least the first
``L_t - 1`` committed tokens (L_t = the target's length), so the draft first re-feeds
``[prev, pending]`` at positions ``L_t - 1, L_t``; this also fills the one entry a fully
accepted step left out.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import buckets as bk
from specjax import cache as kv
from specjax.config import ModelConfig
from specjax.drafters.protocol import TREE, Drafter, StepInputs, VerifyStep
from specjax.serving_types import Proposal
from specjax.errors import require
from specjax.goodput.acceptance import TreeNodeRates
from specjax.models import llama
from specjax.models.options import ForwardOptions
from specjax.sampling import SamplingArrays, argmax, probs_from_logits
from specjax.verify import SALT_DRAFT, _sample_rows, stream_keys


@dataclasses.dataclass(frozen=True)
class ModelDraft:
    """A Llama-family draft model run inside the step. ``cfg`` is the draft's own config (for layer
    skip: the target's with ``num_layers`` = n); ``label`` names it in perf-model keys and logs."""

    cfg: ModelConfig
    label: str = "draft_model"
    vocab: int = 0  # N rows of a reduced-vocabulary head (params "lm_head" [D, N], "vocab_ids" [N]); 0: full
    # the draft's own forward: its speed, never the output (drafts are verified). A layer-skip or
    # draft model on a rows-kernel engine runs the engine's, on the packs its params then carry
    fwd: ForwardOptions = ForwardOptions()
    features = ()  # target layers whose inputs the target forward hands it (a feature head's signal); none here
    drafts_trees = False  # it drafts token trees inside the tree step (``draft_tree``: Medusa, EAGLE-2)
    # its cache keeps up with plain (K = 0) steps too (a head's deferred window): a decode call in
    # which no row will ever draft may leave that out (DecodeStep.upkeep)
    plain_upkeep = False
    # a layered prefill may run its layers as calls of their own (a Llama-family draft model; a head,
    # which reads the target's features, prefills inside the finishing call)
    prefill_as_layers = True

    def max_drafts(self, trees: bool) -> int | None:
        """The most drafts (``trees``: tree nodes) one step can take; None: any K."""
        return None

    def tree_forwards(self) -> int:
        """Draft forwards one of its token trees costs whatever the node budget (the simulator's
        StepCostModel.draft_forwards); 0: one per node."""
        return 0

    def init_cache(self, B: int, slots: int, dtype) -> kv.KVCache:
        """The draft's empty cache for B rows (step.fresh_state)."""
        return llama.init_cache_for(self.cfg, B, slots, dtype)

    # ---- the compiled steps' hooks: engine.step calls these, whatever the kind, and a kind
    # overrides what its steps need (a head's upkeep, a hybrid's host rows)

    def chain_drafts(self, dparams, dcache, state, host_tokens, num_draft, active, K: int, samp: SamplingArrays,
                     greedy_only: bool):
        """The drafts a chain step of K verifies (``host_tokens`` [B, K]: what the host passed in;
        ``state``: the step's StepState): (tokens [B, K], their distributions q or None, the draft
        cache, a carry handed to ``after_chain``)."""
        toks, q, dc = self.draft(dparams, dcache, state.prev, state.pending, state.cache.lengths, K, samp, greedy_only)
        return toks, q, dc, None

    def after_chain(self, dparams, dcache, carry, block, feats, lengths, n_commit, active, K: int):
        """The draft cache after a chain step (K = 0: a plain step) verified ``block`` [B, K + 1]
        (``feats``: the target's features of it, or None; ``lengths``: the target's before the
        block; ``n_commit``: entries committed per row). A draft model re-derives what it needs
        from the target's lengths when it next drafts: nothing to do."""
        return dcache

    def tree_drafts(self, dparams, dcache, pending, lengths, n: int):
        """A token tree of ``n`` nodes drafted inside the tree step (``drafts_trees``): (tokens
        [B, n + 1], parents, the draft cache)."""
        tokens, parents = self.draft_tree(dparams, dcache, pending, lengths, n)
        return tokens, parents, dcache

    def after_tree(self, dparams, dcache, tokens, path, feats, lengths, n_commit):
        """The draft cache after a tree step accepted ``path`` (node numbers [B, N]) of ``tokens``."""
        return dcache

    def _full(self, dparams, lg):
        """Draft logits over the target's vocabulary: a reduced head's N columns go to their
        target ids, every other token gets -inf (probability 0: never drafted)."""
        if not self.vocab:
            return lg
        full = jnp.full(lg.shape[:-1] + (self.cfg.vocab_size,), -jnp.inf, lg.dtype)
        return full.at[..., dparams["vocab_ids"]].set(lg)

    def _ids(self, dparams, i):
        """Indices into the draft's own logits (a reduced head's N) -> target token ids."""
        return dparams["vocab_ids"][i] if self.vocab else i

    def prefill(self, dparams, dcache, tokens, positions, mask, n_valid, first: bool) -> kv.KVCache:
        """One prefill chunk into the draft cache (``first``: ``dcache`` is fresh, nothing to
        attend to before the chunk); the step's own prefill chunk, for the draft."""
        B = tokens.shape[0]
        _, dcache = llama.forward(dparams, tokens, positions, dcache, mask, cfg=self.cfg, use_prefix=not first,
                                  fwd=self.fwd.for_prefill(), logits_at=jnp.zeros((B, 1), jnp.int32))
        return kv.advance(dcache, n_valid)

    def _refeed(self, dparams, dcache: kv.KVCache, prev, pending, target_lengths):
        """Re-feed [prev, pending] at positions L_t - 1, L_t: logits for the first draft."""
        B = pending.shape[0]
        dc = kv.set_lengths(dcache, target_lengths - 1)
        blk = jnp.stack([prev, pending], axis=1)
        pos = dc.lengths[:, None] + jnp.arange(2, dtype=jnp.int32)[None, :]
        logits, dc = llama.forward(dparams, blk, pos, dc, llama.causal_mask(B, 2), cfg=self.cfg, fwd=self.fwd,
                                   logits_at=jnp.ones((B, 1), jnp.int32))
        return logits[:, 0], kv.advance(dc, jnp.full((B,), 2, jnp.int32))

    def _next(self, dparams, dc: kv.KVCache, d):
        """Feed one drafted token per row: logits for the next draft."""
        B = d.shape[0]
        logits, dc = llama.forward(dparams, d[:, None], dc.lengths[:, None], dc, llama.causal_mask(B, 1),
                                   cfg=self.cfg, fwd=self.fwd)
        return logits[:, 0], kv.advance(dc, jnp.ones((B,), jnp.int32))

    def _pick(self, dparams, lg, j, target_lengths, samp: SamplingArrays, greedy_only: bool):
        """Draft j of every row from the draft's own logits (a reduced head's N): (token, its
        warped distribution over the target's vocabulary or None, confidence = the draft's
        probability of the token it proposes, Algorithm 3). Greedy drafting reads the N logits
        alone: the tokens outside a reduced head have probability 0, so its argmax and top
        probability are the full vocabulary's (a tie takes the first of the N: the same token
        where the ids ascend, as ``frequent_tokens`` lists them) without writing and reading V of
        them for each draft."""
        if greedy_only:
            d = self._ids(dparams, argmax(lg))
            conf = jnp.max(jax.nn.softmax(lg.astype(jnp.float32), axis=-1), axis=-1)
            return d, None, conf
        lg = self._full(dparams, lg)
        q = probs_from_logits(lg, samp)
        keys = stream_keys(samp.seed, (target_lengths + 1 + j)[:, None], SALT_DRAFT)[:, 0]
        d = _sample_rows(keys, q)
        # Greedy rows have a one-hot q: their confidence is the model's own top probability.
        p1 = jax.nn.softmax(lg.astype(jnp.float32), axis=-1)
        conf = jnp.where(samp.temperature > 0, jnp.take_along_axis(q, d[:, None], axis=1)[:, 0],
                         jnp.max(p1, axis=-1))
        return d, q, conf

    def draft(self, dparams, dcache: kv.KVCache, prev, pending, target_lengths, K: int, samp: SamplingArrays,
              greedy_only: bool):
        """K autoregressive draft tokens per row (greedy, or sampled from the warped draft
        distribution with the (seed, position) draft stream): the fused step's drafter. Drafts
        2..K run as a loop whose body is one draft forward, so the step's program holds the draft
        model twice (re-feed, loop body) whatever K: unrolled, SmolLM2 drafting for itself at K = 4
        made a 12 MB step that took 27 s to compile and 6 s to load from disk (a loop: 19 s and
        2 s, the step as fast; BENCHMARKS.md)."""
        lg, dc = self._refeed(dparams, dcache, prev, pending, target_lengths)
        d, q, _ = self._pick(dparams, lg, 0, target_lengths, samp, greedy_only)
        B = d.shape[0]
        toks = jnp.zeros((B, K), jnp.int32).at[:, 0].set(d)
        qs = None if greedy_only else jnp.zeros((B, K) + q.shape[1:], q.dtype).at[:, 0].set(q)

        def body(j, carry):
            d, dc, toks, qs = carry
            lg, dc = self._next(dparams, dc, d)
            d, q, _ = self._pick(dparams, lg, j, target_lengths, samp, greedy_only)
            toks = jax.lax.dynamic_update_slice_in_dim(toks, d[:, None], j, axis=1)
            if qs is not None:
                qs = jax.lax.dynamic_update_slice_in_dim(qs, q[:, None], j, axis=1)
            return d, dc, toks, qs

        _, dc, toks, qs = jax.lax.fori_loop(1, K, body, (d, dc, toks, qs))
        return toks, qs, dc

    def propose(self, dparams, dcache: kv.KVCache, prev, pending, target_lengths, P: int, samp: SamplingArrays,
                greedy_only: bool, active, threshold):
        """Confidence-based proposal (SmartSpec Algorithm 3): every ``active`` row drafts its
        first token; a row drafts token j + 1 only while draft j's confidence exceeds
        ``threshold``, and the loop ends (no more draft forwards) once no row goes on or P
        drafts are made. Same tokens and draft distributions as ``draft`` for the positions a
        row proposes. Returns (drafts [B, P], q [B, P, V] or None, confidences [B, P] (0 past a
        row's proposal), proposed [B], dcache)."""
        B = pending.shape[0]
        lg, dc = self._refeed(dparams, dcache, prev, pending, target_lengths)
        d, q, c = self._pick(dparams, lg, 0, target_lengths, samp, greedy_only)
        toks = jnp.zeros((B, P), jnp.int32).at[:, 0].set(d)
        conf = jnp.zeros((B, P), jnp.float32).at[:, 0].set(jnp.where(active, c, 0.0))
        qs = None if greedy_only else jnp.zeros((B, P) + q.shape[1:], q.dtype).at[:, 0].set(q)
        n = active.astype(jnp.int32)
        going = active & (c > threshold) & (P > 1)

        def cond(carry):
            j, _, _, _, _, _, _, going = carry
            return (j < P) & jnp.any(going)

        def body(carry):
            j, d, dc, toks, qs, conf, n, going = carry
            lg, dc = self._next(dparams, dc, d)
            d, q, c = self._pick(dparams, lg, j, target_lengths, samp, greedy_only)
            toks = jax.lax.dynamic_update_slice_in_dim(toks, jnp.where(going, d, 0)[:, None], j, axis=1)
            conf = jax.lax.dynamic_update_slice_in_dim(conf, jnp.where(going, c, 0.0)[:, None], j, axis=1)
            if qs is not None:
                qs = jax.lax.dynamic_update_slice_in_dim(qs, jnp.where(going[:, None], q, 0.0)[:, None], j, axis=1)
            n = n + going.astype(jnp.int32)
            going = going & (c > threshold) & (j + 1 < P)
            return j + 1, d, dc, toks, qs, conf, n, going

        _, _, dc, toks, qs, conf, n, _ = jax.lax.while_loop(
            cond, body, (jnp.int32(1), d, dc, toks, qs, conf, n, going))
        return toks, qs, conf, n, dc


@dataclasses.dataclass(frozen=True)
class FeatureHeadDraft(ModelDraft):
    """What every feature head (drafters.eagle, drafters.medusa) does in the compiled steps: it
    reads the target's features (``features``), keeps a plain step's token and features for a
    later catch-up (``defer``), catches up on what plain steps deferred before it drafts
    (``settle``), and after a verify step rewrites the block's entries with the target's real
    features (``catch_up``); the kind supplies those three."""

    plain_upkeep = True
    prefill_as_layers = False

    def chain_drafts(self, dparams, dcache, state, host_tokens, num_draft, active, K, samp, greedy_only):
        dcache = self.settle(dparams, dcache)
        toks, q, dc = self.draft(dparams, dcache, state.prev, state.pending, state.cache.lengths, K, samp, greedy_only)
        return toks, q, dc, dcache.feat  # (the carried feature the block's first entry pairs with)

    def after_chain(self, dparams, dcache, carry, block, feats, lengths, n_commit, active, K):
        if K == 0:  # a plain step's token, kept for a later catch-up
            return self.defer(dparams, dcache, block[:, 0], feats[:, 0], active)
        return self.catch_up(dparams, dcache, carry, block, feats, lengths, n_commit)

    def tree_drafts(self, dparams, dcache, pending, lengths, n):
        dcache = self.settle(dparams, dcache)
        tokens, parents = self.draft_tree(dparams, dcache, pending, lengths, n)
        return tokens, parents, dcache

    def after_tree(self, dparams, dcache, tokens, path, feats, lengths, n_commit):
        # (along the accepted path, as after a chain)
        on_path = jnp.take_along_axis(feats, path[..., None], axis=1)
        return self.catch_up(dparams, dcache, dcache.feat, jnp.take_along_axis(tokens, path, axis=1), on_path,
                             lengths, n_commit)


def layer_skip(cfg: ModelConfig, params, num_layers: int,
               fwd: ForwardOptions = ForwardOptions()) -> tuple[ModelDraft, dict]:
    """Self-drafting with the target's first ``num_layers`` layers: the draft and its own params
    tree (the target's arrays, shared, not copied). ``fwd`` with the rows kernel: the draft runs
    on it, reading the first layers of the target's packed stacks in place (``params`` from
    llama.pack_for_rows), as the target's own decode step does."""
    require(1 <= num_layers <= cfg.num_layers,
            f"a layer-skip draft needs 1..{cfg.num_layers} layers of {cfg.name}, got {num_layers}")
    require(not fwd.rows_kernel or llama.LAYER_PACKS in params, "a layer-skip draft on the rows kernel needs the "
            "target's packed params (llama.pack_for_rows)")
    dcfg = cfg.replace(name=f"{cfg.name}[:{num_layers}]", num_layers=num_layers)
    dparams = {k: v for k, v in params.items()
               if k != "layers" and (fwd.rows_kernel or not k.endswith(llama.ROWS_SUFFIX))}
    dparams["layers"] = params["layers"][:num_layers]
    return ModelDraft(dcfg, label=f"layer_skip{num_layers}", fwd=fwd), dparams


def frequent_tokens(sequences, vocab_size: int, n: int, keep=()) -> np.ndarray:
    """The ``n`` token ids seen most often in ``sequences`` (iterables of target token ids; ties
    to the lower id), always including ``keep`` (say the end-of-sequence ids), ascending."""
    require(1 <= n <= vocab_size, f"a reduced vocabulary needs 1..{vocab_size} tokens, got {n}")
    counts = np.zeros(vocab_size, np.int64)
    for seq in sequences:
        ids = np.asarray(seq, np.int64).ravel()
        require(ids.size == 0 or (ids.min() >= 0 and ids.max() < vocab_size),
                f"token ids must be in [0, {vocab_size}) to count them")
        np.add.at(counts, ids, 1)
    keep = sorted({int(t) for t in keep})
    require(len(keep) <= n, f"{len(keep)} tokens to keep do not fit a vocabulary of {n}")
    counts[keep] = np.iinfo(np.int64).max  # first in the order
    order = np.lexsort((np.arange(vocab_size), -counts))  # most frequent, then lowest id
    return np.sort(order[:n]).astype(np.int32)


def reduced_vocab(draft: ModelDraft, dparams, vocab_ids) -> tuple[ModelDraft, dict]:
    """``draft`` with its vocab head cut to the target tokens ``vocab_ids`` (distinct ids in
    [0, V)): the head's columns for those ids, copied (the target's head is never written).
    Raises SpecjaxError for ids that do not map onto the target's vocabulary."""
    require(isinstance(draft, ModelDraft) and not draft.vocab, "reduced_vocab takes a full-vocabulary ModelDraft")
    V = draft.cfg.vocab_size
    ids = np.asarray(vocab_ids)
    require(ids.ndim == 1 and ids.size >= 1 and np.issubdtype(ids.dtype, np.integer),
            f"a reduced vocabulary is a 1-D list of token ids, got shape {ids.shape} of {ids.dtype}")
    require(ids.min() >= 0 and ids.max() < V,
            f"reduced vocabulary ids must map onto the target's {V} tokens; got ids {ids.min()}..{ids.max()}")
    require(len(np.unique(ids)) == ids.size, "reduced vocabulary ids must be distinct")
    head = dparams["embed"].T if draft.cfg.tie_embeddings else dparams["lm_head"]
    out = dict(dparams, lm_head=jnp.take(head, jnp.asarray(ids, jnp.int32), axis=1),
               vocab_ids=jnp.asarray(ids, jnp.int32))
    if "head" + llama.ROWS_SUFFIX in out:  # (the rows kernel's head: the reduced one, packed)
        from specjax.models.cpu import rows_dot

        out["head" + llama.ROWS_SUFFIX] = rows_dot.pack(out["lm_head"])
    cfg = draft.cfg.replace(name=f"{draft.cfg.name}|v{ids.size}", tie_embeddings=False)
    return ModelDraft(cfg, label=f"{draft.label}_v{ids.size}", vocab=int(ids.size), fwd=draft.fwd), out


def check_pair(target: ModelConfig, draft: ModelDraft | None, draft_params) -> None:
    """Raise SpecjaxError unless ``draft`` (None = no device drafter) can draft for ``target``."""
    if draft is None:
        return
    require(isinstance(draft, ModelDraft), f"a device drafter must be a ModelDraft, got {type(draft).__name__}")
    require(draft_params is not None, f"device drafter {draft.label} needs its params (draft_params)")
    require(draft.cfg.vocab_size == target.vocab_size,
            f"draft model vocabulary ({draft.cfg.vocab_size}) differs from the target's ({target.vocab_size}); "
            "draft and target must share a tokenizer")
    if draft.vocab:
        ids, head = draft_params.get("vocab_ids"), draft_params.get("lm_head")
        require(ids is not None and tuple(ids.shape) == (draft.vocab,) and head is not None
                and tuple(head.shape) == (draft.cfg.hidden_size, draft.vocab),
                f"draft {draft.label} has a {draft.vocab}-token head: its params need vocab_ids [{draft.vocab}] and "
                f"lm_head [{draft.cfg.hidden_size}, {draft.vocab}] (reduced_vocab makes them)")


class DeviceDrafter(Drafter):
    """A device draft (``ModelDraft`` and its params) in the engine: it drafts K inside the chain
    step, and its prefill fills the draft cache (a request admitted without it never drafts:
    num_draft 0). Under a confidence policy (SmartSpec Algorithm 3, ``propose(threshold=...)``)
    it drafts first instead, in a call of its own: up to the largest K per row, a row going on
    while its last draft's confidence exceeds the threshold, the loop ending when no row goes
    on. The policy then sees every row's confidences and proposal length, and the verify step
    checks K of those drafts straight from the device (warm-ups compile that path when asked:
    the backend's ``draft_first``)."""

    draft_prefill = True
    fuses = True  # (its chain steps draft inside; a draft-ahead step verifies a draft call's and runs alone)

    def __init__(self, draft: ModelDraft, params):
        self.draft, self.params = draft, params  # (checked against the target: check_pair)
        self._ahead = None  # the last draft call's (tokens, q, width, proposed per row, seconds)

    @property
    def max_k(self) -> int | None:
        return self.draft.max_drafts(self.step is TREE)

    def reset(self):
        self._ahead = None

    def propose(self, be, rs, k_max, threshold=None):
        if threshold is not None and k_max > 0:
            return self._draft_ahead(be, rs, k_max, float(threshold))
        # A request admitted with the draft disabled never drafts: the policy must know.
        return Proposal(draft_lens=[k_max if r.speculate else 0 for r in rs])

    def _draft_ahead(self, be, rs, P: int, threshold: float) -> Proposal:
        t0 = time.perf_counter()
        be.prepare(rs)
        drafting = np.zeros(be.B, bool)
        for r in rs:
            drafting[be.row_of[r.uid]] = r.speculate
        o = be.run(be.table.draft_call(be.B, P, be.slots, be.greedy()), be.to_device(drafting), be.sampling(),
                   np.float32(threshold))
        host = np.asarray(o.host)  # tokens | confidences | proposed, in one transfer
        toks, conf, n = host[:, :P].astype(np.int32), host[:, P:2 * P], host[:, 2 * P].astype(np.int32)
        rows = [be.row_of[r.uid] for r in rs]
        self._ahead = (o.tokens, o.q, P, n, time.perf_counter() - t0)
        return Proposal(draft_lens=[int(n[j]) for j in rows], confidences=conf[rows],
                        drafts=[toks[j, :n[j]] for j in rows], drafted_ahead=int(n.max(initial=0)))

    def step_inputs(self, be, rs, k, cap):
        num_draft = np.zeros(be.B, np.int32)
        ahead, self._ahead = self._ahead, None
        if ahead is not None:  # the drafts were made by a draft call (confidence policy)
            tokens, q, width, n, seconds = ahead
            for r in rs:
                row = be.row_of[r.uid]
                num_draft[row] = min(cap[r.uid], int(n[row]))
        else:
            for r in rs:
                num_draft[be.row_of[r.uid]] = cap[r.uid] if r.speculate else 0
        k_step = bk.proposal_bucket(be.k_options(be.B), int(num_draft.max(initial=0)))
        if ahead is not None:
            return StepInputs(VerifyStep(width), k_step, num_draft, (tokens, q), seconds)
        return StepInputs(self.step, k_step, num_draft, (np.zeros((be.B, max(k_step, 1)), np.int32),))

    def warm_steps(self, B, ks, greedy, tokens, ahead):
        jobs = super().warm_steps(B, ks, greedy, tokens, ahead)
        if ahead > 0:
            jobs.append(DraftAheadJob(B, ahead, greedy, tuple((K, t) for K in ks for t in (0,) + tuple(tokens(K)))))
        return jobs


class FeatureHeadDrafter(DeviceDrafter):
    """A feature head (drafters.eagle, drafters.medusa) in the engine: DeviceDrafter's chain path
    (K drafts inside the step, the draft prefill with its gate), with the target's features
    flowing through the compile key. Drafting ahead of the policy's choice (confidence policies)
    is not built for it: the verify step it needs would have to catch the head up too."""

    # No default prefill gate: a head's prefill is one layer over the prompt beside the target's
    # (and its plain steps defer their upkeep), while the gate, closed by the K = 0 choices of an
    # answer's opening (whose drafts are accepted least: EAGLE 0.17 over the first 3 steps of chat
    # answers, 0.36-0.40 later), kept the head out of the requests after the first.
    gates_prefill = False

    def propose(self, be, rs, k_max, threshold=None):
        require(threshold is None, f"the {self.draft.label} drafter drafts inside the step; confidence-based "
                "proposal (smartspec-conf) is not available for it")
        return super().propose(be, rs, k_max)

    def warm_steps(self, B, ks, greedy, tokens, ahead):
        require(ahead == 0, f"the {self.draft.label} drafter has no draft-ahead path (smartspec-conf / draft_first)")
        return super().warm_steps(B, ks, greedy, tokens, ahead)


class DeviceTreeDrafter(FeatureHeadDrafter):
    """A head drafting token trees inside the tree step (``ModelDraft.drafts_trees``: Medusa's
    static tree, EAGLE-2's dynamic one): K is the node budget, a row verifies the first K nodes
    (``cap`` of them when the policy cuts it; the nodes come parents first, so any prefix is a
    tree). The tree's tokens and parents are the device's; the host passes only which nodes
    each row verifies."""

    step = TREE
    fuses = False

    def __init__(self, draft: ModelDraft, params):
        super().__init__(draft, params)
        self.rates = TreeNodeRates()  # (kept across runs, as a policy's estimates are: per node, not per request)
        # each verified row's (nodes verified, accepted nodes): the simulator's tree acceptance (tree_paths_of)
        self.paths: collections.deque = collections.deque(maxlen=100_000)

    def propose(self, be, rs, k_max, threshold=None):
        """Each speculating row's node scores: the learnt acceptance of nodes 1..k_max, so that
        a goodput policy weighs node budgets (the tree itself is drafted inside the step)."""
        prop = super().propose(be, rs, k_max, threshold)
        sc = self.rates.scores(k_max)
        prop.draft_scores = [sc if n else None for n in prop.draft_lens]
        return prop

    def tree_verified(self, rows):
        for drafted, path in rows:
            self.rates.observe(drafted, path)
            self.paths.append((int(drafted), tuple(int(p) for p in path)))

    def step_inputs(self, be, rs, k, cap):
        num = np.zeros(be.B, np.int32)
        for r in rs:
            num[be.row_of[r.uid]] = cap[r.uid] if r.speculate else 0
        k_step = bk.proposal_bucket(be.k_options(be.B), int(num.max(initial=0)))
        inputs, _ = TREE.empty(be.B, k_step)  # (tokens and parents: placeholders the step replaces)
        valid = (np.arange(k_step + 1)[None, :] <= num[:, None]) & (np.arange(k_step + 1) > 0)[None, :]
        return StepInputs(TREE, k_step, num, (inputs[0], inputs[1], valid))


@dataclasses.dataclass(frozen=True)
class DraftAheadJob:
    """Warm-up of the draft-ahead path at batch B: the draft call of up to P drafts and the
    verify steps (K, packed size) that check its drafts."""

    B: int
    P: int
    greedy: bool
    verifies: tuple

    @property
    def heavy(self) -> int:
        return 1 + len(self.verifies)

    def compile(self, be, compile_if_missing: bool = False):
        for k, t in self.verifies:
            VerifyStep(self.P).exe(be.table, self.B, k, be.slots, self.greedy, t, compile_if_missing)
        return be.table.draft_call(self.B, self.P, be.slots, self.greedy, compile_if_missing)

    def run(self, be, state, samp):
        act = jax.device_put(np.ones(self.B, bool))
        state, d = self.compile(be)(be.params, be.dparams, state, act, samp, np.float32(0.0))
        for k, t in self.verifies:
            pack = jax.device_put(np.arange(t, dtype=np.int32)) if t else None
            exe = VerifyStep(self.P).exe(be.table, self.B, k, be.slots, self.greedy, t)
            state, _ = exe(be.params, be.dparams, state, d.tokens, jax.device_put(np.zeros(self.B, np.int32)), act,
                           samp, d.q, pack)
        jax.block_until_ready(state)
        return state
