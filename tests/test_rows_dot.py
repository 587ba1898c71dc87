"""The CPU rows kernel (models.cpu.rows_dot): equal to XLA's dot within float32 rounding on
ragged shapes, a row's result independent of how many rows share the call, and, inside the
engine, the same greedy tokens from speculation as from plain decoding through it."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from specjax.errors import SpecjaxError
from specjax.models.cpu import rows_dot as rd
from specjax.models.options import ForwardOptions


def test_rows_kernel_matches_xla_and_rows_are_independent():
    rng = np.random.default_rng(0)
    K, N = 83, 150  # N not a whole number of 16-column blocks
    w = jnp.asarray(rng.standard_normal((K, N)), jnp.float32)
    wp = rd.pack(w)
    assert wp.shape == (10, K, 16)
    x = jnp.asarray(rng.standard_normal((40, K)), jnp.float32)
    f = jax.jit(lambda x, wp: rd.rows_dot(x, wp, N))
    for M in (1, 5, 12, 13, 40):  # one register tile, a tile and a row more, several tiles
        got = np.asarray(f(x[:M], wp))
        np.testing.assert_allclose(got, np.asarray(rd.rows_dot_reference(x[:M], w)), rtol=1e-5, atol=1e-4)
        # bit-identical rows whatever else is in the call: a decode row == that row of a verify block
        np.testing.assert_array_equal(got[M - 1:M], np.asarray(f(x[M - 1:M], wp)))
    y3 = rd.rows_dot(x[:6].reshape(2, 3, K), wp, N)  # leading dims are kept
    np.testing.assert_array_equal(np.asarray(y3).reshape(6, N), np.asarray(f(x[:6], wp)))
    with pytest.raises(SpecjaxError, match="float32 only"):
        rd.rows_dot(x.astype(jnp.bfloat16), wp, N)


def test_rows_kernel_in_the_engine_is_lossless(tiny):
    """Plain decoding and prompt-lookup speculation (verify blocks of up to 5 x 4 rows) give the
    same greedy tokens through the kernel; on these prompts also the same as XLA's dot."""
    from specjax.drafters.device import layer_skip
    from specjax.drafters.prompt_lookup import PromptLookupDrafter
    from specjax.generate import Generator
    from specjax.reference_ar import reference_generate
    from specjax.spec_generate import SpecGenerator, SpecStats

    cfg, params = tiny
    fwd = ForwardOptions(rows_kernel=32)
    prompts = [[5, 6, 7, 8] * 3, [9, 10], [11, 12] * 5]
    kw = dict(batch_buckets=(4,), slot_buckets=(128,), fwd=fwd)
    ar = [r.tokens for r in Generator(cfg, params, batch_buckets=(4,), fwd=fwd).generate(prompts, max_new_tokens=12)]
    assert ar == [r.tokens for r in reference_generate(cfg, params, prompts, max_new_tokens=12)]
    for parts in ({"drafter": PromptLookupDrafter()}, dict(zip(("draft", "draft_params"), layer_skip(cfg, params, 1)))):
        stats = SpecStats()
        spec = SpecGenerator(cfg, params, k_buckets=(0, 4), **parts, **kw).generate(
            prompts, max_new_tokens=12, num_spec_tokens=4, stats=stats)
        assert [r.tokens for r in spec] == ar and stats.drafted > 0  # verify blocks really ran
    with pytest.raises(ValueError, match="pack_for_rows"):
        from specjax.models import llama

        llama.dense(jnp.ones((1, 8)), jnp.ones((8, 4)), fwd)


def test_rows_kernel_without_a_compiler_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(rd, "_loaded", {})
    monkeypatch.setattr(rd, "_compiler", lambda: None)
    with pytest.raises(SpecjaxError, match="needs a C[+][+] compiler"):
        rd.ensure()
    assert not rd.available()
    from specjax.config import get_model_config
    from specjax.models import llama

    # packing registers the kernel too (an executable loaded from the disk cache calls it untraced)
    with pytest.raises(SpecjaxError, match="needs a C[+][+] compiler"):
        llama.pack_for_rows({"layers": [], "embed": jnp.ones((4, 2))}, get_model_config("tiny-random"))
