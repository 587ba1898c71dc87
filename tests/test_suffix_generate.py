"""SuffixDecoding end to end on the tiny random model: suffix (tree and path mode) and hybrid
drafters give exactly the AR greedy tokens at batch 1 and 3; a second pass over the same
prompts drafts from the global tree (outputs of the first pass) and accepts long runs; no
compilation after warm-up; sampled decoding through suffix trees runs and stays in range."""

from __future__ import annotations

import logging

import jax
import pytest

from specjax.drafters.prompt_lookup import PromptLookupDrafter
from specjax.drafters.suffix import HybridDrafter, SuffixConfig, SuffixDrafter
from specjax.reference_ar import reference_generate
from specjax.sampling import SamplingParams
from specjax.spec_generate import SpecGenerator, SpecStats

PROMPTS = [[30, 31, 32] * 4, [42, 7, 99], [11, 12] * 6]
MAX_NEW = 24
KW = dict(batch_buckets=(1, 4), k_buckets=(0, 2, 4, 8), slot_buckets=(256,))


@pytest.fixture(scope="module")
def ar(tiny):
    cfg, params = tiny
    return [r.tokens for r in reference_generate(cfg, params, PROMPTS, max_new_tokens=MAX_NEW, batch_buckets=(1, 4))]


def _drafter(kind):
    cfg = SuffixConfig(max_depth=32, alpha=2.0, min_prob=0.05, tree=(kind != "path"))
    if kind == "hybrid":
        return HybridDrafter(SuffixDrafter(cfg), PromptLookupDrafter(), tau=0.5)
    return SuffixDrafter(cfg)


# Path mode is the same drafter and verifier with tree=False; it runs in the slow suite (and the
# serving engine drafts suffix paths through the same chain step the other chain tests cover).
@pytest.mark.parametrize("kind", ["tree", pytest.param("path", marks=pytest.mark.slow), "hybrid"])
def test_suffix_greedy_equals_ar_and_learns_from_outputs(tiny, ar, kind, caplog):
    cfg, params = tiny
    drafter = _drafter(kind)
    gen = SpecGenerator(cfg, params, drafter=drafter, **KW)
    gen.warmup(prompt_lens=(16,), greedy_modes=(True,), batch_buckets=(1, 4))
    first = gen.generate(PROMPTS[:1], max_new_tokens=MAX_NEW, num_spec_tokens=8)
    assert [r.tokens for r in first] == ar[:1]
    stats = SpecStats()
    with caplog.at_level(logging.WARNING, logger="jax"), jax.log_compiles(True):
        out = gen.generate(PROMPTS, max_new_tokens=MAX_NEW, num_spec_tokens=8, stats=stats)
    assert [r.tokens for r in out] == ar
    assert not [r for r in caplog.records if "Compiling" in r.getMessage()], "compiled after warm-up"
    # Row 0 repeats the first pass, which the global tree now holds: long accepted runs.
    assert stats.mean_accepted_tokens > 1.5, stats.summary()


def test_suffix_tree_sampling_runs(tiny):
    cfg, params = tiny
    # Preloaded global tree (history), so sampled rows verify suffix trees from both trees.
    drafter = SuffixDrafter(SuffixConfig(max_depth=32, alpha=2.0, min_prob=0.05), history=[p * 3 for p in PROMPTS])
    gen = SpecGenerator(cfg, params, drafter=drafter, **KW)
    samp = [SamplingParams(temperature=0.8, top_p=0.9, seed=s) for s in range(3)]
    stats = SpecStats()
    out = gen.generate(PROMPTS, sampling=samp, max_new_tokens=MAX_NEW, num_spec_tokens=8, stats=stats)
    for r in out:
        assert len(r.tokens) == MAX_NEW and all(0 <= t < cfg.vocab_size for t in r.tokens)
    assert stats.drafted > 0
