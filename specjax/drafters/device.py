"""Device drafters: proposers that run inside the jitted speculative step.

A device drafter is a frozen, hashable description (a static argument of the step, so part of
its compile key) with two pure functions the step calls with the draft's *own* params:

  prefill(dparams, tokens, positions, mask, last, n_valid, slots) -> draft cache
      (holding the first n_valid - 1 prompt tokens: the step re-feeds [prev, pending] first)
  draft(dparams, dcache, prev, pending, target_lengths, K, samp, greedy_only)
      -> (drafts [B, K], draft probabilities [B, K, V] or None when greedy_only, dcache)

``ModelDraft`` runs a Llama-family model: an independent draft model sharing the target's
tokenizer, or layer skip (``layer_skip``: the target's first n layers). A layer-skip draft's
params are a params tree of its own whose arrays are, until the draft is trained, the target's
(no copy); training replaces them and can never touch the target's. Host drafters (prompt
lookup, suffix trees) are a different protocol (``drafters.base.HostDrafter``): they propose on
the host and pass tokens in.

Draft-cache invariant: at the start of a step the draft cache holds at least the first
``L_t - 1`` committed tokens (L_t = the target's length), so the draft first re-feeds
``[prev, pending]`` at positions ``L_t - 1, L_t``; this also fills the one entry a fully
accepted step left out.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from specjax import cache as kv
from specjax.config import ModelConfig
from specjax.errors import require
from specjax.models import llama
from specjax.sampling import SamplingArrays, probs_from_logits
from specjax.verify import SALT_DRAFT, _sample_rows, stream_keys


@dataclasses.dataclass(frozen=True)
class ModelDraft:
    """A Llama-family draft model run inside the step. ``cfg`` is the draft's own config (for layer
    skip: the target's with ``num_layers`` = n); ``label`` names it in perf-model keys and logs."""

    cfg: ModelConfig
    label: str = "draft_model"

    def prefill(self, dparams, tokens, positions, mask, last, n_valid, slots: int) -> kv.KVCache:
        B = tokens.shape[0]
        dcache = llama.init_cache_for(self.cfg, B, slots, dparams["embed"].dtype)
        _, dcache = llama.forward(dparams, tokens, positions, dcache, mask, cfg=self.cfg, use_prefix=False,
                                  logits_at=last)
        return kv.set_lengths(dcache, n_valid - 1)

    def draft(self, dparams, dcache: kv.KVCache, prev, pending, target_lengths, K: int, samp: SamplingArrays,
              greedy_only: bool):
        """K autoregressive draft tokens per row (greedy, or sampled from the warped draft
        distribution with the (seed, position) draft stream)."""
        B = pending.shape[0]
        dc = kv.set_lengths(dcache, target_lengths - 1)
        blk = jnp.stack([prev, pending], axis=1)
        pos = dc.lengths[:, None] + jnp.arange(2, dtype=jnp.int32)[None, :]
        logits, dc = llama.forward(dparams, blk, pos, dc, llama.causal_mask(B, 2), cfg=self.cfg,
                                   logits_at=jnp.ones((B, 1), jnp.int32))
        dc = kv.advance(dc, jnp.full((B,), 2, jnp.int32))
        toks, qs = [], []
        for j in range(K):
            lg = logits[:, 0]
            if greedy_only:
                d = jnp.argmax(lg, axis=-1).astype(jnp.int32)
            else:
                q = probs_from_logits(lg, samp)
                keys = stream_keys(samp.seed, (target_lengths + 1 + j)[:, None], SALT_DRAFT)[:, 0]
                d = _sample_rows(keys, q)
                qs.append(q)
            toks.append(d)
            if j < K - 1:
                logits, dc = llama.forward(dparams, d[:, None], dc.lengths[:, None], dc, llama.causal_mask(B, 1),
                                           cfg=self.cfg)
                dc = kv.advance(dc, jnp.ones((B,), jnp.int32))
        return jnp.stack(toks, axis=1), (None if greedy_only else jnp.stack(qs, axis=1)), dc


def layer_skip(cfg: ModelConfig, params, num_layers: int) -> tuple[ModelDraft, dict]:
    """Self-drafting with the target's first ``num_layers`` layers: the draft and its own params
    tree (the target's arrays, shared, not copied)."""
    require(1 <= num_layers <= cfg.num_layers,
            f"a layer-skip draft needs 1..{cfg.num_layers} layers of {cfg.name}, got {num_layers}")
    dcfg = cfg.replace(name=f"{cfg.name}[:{num_layers}]", num_layers=num_layers)
    dparams = {k: v for k, v in params.items() if k != "layers"}
    dparams["layers"] = list(params["layers"][:num_layers])
    return ModelDraft(dcfg, label=f"layer_skip{num_layers}"), dparams


def check_pair(target: ModelConfig, draft: ModelDraft | None, draft_params) -> None:
    """Raise SpecjaxError unless ``draft`` (None = no device drafter) can draft for ``target``."""
    if draft is None:
        return
    require(isinstance(draft, ModelDraft), f"a device drafter must be a ModelDraft, got {type(draft).__name__}")
    require(draft_params is not None, f"device drafter {draft.label} needs its params (draft_params)")
    require(draft.cfg.vocab_size == target.vocab_size,
            f"draft model vocabulary ({draft.cfg.vocab_size}) differs from the target's ({target.vocab_size}); "
            "draft and target must share a tokenizer")
