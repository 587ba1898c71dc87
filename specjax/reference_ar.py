"""The plain autoregressive loop: the reference every engine path is checked against.

One jitted prefill and one jitted single-token decode step per batch, a host loop, nothing
shared with the serving engine but the model, the cache and the sampler. Tests use it as the
oracle for "the same tokens as the target alone" (an engine checked against itself would prove
nothing) and ``benchmarks/engine_ar.py`` times the engine's K = 0 step against it. Users call
``specjax.generate.Generator``, which runs the engine.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import buckets as bk
from specjax import cache as kv
from specjax.config import ModelConfig
from specjax.results import GenerationResult, validate_request
from specjax.models import llama
from specjax.models.options import ForwardOptions
from specjax.sampling import SamplingArrays, SamplingParams, sample


def _prefill_logits(params, tokens, n_valid, *, cfg: ModelConfig, slots: int, fwd: ForwardOptions):
    """Run the prompts ([B, Tp], row b valid up to n_valid[b]) into a fresh cache: (the logits at
    each row's last prompt token [B, V], cache)."""
    B, T = tokens.shape
    cache = llama.init_cache_for(cfg, B, slots, params["embed"].dtype)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    last = jnp.maximum(n_valid - 1, 0)[:, None]
    logits, cache = llama.forward(params, tokens, pos, cache, llama.causal_mask(B, T), cfg=cfg,
                                  use_prefix=False, logits_at=last, fwd=fwd.for_prefill())
    return logits[:, 0], kv.set_lengths(cache, n_valid)


def _decode_logits(params, cache: kv.KVCache, tokens, active, *, cfg: ModelConfig, fwd: ForwardOptions):
    """Feed one token per row ([B]): (its logits [B, V], cache); rows with active=False do not advance."""
    B = tokens.shape[0]
    logits, cache = llama.forward(params, tokens[:, None], cache.lengths[:, None], cache, llama.causal_mask(B, 1),
                                  cfg=cfg, fwd=fwd)
    return logits[:, 0], kv.advance(cache, active.astype(jnp.int32))


# The loop's two steps, as logits (for callers that choose tokens themselves: distill.data) ...
prefill_logits = jax.jit(_prefill_logits, static_argnames=("cfg", "slots", "fwd"))
decode_logits = jax.jit(_decode_logits, static_argnames=("cfg", "fwd"), donate_argnames=("cache",))


# ... and sampled.
@partial(jax.jit, static_argnames=("cfg", "slots", "greedy_only", "fwd"))
def prefill(params, tokens, n_valid, samp: SamplingArrays, *, cfg: ModelConfig, slots: int, greedy_only: bool,
            fwd: ForwardOptions = ForwardOptions()):
    """Run the prompts ([B, Tp], row b valid up to n_valid[b]) into a fresh cache and
    sample each row's first new token."""
    logits, cache = _prefill_logits(params, tokens, n_valid, cfg=cfg, slots=slots, fwd=fwd)
    return cache, sample(logits, samp, n_valid, greedy_only)


@partial(jax.jit, static_argnames=("cfg", "greedy_only", "fwd"), donate_argnames=("cache",))
def decode_step(params, cache: kv.KVCache, tokens, active, samp: SamplingArrays, *, cfg: ModelConfig,
                greedy_only: bool, fwd: ForwardOptions = ForwardOptions()):
    """Feed one token per row; rows with active=False do not advance."""
    logits, cache = _decode_logits(params, cache, tokens, active, cfg=cfg, fwd=fwd)
    return cache, sample(logits, samp, cache.lengths, greedy_only)


def reference_generate(cfg: ModelConfig, params, prompts: Sequence[Sequence[int]],
                       sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                       max_new_tokens: int = 128, ignore_eos: bool = False, eos_ids: Sequence[int] = (),
                       batch_buckets: Sequence[int] = bk.DEFAULT_BATCH_BUCKETS,
                       fwd: ForwardOptions = ForwardOptions()) -> list[GenerationResult]:
    """Generate for every prompt, in static batches of at most the largest batch bucket. Each
    row generates up to ``max_new_tokens`` and never past the context."""
    if isinstance(sampling, SamplingParams):
        sampling = [sampling] * len(prompts)
    for p in prompts:
        validate_request(p, max_new_tokens, cfg)
    buckets = tuple(sorted(batch_buckets))
    out: list[GenerationResult] = []
    for i in range(0, len(prompts), buckets[-1]):
        out.extend(_batch(cfg, params, prompts[i:i + buckets[-1]], sampling[i:i + buckets[-1]], max_new_tokens,
                          ignore_eos, set(int(e) for e in eos_ids), buckets, fwd))
    return out


def _batch(cfg, params, prompts, sampling, max_new_tokens, ignore_eos, eos, buckets, fwd):
    n = len(prompts)
    B = bk.pick(buckets, n, "batch size")
    lens = np.array([len(p) for p in prompts] + [1] * (B - n), np.int32)
    Tp = bk.prompt_bucket(int(lens.max()), cfg.max_position)
    budget = np.minimum(max_new_tokens, cfg.max_position - lens)
    slots = bk.slot_bucket(int((lens + budget).max()), cfg.max_position)
    toks = np.zeros((B, Tp), np.int32)
    for b, p in enumerate(prompts):
        toks[b, : len(p)] = p
    samp = SamplingArrays.build(sampling, B)
    greedy_only = all(s.greedy for s in sampling)
    t0 = time.perf_counter()
    cache, tok = prefill(params, jnp.asarray(toks), jnp.asarray(lens), samp, cfg=cfg, slots=slots,
                         greedy_only=greedy_only, fwd=fwd)
    tok = np.asarray(tok)
    t1 = time.perf_counter()
    generated = [[] for _ in range(B)]
    done = np.zeros(B, bool)
    done[n:] = True
    reason = ["length"] * B
    while True:
        for b in range(n):
            if done[b]:
                continue
            generated[b].append(int(tok[b]))
            if not ignore_eos and int(tok[b]) in eos:
                done[b], reason[b] = True, "eos"
            elif len(generated[b]) >= budget[b]:
                done[b] = True
        if done.all():
            break
        cache, tok = decode_step(params, cache, jnp.asarray(tok), jnp.asarray(~done), samp, cfg=cfg,
                                 greedy_only=greedy_only, fwd=fwd)
        tok = np.asarray(tok)
    t2 = time.perf_counter()
    return [GenerationResult(generated[b], reason[b], int(lens[b]), t1 - t0, t2 - t1) for b in range(n)]
