"""Autoregressive generation: the baseline every speculative speedup is measured against.

Jitted prefill and decode over static buckets (batch size, prompt length, cache
slots). Rows of a batch may have different prompt lengths: each row's cache has
its own length and its tokens are at their own positions, so no left padding or
position shifting is needed.
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import buckets as bk
from specjax import cache as kv
from specjax.config import ModelConfig
from specjax.errors import SpecjaxError, require
from specjax.models import llama
from specjax.sampling import SamplingArrays, SamplingParams, sample


@dataclasses.dataclass
class GenerationResult:
    tokens: list[int]
    finish_reason: str  # "eos" | "length"
    prompt_len: int
    prefill_s: float = 0.0
    decode_s: float = 0.0


@partial(jax.jit, static_argnames=("cfg", "slots", "greedy_only", "attention_impl"))
def prefill(params, tokens, n_valid, samp: SamplingArrays, *, cfg: ModelConfig, slots: int, greedy_only: bool,
            attention_impl: str = "xla"):
    """Run the prompts ([B, Tp], row b valid up to n_valid[b]) into a fresh cache and
    sample each row's first new token."""
    B, T = tokens.shape
    cache = llama.init_cache_for(cfg, B, slots, params["embed"].dtype)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    last = jnp.maximum(n_valid - 1, 0)[:, None]
    logits, cache = llama.forward(params, tokens, pos, cache, llama.causal_mask(B, T), cfg=cfg,
                                  use_prefix=False, logits_at=last, attention_impl=attention_impl)
    cache = kv.set_lengths(cache, n_valid)
    tok = sample(logits[:, 0], samp, n_valid, greedy_only)
    return cache, tok


@partial(jax.jit, static_argnames=("cfg", "greedy_only", "attention_impl"), donate_argnames=("cache",))
def decode_step(params, cache: kv.KVCache, tokens, active, samp: SamplingArrays, *, cfg: ModelConfig,
                greedy_only: bool, attention_impl: str = "xla"):
    """Feed one token per row; rows with active=False do not advance."""
    B = tokens.shape[0]
    pos = cache.lengths[:, None]
    logits, cache = llama.forward(params, tokens[:, None], pos, cache, llama.causal_mask(B, 1), cfg=cfg,
                                  attention_impl=attention_impl)
    cache = kv.advance(cache, active.astype(jnp.int32))
    tok = sample(logits[:, 0], samp, cache.lengths, greedy_only)
    return cache, tok


def validate_request(prompt: Sequence[int], max_new_tokens: int, cfg: ModelConfig) -> None:
    require(len(prompt) > 0, "empty prompt: give at least one token of input")
    require(max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {max_new_tokens}")
    require(len(prompt) < cfg.max_position,
            f"prompt has {len(prompt)} tokens but {cfg.name}'s context is {cfg.max_position}")
    bad = [t for t in prompt if not 0 <= int(t) < cfg.vocab_size]
    require(not bad, f"prompt token ids out of range [0, {cfg.vocab_size}): {bad[:5]}")


class Generator:
    """Batched autoregressive generation over static buckets."""

    def __init__(self, cfg: ModelConfig, params, *, eos_ids: Sequence[int] = (),
                 batch_buckets: Sequence[int] = bk.DEFAULT_BATCH_BUCKETS, attention_impl: str = "xla"):
        self.cfg = cfg
        self.params = params
        self.eos_ids = tuple(int(e) for e in eos_ids)
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.attention_impl = attention_impl

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                 max_new_tokens: int = 128, ignore_eos: bool = False) -> list[GenerationResult]:
        if isinstance(sampling, SamplingParams):
            sampling = [sampling] * len(prompts)
        require(len(sampling) == len(prompts), "one SamplingParams per prompt")
        for p in prompts:
            validate_request(p, max_new_tokens, self.cfg)
        out: list[GenerationResult] = []
        max_b = self.batch_buckets[-1]
        for i in range(0, len(prompts), max_b):
            out.extend(self._generate_batch(prompts[i:i + max_b], sampling[i:i + max_b], max_new_tokens, ignore_eos))
        return out

    def _generate_batch(self, prompts, sampling, max_new_tokens, ignore_eos):
        cfg = self.cfg
        n = len(prompts)
        B = bk.pick(self.batch_buckets, n, "batch size")
        lens = np.array([len(p) for p in prompts] + [1] * (B - n), np.int32)
        Tp = bk.prompt_bucket(int(lens.max()), cfg.max_position)
        # Each row may generate up to max_new_tokens but never past the context.
        budget = np.minimum(max_new_tokens, cfg.max_position - lens)
        slots = bk.slot_bucket(int((lens + budget).max()), cfg.max_position)
        toks = np.zeros((B, Tp), np.int32)
        for b, p in enumerate(prompts):
            toks[b, : len(p)] = p
        samp = SamplingArrays.build(sampling, B)
        greedy_only = all(s.greedy for s in sampling)
        t0 = time.perf_counter()
        cache, tok = prefill(self.params, jnp.asarray(toks), jnp.asarray(lens), samp, cfg=cfg, slots=slots,
                             greedy_only=greedy_only, attention_impl=self.attention_impl)
        tok = np.asarray(tok)
        t1 = time.perf_counter()
        generated = [[] for _ in range(B)]
        done = np.zeros(B, bool)
        done[n:] = True
        reason = ["length"] * B
        eos = set(self.eos_ids)
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
            cache, tok = decode_step(self.params, cache, jnp.asarray(tok), jnp.asarray(~done), samp, cfg=cfg,
                                     greedy_only=greedy_only, attention_impl=self.attention_impl)
            tok = np.asarray(tok)
        t2 = time.perf_counter()
        return [GenerationResult(generated[b], reason[b], int(lens[b]), t1 - t0, t2 - t1) for b in range(n)]
