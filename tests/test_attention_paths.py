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


@pytest.mark.parametrize("chunk", [256, 0])
def test_one_token_block_matches_reference(chunk):
    """A one-token block (K = 0) runs as two positions (attention._two_positions); the real
    token's output is the unpadded reference's, on both XLA paths."""
    from specjax.models.options import ForwardOptions

    rng = np.random.default_rng(1)
    B, H, Hkv, hd, L, S = 3, 4, 4, 16, 2, 512
    q = jnp.asarray(rng.standard_normal((B, 1, H, hd), np.float32))
    kb = jnp.asarray(rng.standard_normal((B, 1, Hkv, hd), np.float32))
    vb = jnp.asarray(rng.standard_normal((B, 1, Hkv, hd), np.float32))
    k_all = jnp.asarray(rng.standard_normal((L, B, Hkv, S, hd), np.float32))
    v_all = jnp.asarray(rng.standard_normal((L, B, Hkv, S, hd), np.float32))
    lens = jnp.asarray([0, 7, 300], jnp.int32)
    mask = jnp.ones((B, 1, 1), bool)
    ref = A.block_attention_xla(q, kb, vb, k_all[1], v_all[1], lens, mask)
    got = jax.jit(lambda *a: A.block_attention(*a, fwd=ForwardOptions(attn_chunk=chunk)), static_argnums=5)(
        q, kb, vb, k_all, v_all, 1, lens, mask)
    assert got.shape == ref.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-5, rtol=2e-5)


def test_every_k_lowers_to_the_same_op_kinds():
    """An MHA model's K = 0 step compiles to the op kinds of a K >= 1 step (shapes aside). It did not: its
    one-token block's dots became multiply + reduce and its transposes vanished, and on an H100
    the reduces' layouts made XLA transpose the whole stacked cache twice per layer (a K = 0 step
    took 2.7-10.9x a K = 2 step; BENCHMARKS.md "The K = 0 step's program"). Batch 2: at batch 1
    XLA also turns the one-index cache scatter into a dynamic-update-slice, in place."""
    from specjax.config import get_model_config
    from specjax.engine.profiling import step_op_kinds

    cfg = get_model_config("tiny-random").replace(num_layers=1, num_kv_heads=4)  # MHA: one query row per KV head
    kinds = step_op_kinds(cfg, [0, 1], batch=2, slots=256)
    assert set(kinds[0]) == set(kinds[1]), set(kinds[0]) ^ set(kinds[1])
    for op in ("dot", "transpose", "scatter", "while"):
        assert kinds[0][op] == kinds[1][op], (op, kinds[0][op], kinds[1][op])
