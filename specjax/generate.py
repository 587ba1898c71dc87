"""Autoregressive generation, the baseline every speculative speedup is measured against:
the engine's K = 0 step (``Generator``), plus the request type and checks every path shares.

Rows of a batch may have different prompt lengths: each row's cache has its own length and
its tokens are at their own positions, so no left padding or position shifting is needed.
The independent plain loop that tests check the engine against is ``specjax.reference_ar``.
"""

from __future__ import annotations

from typing import Sequence

from specjax import buckets as bk
from specjax.config import ModelConfig
from specjax.models.options import ForwardOptions
from specjax.results import GenerationResult, validate_request  # noqa: F401  (re-exported)
from specjax.sampling import SamplingParams
from specjax.spec_generate import SpecGenerator


class Generator(SpecGenerator):
    """Batched autoregressive generation: a ``SpecGenerator`` with no drafter and only the K = 0
    step, i.e. the engine's plain decoding with every prompt submitted at t = 0. The baseline
    every speculative speedup is measured against is therefore the code path the speculative
    engine runs whenever it does not speculate."""

    def __init__(self, cfg: ModelConfig, params, *, eos_ids: Sequence[int] = (),
                 batch_buckets: Sequence[int] = bk.DEFAULT_BATCH_BUCKETS, fwd: ForwardOptions = ForwardOptions(),
                 prefill_chunk: int = bk.DEFAULT_PREFILL_CHUNK, prefix_cache_mb: float = bk.DEFAULT_PREFIX_CACHE_MB,
                 prefix_cache_outputs: bool = False):
        super().__init__(cfg, params, eos_ids=eos_ids, k_buckets=(0,), batch_buckets=batch_buckets,
                         slot_buckets=bk.context_slot_buckets(cfg.max_position), fwd=fwd, prefill_chunk=prefill_chunk,
                         prefix_cache_mb=prefix_cache_mb, prefix_cache_outputs=prefix_cache_outputs)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                 max_new_tokens: int = 128, ignore_eos: bool = False, num_spec_tokens: int = 0,
                 stats=None) -> list[GenerationResult]:
        """Each row generates up to ``max_new_tokens`` and never past the context: the slot
        bucket is the smallest that holds the longest prompt and its budget, and rows that would
        run past the largest (the context) get what is left of it."""
        return super().generate(prompts, sampling, max_new_tokens, num_spec_tokens=num_spec_tokens,
                                ignore_eos=ignore_eos, stats=stats)
