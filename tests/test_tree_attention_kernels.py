"""Pallas tree-attention kernels (kernels_pallas/tree_attention) against the plain-jnp
reference, in interpret mode on CPU: row lengths including 0 and not multiples of the tile,
N from 1 to 64, chain / star / random / shared-prefix trees, GQA ratios 1, 3 and 8, fp32 and
bf16, both the GPU (Triton-style) and TPU (Mosaic-style) kernel bodies. Interpret mode fills
every output and scratch buffer with NaN before the kernel runs, so an element a kernel
forgets to write shows up as NaN (the control test below proves that poisoning is on). The GPU
kernel's split-KV and query-tile grid axes are checked at the shapes an H100 failed or ran
slowly, and lowered to Triton IR for CUDA without a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from kernels_pallas.tree_attention import (MAX_TREE_TOKENS, chain_mask, check_tree_mask, gpu_config,
                                           mask_from_parents, tree_attention, tree_attention_reference)


def _random_parents(rng, n):
    return np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)])


def _tree(kind, n, rng):
    if kind == "chain":
        return chain_mask(n)
    if kind == "star":  # depth 1, many leaves
        return mask_from_parents([-1] + [0] * (n - 1))
    if kind == "random":
        return mask_from_parents(_random_parents(rng, n))
    if kind == "binary":
        return mask_from_parents([-1] + [(i - 1) // 2 for i in range(1, n)])
    raise ValueError(kind)


def _inputs(rng, B, N, H, Hkv, hd, S, L, dtype, lengths, tree):
    def r(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)

    masks = np.stack([_tree(tree, N, rng) for _ in range(B)])
    return dict(q=r(B, N, H, hd), k_blk=r(B, N, Hkv, hd), v_blk=r(B, N, Hkv, hd), k_cache=r(L, B, Hkv, S, hd),
                v_cache=r(L, B, Hkv, S, hd), lengths=jnp.asarray(lengths, jnp.int32), block_mask=jnp.asarray(masks))


# (B, N, H, Hkv, hd, S, lengths, tree, block_kv): lengths include 0, S (full), and values that
# are not multiples of the tile; N spans 1..64; GQA ratios 1, 3 and 8.
CASES = [
    (2, 1, 4, 4, 32, 64, [0, 37], "chain", 16),
    (3, 5, 9, 3, 64, 128, [0, 17, 128], "random", 32),
    (2, 8, 8, 1, 64, 128, [100, 3], "star", 64),
    (1, 17, 6, 2, 32, 64, [33], "binary", 16),
    (2, 33, 3, 1, 16, 64, [64, 1], "random", 16),
    (1, 64, 8, 8, 64, 128, [77], "chain", 32),
    (2, 64, 16, 2, 32, 64, [0, 50], "star", None),
]


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=[f"B{c[0]}N{c[1]}H{c[2]}kv{c[3]}-{c[7]}" for c in CASES])
def test_kernel_matches_reference(backend, dtype, case):
    B, N, H, Hkv, hd, S, lengths, tree, block_kv = case
    rng = np.random.default_rng(hash((N, H, S)) % 2**32)
    x = _inputs(rng, B, N, H, Hkv, hd, S, 2, jnp.dtype(dtype), lengths, tree)
    if backend == "tpu":
        block_kv = None  # the TPU kernel tiles by 128+ (S must divide): exercise its own choice
        if S % 128:
            x["k_cache"] = jnp.concatenate([x["k_cache"]] * (128 // S), axis=3)
            x["v_cache"] = jnp.concatenate([x["v_cache"]] * (128 // S), axis=3)
    out = tree_attention(**x, layer=1, backend=backend, interpret=True, block_kv=block_kv)
    ref = tree_attention_reference(x["q"], x["k_blk"], x["v_blk"], x["k_cache"][1], x["v_cache"][1], x["lengths"],
                                   x["block_mask"])
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.shape == (B, N, H, hd)
    assert not np.isnan(out).any()
    err = np.abs(out - ref).max()
    if dtype == "float32":
        assert err <= 1e-5, err
    else:
        assert err / np.abs(ref).max() <= 2e-2, err / np.abs(ref).max()


# ---------------------------------------------------------------- GPU kernel: split-KV, query tiles

# (B, N, H, Hkv, S, lengths, tree, dtype, block_q, num_splits, query tiles), head_dim 16, 16-slot K/V tiles.
# The H100's failing shapes (fp32, 64 nodes, 8 and 7 query heads per KV head: 512 rows) and its
# slow ones (few programs: batch 1-4 under GQA, decode), with rows of length 0, 1, mid and full.
SPLIT_CASES = [
    (4, 64, 8, 1, 64, [0, 1, 37, 64], "random", "float32", None, 3, 8),  # fp32's default 64-row tiles; 3 splits
    (2, 64, 14, 2, 64, [64, 29], "chain", "float32", 128, 1, 4),  # 448 rows padded to 512; one split
    (4, 5, 8, 2, 128, [0, 1, 70, 128], "star", "bfloat16", None, 16, 1),  # more splits than tiles: most run nothing
    (3, 1, 4, 4, 128, [0, 1, 128], "chain", "float32", 32, 2, 1),  # decode (N = 1); block_q above R = 16: one tile
]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=[f"N{c[1]}H{c[2]}kv{c[3]}-{c[7]}-q{c[8]}-s{c[9]}"
                                                   for c in SPLIT_CASES])
def test_gpu_split_kv_and_query_tiles_match_reference(case):
    from kernels_pallas.tree_attention.layout import padded_sizes

    B, N, H, Hkv, S, lengths, tree, dtype, block_q, num_splits, q_tiles = case
    rng = np.random.default_rng(N * 100 + H)
    x = _inputs(rng, B, N, H, Hkv, 16, S, 2, jnp.dtype(dtype), lengths, tree)
    _, bq, _ = gpu_config(x["q"].shape, Hkv, S, jnp.dtype(dtype), block_kv=16, block_q=block_q, num_splits=num_splits)
    assert padded_sizes(N, H // Hkv)[0] // bq == q_tiles
    ref = tree_attention_reference(x["q"], x["k_blk"], x["v_blk"], x["k_cache"][1], x["v_cache"][1], x["lengths"],
                                   x["block_mask"])
    # NaN in the other layer and in every slot past a row's last K/V tile: a split that read a
    # tile it should skip would turn its row's output to NaN (0 * NaN in p @ v)
    past = np.arange(S)[None, :] >= (-(-np.asarray(lengths) // 16) * 16)[:, None]  # [B, S]
    poison = np.zeros((2, B, 1, S, 1), bool)
    poison[0], poison[1] = True, past[:, None, :, None]
    for name in ("k_cache", "v_cache"):
        x[name] = jnp.where(poison, jnp.nan, x[name])
    out = tree_attention(**x, layer=1, backend="gpu", interpret=True, block_kv=16, block_q=block_q,
                         num_splits=num_splits)
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert not np.isnan(out).any()
    err = np.abs(out - ref).max()
    assert err <= (1e-5 if dtype == "float32" else 2e-2 * np.abs(ref).max()), err


def test_gpu_tiles_fit_shared_memory_and_splits_fill_the_device():
    from kernels_pallas.tree_attention.layout import padded_sizes
    from kernels_pallas.tree_attention.tuning import GPU_SMEM_BYTES, gpu_smem_bytes, pick_num_splits

    # the estimate reproduces the H100's compile error and the shapes that compiled
    assert gpu_smem_bytes(512, 64, 128, 4) == 360448 > GPU_SMEM_BYTES
    assert gpu_smem_bytes(256, 64, 128, 4) <= GPU_SMEM_BYTES and gpu_smem_bytes(512, 64, 128, 2) <= GPU_SMEM_BYTES
    for dtype in (jnp.float32, jnp.bfloat16):
        for H, Hkv in ((32, 32), (32, 8), (28, 4), (8, 1)):  # the device check's head layouts
            for N in (1, 5, 8, 16, 64):
                for hd, S in ((128, 2048), (64, 1024), (128, 96)):
                    bk, bq, splits = gpu_config((1, N, H, hd), Hkv, S, dtype)
                    R, _ = padded_sizes(N, H // Hkv)
                    assert R % bq == 0 and splits >= 1
                    assert gpu_smem_bytes(bq, bk, hd, jnp.dtype(dtype).itemsize) <= GPU_SMEM_BYTES, (dtype, H, N, hd)
    # splits: about one program per SM, bounded by the cache (a split reads >= 4 tiles and 8x the
    # bytes of its partial output) and MAX_SPLITS
    assert pick_num_splits(1, 8, 1, 16384, 64, 16, 2, target=132) == 17  # decode, GQA 32/8, batch 1
    assert pick_num_splits(1, 8, 1, 1024, 64, 16, 2, target=132) == 4
    assert pick_num_splits(1, 8, 2, 2048, 64, 128, 2, target=132) == 2  # 64 nodes: 128-row tiles need 1024 slots
    assert pick_num_splits(8, 32, 1, 16384, 64, 16, 2, target=132) == 1
    assert pick_num_splits(1, 1, 1, 1 << 20, 64, 16, 4, target=132) == 32
    assert gpu_config((1, 1, 32, 128), 8, 2048, jnp.bfloat16, interpret=True)[2] == 1
    with pytest.raises(ValueError, match="power of two"):
        gpu_config((1, 8, 8, 16), 1, 64, jnp.float32, block_q=24)
    with pytest.raises(ValueError, match="num_splits"):
        gpu_config((1, 8, 8, 16), 1, 64, jnp.float32, num_splits=0)


def test_gpu_kernel_lowers_to_triton():
    """jax lowers for a platform it has no device for: the split, query-tiled kernel becomes a
    Triton custom call for CUDA here. This catches what the Triton lowering lacks (the cond that
    gives split 0 the tree block, the loop with a traced lower bound, the 1-D statistics
    outputs) without a GPU; shared-memory limits need the GPU's own compiler (device_check.py)."""
    B, N, H, Hkv, hd, S = 2, 64, 16, 2, 64, 256
    sds = jax.ShapeDtypeStruct
    args = (sds((B, N, H, hd), jnp.float32), sds((B, N, Hkv, hd), jnp.float32), sds((B, N, Hkv, hd), jnp.float32),
            sds((2, B, Hkv, S, hd), jnp.float32), sds((2, B, Hkv, S, hd), jnp.float32), sds((B,), jnp.int32),
            sds((B, N, N), jnp.bool_))
    triton_call = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")  # not a stable export target
    for splits in (1, 3):
        fn = jax.jit(lambda *a: tree_attention(*a, layer=1, backend="gpu", interpret=False, num_splits=splits))
        exported = jax.export.export(fn, platforms=["cuda"], disabled_checks=[triton_call])(*args)
        assert "xla.gpu.triton" in exported.mlir_module()


def test_reference_matches_model_attention():
    """The kernels' reference and the model's XLA path agree (so either can be the oracle)."""
    from specjax.models.attention import block_attention_xla

    rng = np.random.default_rng(0)
    x = _inputs(rng, 3, 6, 8, 2, 32, 64, 1, jnp.float32, [0, 9, 64], "random")
    ref = tree_attention_reference(x["q"], x["k_blk"], x["v_blk"], x["k_cache"][0], x["v_cache"][0], x["lengths"],
                                   x["block_mask"])
    xla = block_attention_xla(x["q"], x["k_blk"], x["v_blk"], x["k_cache"][0], x["v_cache"][0], x["lengths"],
                              x["block_mask"])
    np.testing.assert_allclose(np.asarray(ref), np.asarray(xla), atol=1e-5)


def test_siblings_sharing_a_token_attend_only_their_own_path():
    """Two siblings with identical K/V but different children: each child sees only its parent."""
    rng = np.random.default_rng(1)
    x = _inputs(rng, 1, 5, 2, 2, 16, 64, 1, jnp.float32, [10], "chain")
    x["block_mask"] = jnp.asarray(mask_from_parents([-1, 0, 0, 1, 2]))[None]
    x["k_blk"] = x["k_blk"].at[:, 2].set(x["k_blk"][:, 1])
    out = tree_attention(**x, layer=0, backend="gpu", interpret=True, block_kv=16)
    ref = tree_attention_reference(x["q"], x["k_blk"], x["v_blk"], x["k_cache"][0], x["v_cache"][0], x["lengths"],
                                   x["block_mask"])
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)


def test_interpret_mode_poisons_unwritten_outputs():
    """Control: a kernel that leaves its output unwritten returns NaN in interpret mode, so the
    no-NaN assertions above catch any element a tree-attention kernel fails to write."""

    def lazy_kernel(x_ref, o_ref):
        @pl.when(pl.program_id(0) == 0)
        def _():
            o_ref[...] = x_ref[...]

    x = jnp.ones((2, 8, 128), jnp.float32)
    out = pl.pallas_call(lazy_kernel, grid=(2,), in_specs=[pl.BlockSpec((1, 8, 128), lambda i: (i, 0, 0))],
                         out_specs=pl.BlockSpec((1, 8, 128), lambda i: (i, 0, 0)),
                         out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)
    assert not np.isnan(np.asarray(out[0])).any()
    assert np.isnan(np.asarray(out[1])).all()


# ---------------------------------------------------------------- tree masks


def test_masks_from_parents_are_trees():
    rng = np.random.default_rng(2)
    for n in (1, 2, 7, 64):
        check_tree_mask(mask_from_parents(_random_parents(rng, n)))
        check_tree_mask(chain_mask(n))
    m = mask_from_parents([-1, 0, 1, 1, 0])
    assert m[3].tolist() == [True, True, False, True, False]


@pytest.mark.parametrize("bad, msg", [
    (np.array([[1, 0], [1, 0]], bool), "attend to itself"),
    (np.array([[1, 1], [0, 1]], bool), "topological order"),
    (np.array([[1, 0, 0], [0, 1, 0], [1, 0, 1]], bool), "descend from the root"),
    (np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 1, 1]], bool), "two parents"),
])
def test_non_tree_masks_are_rejected(bad, msg):
    with pytest.raises(ValueError, match=msg):
        check_tree_mask(bad)
    rng = np.random.default_rng(3)
    n = bad.shape[0]
    x = _inputs(rng, 1, n, 2, 1, 16, 64, 1, jnp.float32, [4], "chain")
    x["block_mask"] = jnp.asarray(bad)[None]
    with pytest.raises(ValueError, match=msg):
        tree_attention(**x, layer=0, backend="gpu", interpret=True)


def test_bad_parents_are_rejected():
    with pytest.raises(ValueError, match="parent must come before"):
        mask_from_parents([-1, 0, 3, 1])
    with pytest.raises(ValueError, match="root"):
        mask_from_parents([0, 0])


def test_shape_errors_are_clear():
    rng = np.random.default_rng(4)
    x = _inputs(rng, 1, MAX_TREE_TOKENS + 1, 2, 1, 16, 128, 1, jnp.float32, [4], "chain")
    with pytest.raises(ValueError, match="compiled range"):
        tree_attention(**x, layer=0, backend="gpu", interpret=True)
    x = _inputs(rng, 2, 4, 6, 4, 16, 64, 1, jnp.float32, [4, 4], "chain")
    with pytest.raises(ValueError, match="multiple of KV heads"):
        tree_attention(**x, layer=0)
    x = _inputs(rng, 2, 4, 4, 2, 16, 64, 1, jnp.float32, [4, 4], "chain")
    x["k_cache"] = jnp.zeros((1, 2, 4, 64, 16))
    x["v_cache"] = x["k_cache"]
    with pytest.raises(ValueError, match="KV heads"):
        tree_attention(**x, layer=0)
    x = _inputs(rng, 2, 4, 4, 2, 16, 64, 1, jnp.float32, [4, 4], "chain")
    with pytest.raises(ValueError, match="needs layer"):
        tree_attention(**x, layer=3)
    x = _inputs(rng, 1, 4, 4, 2, 16, 40, 1, jnp.float32, [4], "chain")
    with pytest.raises(ValueError, match="multiple of"):
        tree_attention(**x, layer=0, backend="gpu", interpret=True)


def test_kernel_under_jit_with_traced_mask():
    """Inside jit the mask is a tracer: no host check, same numbers."""
    rng = np.random.default_rng(5)
    x = _inputs(rng, 2, 4, 4, 2, 16, 64, 1, jnp.float32, [3, 60], "random")
    f = jax.jit(lambda **kw: tree_attention(**kw, layer=0, backend="gpu", interpret=True, block_kv=16))
    ref = tree_attention_reference(x["q"], x["k_blk"], x["v_blk"], x["k_cache"][0], x["v_cache"][0], x["lengths"],
                                   x["block_mask"])
    np.testing.assert_allclose(np.asarray(f(**x)), np.asarray(ref), atol=1e-5)


def test_tile_choice_and_autotune():
    from kernels_pallas.tree_attention import autotune_block_kv, pick_block_kv

    assert pick_block_kv(256, "gpu") == 64 and pick_block_kv(48, "gpu") == 16 and pick_block_kv(384, "tpu") == 128
    rng = np.random.default_rng(6)
    x = _inputs(rng, 1, 3, 2, 1, 16, 64, 1, jnp.float32, [50], "chain")
    best, timings = autotune_block_kv(
        lambda bk: tree_attention(**x, layer=0, backend="gpu", interpret=True, block_kv=bk), 64, "gpu", reps=1,
        candidates=(64, 32, 48))
    assert set(timings) == {64, 32} and best in timings
