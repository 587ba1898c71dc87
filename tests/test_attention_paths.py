"""The chunked prefix attention (dynamic trip count) equals the one-shot reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import attention as A


@pytest.mark.parametrize("T, lengths", [(1, [0, 5, 300, 511]), (5, [257, 1, 256, 0]), (3, [512, 100, 0, 7])])
def test_chunked_matches_reference(T, lengths):
    rng = np.random.default_rng(T)
    B, H, Hkv, hd, L, S = 4, 6, 2, 16, 2, 768
    q = jnp.asarray(rng.standard_normal((B, T, H, hd), np.float32))
    kb = jnp.asarray(rng.standard_normal((B, T, Hkv, hd), np.float32))
    vb = jnp.asarray(rng.standard_normal((B, T, Hkv, hd), np.float32))
    k_all = jnp.asarray(rng.standard_normal((L, B, Hkv, S, hd), np.float32) * 2)
    v_all = jnp.asarray(rng.standard_normal((L, B, Hkv, S, hd), np.float32))
    lens = jnp.asarray(lengths, jnp.int32)
    # a tree-like block mask (node 2's parent is node 0)
    m = np.tril(np.ones((T, T), bool))
    if T >= 3:
        m[2, 1] = False
    mask = jnp.broadcast_to(jnp.asarray(m), (B, T, T))
    for layer in range(L):
        ref = A.block_attention_xla(q, kb, vb, k_all[layer], v_all[layer], lens, mask)
        got = jax.jit(A.block_attention_chunked, static_argnames=("layer", "chunk"))(
            q, kb, vb, k_all, v_all, layer=layer, lengths=lens, block_mask=mask, chunk=256)
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-5, rtol=2e-5)


def test_forward_options_are_compile_settings_with_one_result(tiny):
    """Every ForwardOptions setting (one-shot vs chunked prefix attention, per-row matvec
    projections) computes the same step; each is its own static key, so switching one compiles
    a new executable instead of silently changing a process-wide one."""
    from specjax.errors import SpecjaxError
    from specjax.models.options import ForwardOptions
    from specjax.reference_ar import reference_generate

    cfg, params = tiny
    prompts = [[5, 6, 7, 8] * 3, [9, 10]]
    opts = [ForwardOptions(), ForwardOptions(attn_chunk=0), ForwardOptions(small_rows=8)]
    assert len({hash(o) for o in opts}) == 3
    outs = [[r.tokens for r in reference_generate(cfg, params, prompts, max_new_tokens=6, fwd=o)] for o in opts]
    assert outs[0] == outs[1] == outs[2]
    with pytest.raises(SpecjaxError, match="unknown attention implementation"):
        ForwardOptions(attention="flash")
