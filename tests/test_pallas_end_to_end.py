"""The speculative core with attention_impl="pallas" (the tree-attention kernel, interpret
mode on CPU) on the tiny random model: greedy output equals AR greedy with the XLA path,
for every drafter kind, at batch 1 and 3 with mixed prompt lengths."""

from __future__ import annotations

import pytest

from specjax.drafters.prompt_lookup import PromptLookupDrafter
from specjax.drafters.device import ModelDraft, layer_skip
from specjax.generate import Generator
from specjax.models.options import ForwardOptions
from specjax.reference_ar import reference_generate
from specjax.models import llama
from specjax.spec_generate import SpecGenerator


def _ls(cfg, params, n):
    """Layer-skip self-drafting with the first n layers, as SpecGenerator / JaxBackend kwargs."""
    d, dparams = layer_skip(cfg, params, n)
    return {"draft": d, "draft_params": dparams}

PROMPTS = [[30] * 8, [42, 7, 99], [11, 12] * 6]
MAX_NEW = 16
KW = dict(batch_buckets=(1, 4), k_buckets=(0, 1, 4), slot_buckets=(256,), fwd=ForwardOptions(attention="pallas"))


@pytest.fixture(scope="module")
def ar_xla(tiny):
    cfg, params = tiny
    return [r.tokens for r in reference_generate(cfg, params, PROMPTS, max_new_tokens=MAX_NEW, batch_buckets=(1, 4))]


def test_ar_decode_with_pallas_equals_xla(tiny, ar_xla):
    cfg, params = tiny
    gen = Generator(cfg, params, batch_buckets=(1, 4), fwd=ForwardOptions(attention="pallas"))
    assert [r.tokens for r in gen.generate(PROMPTS, max_new_tokens=MAX_NEW)] == ar_xla


@pytest.mark.parametrize("drafter", ["prompt_lookup", "draft_model", "layer_skip"])
def test_spec_greedy_with_pallas_equals_ar(tiny, ar_xla, drafter):
    cfg, params = tiny
    if drafter == "prompt_lookup":
        gen = SpecGenerator(cfg, params, drafter=PromptLookupDrafter(), **KW)
    elif drafter == "draft_model":
        dcfg = cfg.replace(name="tiny-draft", num_layers=2)
        gen = SpecGenerator(cfg, params, draft=ModelDraft(dcfg),
                            draft_params=llama.init_random_params(dcfg, seed=1), **KW)
    else:
        gen = SpecGenerator(cfg, params, **_ls(cfg, params, 2), **KW)
    assert [r.tokens for r in gen.generate(PROMPTS, max_new_tokens=MAX_NEW, num_spec_tokens=4)] == ar_xla
    assert [r.tokens for r in gen.generate(PROMPTS[:1], max_new_tokens=MAX_NEW, num_spec_tokens=1)] == ar_xla[:1]
