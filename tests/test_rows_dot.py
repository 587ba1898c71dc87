"""The CPU rows kernel (models.cpu.rows_dot): equal to XLA's dot within float32 rounding on
ragged shapes, a row's result independent of how many rows share the call, and, inside the
engine, the same greedy tokens from speculation as from plain decoding through it. GGUF Q4_1 /
Q8_0 weights kept in their blocks stand for exactly the loader's float32 weights, and the
portable build computes bit for bit what the vectorized (AVX-512 or AVX2) one does. With int8
activations (rows_activations int8 / bfloat16) the kernel computes its numpy reference's model, rows still independent,
and speculation through it gives plain decoding's tokens."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from specjax.errors import SpecjaxError
from specjax.models.cpu import rows_dot as rd
from specjax.models.options import ForwardOptions


def _random_packs(rng, K, N):
    """One weight [K, N] in each of the kernel's formats (the GGUF ones from random blocks, with
    float16 scales of both signs and a subnormal), as (packed, its float32 values)."""
    G = K // rd.GROUP
    d = (rng.standard_normal((N, G)) * 0.05).astype(np.float16)
    d[0, 0] = np.float16(3e-6)  # subnormal in float16
    mins = (rng.standard_normal((N, G)) * 0.2).astype(np.float16)
    c4, c8 = rng.integers(0, 256, (N, G, 16), dtype=np.uint8), rng.integers(-128, 128, (N, G, 32), dtype=np.int8)
    q4, q8 = rd.pack_q4_1(d, mins, c4), rd.pack_q8_0(d, c8)
    w = jnp.asarray(rng.standard_normal((K, N)), jnp.float32)
    return {"f32": (rd.pack(w), np.asarray(w)), "q4_1": (q4, rd.dequantize_packed(q4, N)),
            "q8_0": (q8, rd.dequantize_packed(q8, N)),
            # the int8 activations' layout: the same values
            "q4_1 pairs": (rd.pack_q4_1(d, mins, c4, pairs=True), rd.dequantize_packed(q4, N)),
            "q8_0 pairs": (rd.pack_q8_0(d, c8, pairs=True), rd.dequantize_packed(q8, N))}


def test_fused_projections_give_each_projections_bits():
    """llama.FUSED: q/k/v (gate/up) as one stack of their column blocks, one call; every output
    column the same bits as its own projection's call, in every format and activation mode."""
    from specjax.models import llama

    rng = np.random.default_rng(5)
    K, widths = 64, {"wq": 48, "wk": 16, "wv": 16, "w_gate": 32, "w_up": 32, "wo": 40}  # (wo: not fused)
    x = jnp.asarray(rng.standard_normal((5, K)), jnp.float32)
    for fmt, act in (("f32", "float32"), ("q4_1", "float32"), ("q8_0", "float32"), ("q4_1 pairs", "int8"),
                     ("q8_0 pairs", "bfloat16"), ("q4_1 pairs", "bfloat16")):
        stacks = {n: rd.stack_packs([_random_packs(rng, K, N)[fmt][0] for _ in range(2)]) for n, N in widths.items()}
        fused = llama.fuse_packs(stacks, widths)
        assert set(fused) == {"wqkv", "w_gate_up", "wo"}, fmt
        for name, names in llama.FUSED.items():
            got = np.asarray(rd.rows_dot(x, fused[name], sum(widths[n] for n in names), activations=act, layer=1))
            want = np.concatenate([np.asarray(rd.rows_dot(x, stacks[n], widths[n], activations=act, layer=1))
                                   for n in names], axis=1)
            np.testing.assert_array_equal(got, want, err_msg=f"{fmt} {act} {name}")
    # a member whose width leaves padding in its last block, or another format, stays apart
    w = {**widths, "wk": 8}
    mixed = {n: rd.stack_packs([_random_packs(rng, K, 16 if n == "wk" else N)["q4_1"][0]]) for n, N in widths.items()}
    assert set(llama.fuse_packs(mixed, w)) == {"wq", "wk", "wv", "w_gate_up", "wo"}
    mixed["w_up"] = rd.stack_packs([_random_packs(rng, K, 32)["q8_0"][0]])
    assert "w_gate_up" not in llama.fuse_packs(mixed, widths) and "w_up" in llama.fuse_packs(mixed, widths)


def test_a_call_on_the_calling_thread_alone_gives_the_same_bits():
    """rows_dot.set_solo_rows: small blocks skip XLA's helper threads (a machine setting); every
    mode's outputs are the same bits split over threads or not."""
    rng = np.random.default_rng(6)
    K, N = 64, 400  # 25 column blocks: several chunks to split
    packs = _random_packs(rng, K, N)
    x = jnp.asarray(rng.standard_normal((5, K)), jnp.float32)
    calls = [(packs[f][0], act) for f, act in (("f32", "float32"), ("q4_1", "float32"), ("q8_0 pairs", "int8"),
                                                ("q4_1 pairs", "bfloat16"), ("q8_0 pairs", "bfloat16"))]
    fs = [jax.jit(lambda x, wp, a=act: rd.rows_dot(x, wp, N, activations=a)) for _, act in calls]
    # the attention of a 3-token block over 40 cached slots of a [2, 1, 2, 64, 16] cache, 4 heads
    q, kb, vb = (jnp.asarray(rng.standard_normal((1, 3, h, 16)), jnp.float32) for h in (4, 2, 2))
    kc, vc = (jnp.asarray(rng.standard_normal((2, 1, 2, 64, 16)), jnp.float32) for _ in range(2))
    attend = jax.jit(lambda *a: rd.block_attention(*a, 1, jnp.array([40], jnp.int32), jnp.tril(jnp.ones((1, 3, 3), bool))))
    try:
        outs = {}
        for solo in (0, 64):
            rd.set_solo_rows(solo)
            outs[solo] = [np.asarray(f(x[:m], wp)) for f, (wp, _) in zip(fs, calls) for m in (1, 3, 5)]
            outs[solo].append(np.asarray(attend(q, kb, vb, kc, vc)))
        for a, b in zip(outs[0], outs[64]):
            np.testing.assert_array_equal(a, b)
    finally:
        rd.set_solo_rows()
    assert rd.default_solo_rows() in (0, 3)


def test_rows_kernel_matches_xla_and_rows_are_independent():
    rng = np.random.default_rng(0)
    K, N = 96, 150  # N not a whole number of 16-column blocks
    packs = _random_packs(rng, K, N)
    assert packs["f32"][0].shape == (10, K, 16)
    x = jnp.asarray(rng.standard_normal((40, K)), jnp.float32)
    f = jax.jit(lambda x, wp: rd.rows_dot(x, wp, N))
    f8 = jax.jit(lambda x, wp: rd.rows_dot(x, wp, N, activations="int8"))
    for fmt, (wp, w) in packs.items():
        assert rd.packed_format(wp) == fmt.split()[0] and rd.paired(wp) == fmt.endswith("pairs")
        np.testing.assert_array_equal(rd.dequantize_packed(wp, N), w)
        if rd.paired(wp):  # int8 activations: the reference's model, rows as independent
            for M in (1, 4, 9, 40):  # AVX-512 VNNI: tiles of 8 rows, then 1; several tiles
                g8 = np.asarray(f8(x[:M], wp))
                np.testing.assert_allclose(g8, rd.rows_dot_int8_reference(np.asarray(x[:M]), wp, N), rtol=1e-5,
                                           atol=1e-5, err_msg=fmt)
                for i in range(M) if M == 9 else (M - 1,):
                    np.testing.assert_array_equal(g8[i:i + 1], np.asarray(f8(x[i:i + 1], wp)), err_msg=f"{fmt} row {i}")
            # bfloat16 activations: its reference's bits (the same float32 steps), rows as independent
            fb = jax.jit(lambda x, wp: rd.rows_dot(x, wp, N, activations="bfloat16"))
            for M in (1, 5, 9, 40):  # AVX-512 BF16: tiles of 8 rows, then 1; several tiles
                gb = np.asarray(fb(x[:M], wp))
                np.testing.assert_array_equal(gb, rd.rows_dot_bf16_reference(np.asarray(x[:M]), wp, N), err_msg=fmt)
                for i in range(M) if M == 9 else (M - 1,):
                    np.testing.assert_array_equal(gb[i:i + 1], np.asarray(fb(x[i:i + 1], wp)), err_msg=f"{fmt} row {i}")
            # (the bfloat16 model, not the float32 one: within bfloat16's rounding of it)
            exact = np.asarray(x[:M]) @ w.astype(np.float64)
            assert 0 < np.linalg.norm(gb - exact) / np.linalg.norm(exact) < 0.01, fmt
            with pytest.raises(SpecjaxError, match="paired layout"):
                rd.rows_dot(x, wp, N)
            continue
        for M in (1, 5, 12, 13, 40):  # one register tile, a tile and a row more, several tiles
            got = np.asarray(f(x[:M], wp))
            np.testing.assert_allclose(got, np.asarray(x[:M]) @ w.astype(np.float64), rtol=1e-5, atol=1e-4,
                                       err_msg=fmt)
            # bit-identical rows whatever else is in the call: a decode row == that row of a verify block
            np.testing.assert_array_equal(got[M - 1:M], np.asarray(f(x[M - 1:M], wp)))
            if M == 13:  # every row, each sub-tile of a block decoded once for all of them (AVX2)
                for i in range(M - 1):
                    np.testing.assert_array_equal(got[i:i + 1], np.asarray(f(x[i:i + 1], wp)), err_msg=f"{fmt} row {i}")
    # a stack of one pack per layer, read at a run-time layer index (a scan's counter), in place
    other = _random_packs(rng, K, N)
    fl = jax.jit(lambda x, wp, i, act: rd.rows_dot(x, wp, N, activations=act, layer=i), static_argnums=3)
    for fmt in packs:
        int8 = "int8" if fmt.endswith("pairs") else "float32"
        stack = rd.stack_packs([packs[fmt][0], other[fmt][0]])
        for i, wp in enumerate((packs[fmt][0], other[fmt][0])):
            np.testing.assert_array_equal(np.asarray(fl(x[:5], stack, jnp.int32(i), int8)),
                                          np.asarray(rd.rows_dot(x[:5], wp, N, activations=int8)), err_msg=fmt)
        with pytest.raises(Exception, match="layer index outside"):
            np.asarray(fl(x[:5], stack, jnp.int32(2), int8))
    wp = packs["f32"][0]
    y3 = rd.rows_dot(x[:6].reshape(2, 3, K), wp, N)  # leading dims are kept
    np.testing.assert_array_equal(np.asarray(y3).reshape(6, N), np.asarray(f(x[:6], wp)))
    with pytest.raises(SpecjaxError, match="float32 only"):
        rd.rows_dot(x.astype(jnp.bfloat16), wp, N)
    with pytest.raises(SpecjaxError, match="unknown rows activations"):
        rd.rows_dot(x, wp, N, activations="fp8")
    # bfloat16 rounding: to nearest, ties to even; subnormals to zero (sign kept); NaN stays NaN
    b = rd.round_bf16(np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, -1e-39, np.nan, np.inf, 3.4e38], np.float32))
    assert b.tolist() == [0x3F80, 0x3F82, 0x8000, 0x7FC0, 0x7F80, 0x7F80]
    # int8 rounding: ties to even, an all-zero group has scale 0, codes within +-127
    q, dx = rd.quantize_rows(np.array([[0.5, 1.5, -2.5, 127.0] + [0.0] * 28 + [0.0] * 32], np.float32))
    assert q[0, :4].tolist() == [0, 2, -2, 127] and dx[0].tolist() == [1.0, 0.0] and not q[0, 32:].any()


@pytest.mark.parametrize("march", [None, "haswell"], ids=["portable", "avx2"])
def test_other_builds_match_the_native_build(march):
    """The kernel without -march=native (the loops every other CPU runs) and, on an AVX-512 CPU,
    its AVX2 + FMA + F16C build give the native build's results (AVX-512 with VNNI where the CPU
    has it, or AVX2) bit for bit, in every format: all sum each output in the same order (int8
    activations: exact integer sums, then the same float steps; bfloat16: vdpbf16ps's order, which
    the other builds follow in scalar code)."""
    if not rd.vectorized():
        pytest.skip("this CPU has neither AVX-512 nor AVX2 + FMA + F16C: the default build is already the portable one")
    if march is not None and rd.simd_class() != "avx512":
        pytest.skip("the native build is the AVX2 one on this CPU: the portable case compares it")
    suffix = "_portable" if march is None else "_avx2"
    rd.register(rd._build(rd._compiler(), march=march), suffix)
    rng = np.random.default_rng(1)
    K, N = 64, 40
    xs = rng.standard_normal((13, K)).astype(np.float32)
    xs[2, 3], xs[3, 40], xs[1, :32] = np.inf, np.nan, 0.0  # int8 rounding: groups with an inf, a NaN, all zeros
    x = jnp.asarray(xs)
    xs[4, 5], xs[4, 6] = 1e-39, -3.4e38  # bfloat16 rounding: a subnormal, a value that rounds to -inf
    x = jnp.asarray(xs)
    for fmt, (wp, _) in _random_packs(rng, K, N).items():
        operands = (wp,) if fmt == "f32" else (wp["codes"], wp["scales"])
        for act, tail in (("int8", "_i8"), ("bfloat16", "_bf16")) if rd.paired(wp) else (("float32", ""),):
            target = "specjax_rows_packed" if fmt == "f32" else f"specjax_rows_{fmt.split()[0]}" + tail
            for M in (1, 4, 13):
                other = jax.ffi.ffi_call(target + suffix, jax.ShapeDtypeStruct((M, N), jnp.float32))(x[:M], *operands)
                np.testing.assert_array_equal(np.asarray(other), np.asarray(rd.rows_dot(x[:M], wp, N, activations=act)),
                                              err_msg=f"{fmt} {act} {M} rows")
    # the attention: the same bits in the AVX2 build (the portable loops add a dot product in
    # another order), at block sizes whose (token, head) rows fill one task or several
    r = lambda *sh: jnp.asarray(rng.standard_normal(sh), jnp.float32)  # noqa: E731
    ka, va = r(2, 2, 3, 48, 64), r(2, 2, 3, 48, 64)
    for T in (1, 2, 5):
        q, kb, vb = r(2, T, 9, 64), r(2, T, 3, 64), r(2, T, 3, 64)
        lens, mask = jnp.array([13, 40], jnp.int32), jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (2, T, T))
        got = jax.ffi.ffi_call("specjax_block_attention" + suffix, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
            q, kb, vb, ka, va, lens, mask, jnp.int32(1))
        native = np.asarray(rd.block_attention(q, kb, vb, ka, va, 1, lens, mask))
        if march is None:
            np.testing.assert_allclose(np.asarray(got), native, rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_array_equal(np.asarray(got), native, err_msg=f"attention, {T} tokens")


def _q4_1_gguf_model(tmp_path):
    """The tiny Llama (tied embedding) written as a GGUF with Q4_1 projections and a Q8_0
    embedding, loaded as the launch scripts load a model."""
    from gguf import GGMLQuantizationType as Q
    from tiny_gguf import _gguf_cfg, tiny_bpe_vocab, write_tiny_gguf

    from specjax.models import llama
    from specjax.models.loader import load_model

    tokens, merges, types = tiny_bpe_vocab()
    cfg = _gguf_cfg("llama_tied", len(tokens))
    path = tmp_path / "q.gguf"
    write_tiny_gguf(path, cfg, llama.init_random_params(cfg, seed=3), tokens, merges, types, proj_type=Q.Q4_1,
                    embed_type=Q.Q8_0)
    return load_model(str(path))


def test_gguf_blocks_stay_quantized_and_decode_greedily_the_same(tmp_path, monkeypatch):
    """A GGUF with Q4_1 projections (q/k rows permuted, as llama.cpp writes them) and a Q8_0 tied
    embedding: the packs the engine reads stand for exactly the float32 weights the loader gives,
    and greedy decoding through them (plain and with prompt-lookup verify blocks) gives the
    float32 path's tokens."""
    from specjax import registry
    from specjax.generate import Generator
    from specjax.models import llama
    from specjax.models.loader import load_model

    m = _q4_1_gguf_model(tmp_path)
    # what launch scripts run unless --rows_kernel says (the portable loops are not a speed-up)
    assert m.auto_rows_kernel() == (32 if rd.vectorized() else 0)
    assert load_model("tiny-random").auto_rows_kernel() == 0  # float32 weights: copies would double them
    fwd = ForwardOptions(rows_kernel=32)
    p = m.params_for(fwd)
    assert m.params_for(fwd) is p  # packed once
    for i, lp in enumerate(m.params["layers"]):
        packs = llama.layer_packs(p, i)
        assert set(packs) == {"wqkv", "wo", "w_gate_up", "w_down"}  # (q/k/v and gate/up one call each: llama.FUSED)
        for name, packed in packs.items():
            w = np.concatenate([np.asarray(lp[n]) for n in llama.FUSED.get(name, (name,))], axis=1)
            assert rd.packed_format(packed) == "q4_1"
            np.testing.assert_array_equal(rd.dequantize_packed(packed, w.shape[1]), w)
    assert rd.packed_format(p["head" + llama.ROWS_SUFFIX]) == "q8_0"
    np.testing.assert_array_equal(rd.dequantize_packed(p["head" + llama.ROWS_SUFFIX], m.cfg.vocab_size),
                                  np.asarray(m.params["embed"]).T)
    prompts = [[5, 6, 7, 8] * 3, [9, 10, 11] * 4]
    want = [r.tokens for r in Generator(m.cfg, m.params, batch_buckets=(2,)).generate(prompts, max_new_tokens=10)]
    got = [r.tokens for r in Generator(m.cfg, p, batch_buckets=(2,), fwd=fwd).generate(prompts, max_new_tokens=10)]
    assert got == want
    spec = registry.build_spec_generator(m, "prompt_lookup", k=4, k_buckets=(0, 4), fwd=fwd)
    assert spec.params is p
    assert [r.tokens for r in spec.generate(prompts, max_new_tokens=10, num_spec_tokens=4)] == want
    # the layers as one loop over the kernel's stacks (scan_layers): the same params, the same tokens
    scan = dataclasses.replace(fwd, scan_layers=True)
    assert m.params_for(scan) is p
    spec = registry.build_spec_generator(m, "prompt_lookup", k=4, k_buckets=(0, 4), fwd=scan)
    assert [r.tokens for r in spec.generate(prompts, max_new_tokens=10, num_spec_tokens=4)] == want
    # compiled lazily (a launch script's first answer), steps run first as those scanned twins
    # while the steps themselves compile behind them: the same tokens, then the steps' own programs
    # (not on disk: with a step there, a caller loads it instead)
    from specjax.engine import exe_cache
    from specjax.engine.table import STAND_IN_UNROLL

    monkeypatch.setattr(exe_cache, "default", lambda: None)
    spec = registry.build_spec_generator(m, "prompt_lookup", k=4, k_buckets=(0, 4), fwd=fwd)
    registry.warm_spec(spec, [registry.spec_shapes(spec, 12, 10, batch=2)], 4, lazy=True)
    assert [r.tokens for r in spec.generate(prompts, max_new_tokens=10, num_spec_tokens=4)] == want
    table = next(iter(spec._backends.values())).table
    table.wait_behind()
    spec.stop_later()  # (the warm-up's background thread too: it builds a step right after its stand-in)
    twins = [k for k in table._exe if getattr(k, "fwd", None) == dataclasses.replace(fwd, scan_layers=STAND_IN_UNROLL)]
    assert twins and all(table.stand_in(dataclasses.replace(k, fwd=fwd)) == k for k in twins)
    assert all(dataclasses.replace(k, fwd=fwd) in table._exe for k in twins)
    # int8 activations: another model (its own reference), every decode / verify block and prefill
    # chunk on the kernel whatever its rows (rows_kernel 2 here: the 2 x 5-row verify blocks too),
    # prefill with XLA's attention
    from specjax.reference_ar import reference_generate

    i8 = ForwardOptions(rows_kernel=2, rows_activations="int8", attention="cpu")
    assert i8.kernel_rows(10_000) and i8.for_prefill().rows_activations == "int8" and i8.for_prefill().attention == "xla"
    p8 = m.params_for(i8)  # the codes in pairs
    assert rd.paired(p8["head" + llama.ROWS_SUFFIX]) and rd.paired(p8[llama.LAYER_PACKS]["wqkv"])
    ar8 = [r.tokens for r in Generator(m.cfg, p8, batch_buckets=(2,), fwd=i8).generate(prompts, max_new_tokens=10)]
    assert ar8 == [r.tokens for r in reference_generate(m.cfg, p8, prompts, max_new_tokens=10, fwd=i8)]
    spec8 = registry.build_spec_generator(m, "prompt_lookup", k=4, k_buckets=(0, 4), fwd=i8)
    assert [r.tokens for r in spec8.generate(prompts, max_new_tokens=10, num_spec_tokens=4)] == ar8
    spec8 = registry.build_spec_generator(m, "prompt_lookup", k=4, k_buckets=(0, 4),
                                          fwd=dataclasses.replace(i8, scan_layers=True))
    assert [r.tokens for r in spec8.generate(prompts, max_new_tokens=10, num_spec_tokens=4)] == ar8
    with pytest.raises(SpecjaxError, match="rows_activations int8 needs the CPU rows kernel"):
        ForwardOptions(rows_activations="int8", attention="cpu")
    with pytest.raises(SpecjaxError, match="rows_activations bfloat16 needs attention 'cpu'"):
        ForwardOptions(rows_kernel=32, rows_activations="bfloat16")
    with pytest.raises(SpecjaxError, match="rows_activations must be one of"):
        ForwardOptions(rows_kernel=32, rows_activations="fp8", attention="cpu")
    # a prefill chunk's int8 forward: the float32 model's logits within int8 rounding (a prompt
    # of 12 tokens in one chunk against XLA's float32 forward; relative error of the logits)
    toks = jnp.asarray(np.arange(3, 15)[None] % m.cfg.vocab_size, jnp.int32)
    pos = jnp.arange(12, dtype=jnp.int32)[None]
    got = [llama.forward(pp, toks, pos, llama.init_cache_for(m.cfg, 1, 16), llama.causal_mask(1, 12), cfg=m.cfg,
                         use_prefix=False, fwd=f)[0] for pp, f in ((p8, i8.for_prefill()), (m.params, ForwardOptions()))]
    a, b = np.asarray(got[0]), np.asarray(got[1])
    assert 0 < np.linalg.norm(a - b) / np.linalg.norm(b) < 0.05  # (the int8 model, not the float32 one)


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


def test_a_layer_skip_draft_runs_on_the_engines_rows_kernel(tmp_path):
    """On a rows-kernel engine the layer-skip draft's forward reads the target's quantized packs
    in place (the kernel's Q4_1 calls, no float32 weight in its draft steps), a quantized draft
    model its own packs, and speculation stays lossless; on a plain engine the draft keeps XLA's
    dot and no packs."""
    from specjax import registry
    from specjax.generate import Generator
    from specjax.models import llama
    from specjax.spec_generate import SpecStats

    m = _q4_1_gguf_model(tmp_path)
    fwd = ForwardOptions(rows_kernel=32)
    prompts = [[5, 6, 7, 8] * 3, [9, 10, 11] * 4]
    want = [r.tokens for r in Generator(m.cfg, m.params, batch_buckets=(2,)).generate(prompts, max_new_tokens=10)]
    gen = registry.build_spec_generator(m, "layer_skip", k=4, k_buckets=(0, 4), fwd=fwd, draft_layers=1)
    d = gen.drafter
    assert d.draft.fwd == fwd and d.params[llama.LAYER_PACKS] is m.params_for(fwd)[llama.LAYER_PACKS]
    dc = d.draft.init_cache(2, 32, jnp.float32)
    step = jax.make_jaxpr(lambda p, c, t: d.draft._next(p, c, t))(d.params, dc, jnp.zeros((2,), jnp.int32))
    assert "specjax_rows_q4_1" in str(step)
    stats = SpecStats()
    got = gen.generate(prompts, max_new_tokens=10, num_spec_tokens=4, stats=stats)
    assert [r.tokens for r in got] == want and stats.drafted > 0
    # a draft model whose own file keeps quantized blocks (here the target drafting for itself) too
    gen = registry.build_spec_generator(m, "draft_model", k=4, k_buckets=(0, 4), fwd=fwd, draft=m)
    assert gen.drafter.draft.fwd == fwd and gen.drafter.params is m.params_for(fwd)
    assert [r.tokens for r in gen.generate(prompts, max_new_tokens=10, num_spec_tokens=4)] == want
    plain = registry.build_spec_generator(m, "layer_skip", k=4, k_buckets=(0, 4), draft_layers=1).drafter
    assert plain.draft.fwd == ForwardOptions() and llama.LAYER_PACKS not in plain.params
    with pytest.raises(SpecjaxError, match="packed params"):
        from specjax.drafters.device import layer_skip

        layer_skip(m.cfg, m.params, 1, fwd)


def test_a_stand_in_forward_gives_a_feature_heads_inputs_bit_for_bit(tiny):
    """A lazily compiled job's first steps run as stand-ins (the layers as one loop over the rows
    kernel's stacks, StepTable.stand_in): the logits, the cache and the layer inputs a feature head
    drafts from are the unrolled forward's bit for bit, so a head drafts the same in those steps."""
    from functools import partial

    from specjax import cache as kv
    from specjax.drafters import eagle
    from specjax.engine.table import STAND_IN_UNROLL
    from specjax.models import llama

    cfg, params = tiny
    draft, _ = eagle.init_params(cfg, params)
    p = llama.pack_for_rows(params, cfg)
    rng = np.random.default_rng(0)
    c = kv.init_cache(cfg.num_layers, 2, 64, cfg.num_kv_heads, cfg.head_dim)
    toks = jnp.asarray(rng.integers(1, cfg.vocab_size, (2, 20)), jnp.int32)
    fwd = ForwardOptions(rows_kernel=32)
    _, c = llama.forward(p, toks, jnp.broadcast_to(jnp.arange(20), (2, 20)), c, llama.causal_mask(2, 20), cfg=cfg,
                         fwd=fwd)[:2]
    c = kv.advance(c, jnp.full((2,), 20, jnp.int32))
    for T in (1, 3):  # a decode step's block and a verify block
        blk = jnp.asarray(rng.integers(1, cfg.vocab_size, (2, T)), jnp.int32)
        pos = c.lengths[:, None] + jnp.arange(T)[None]
        unrolled, stand_in = (jax.jit(partial(llama.forward, cfg=cfg, fwd=dataclasses.replace(fwd, scan_layers=s),
                                              features=draft.features))(p, blk, pos, c, llama.causal_mask(2, T))
                              for s in (0, STAND_IN_UNROLL))
        for x, y in zip(jax.tree_util.tree_leaves(unrolled), jax.tree_util.tree_leaves(stand_in), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_rows_kernel_without_a_compiler_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(rd, "_loaded", {})
    monkeypatch.setattr(rd, "_compiler", lambda: None)
    with pytest.raises(SpecjaxError, match="needs a C[+][+] compiler"):
        rd.ensure()
    assert not rd.available() and not rd.buildable()
    from specjax.engine import exe_cache

    # A program calling the kernel, traced inside rows_dot.deferred (a cold build runs beside),
    # registers it before it is compiled or loaded from disk (the engine's table does this).
    fn = jax.jit(lambda x: rd.rows_dot(x, rd.pack(jnp.ones((32, 16))), 16))
    with rd.deferred():
        fn.lower(jnp.ones((1, 32)))  # traced and lowered with no kernel built
    with pytest.raises(SpecjaxError, match="needs a C[+][+] compiler"):
        exe_cache.compile_cached(None, "k", fn, (jnp.ones((1, 32)),), ready=rd.ensure, lowering=rd.deferred)
    # ... and one that does not call it (a prefill chunk on XLA's dot) compiles without it
    plain = exe_cache.compile_cached(None, "p", jax.jit(lambda x: x * 2), (jnp.ones(3),), ready=rd.ensure,
                                     lowering=rd.deferred)
    assert np.asarray(plain(jnp.ones(3))).tolist() == [2.0] * 3


_FORWARDERS = """
import numpy as np, jax, jax.numpy as jnp
from specjax.engine import exe_cache
from specjax.models.cpu import rows_dot as rd
rng = np.random.default_rng(0)
w, x = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((64, 24), (3, 64)))
wp = rd.pack(w)
fn = jax.jit(lambda x, wp: rd.rows_dot(x, wp, 24))
with rd.deferred():
    low = fn.lower(x, wp)
rd.ensure_targets()
exe = low.compile()  # compiled against the forwarders: the kernel is not loaded in this process
assert "ok" not in rd._loaded
try:
    exe(x, wp).block_until_ready()
    raise SystemExit("ran before the kernel was loaded")
except jax.errors.JaxRuntimeError as e:
    assert "before it was loaded" in str(e), e
rd.ensure()
np.testing.assert_array_equal(np.asarray(exe(x, wp)), np.asarray(fn(x, wp)))
np.testing.assert_allclose(np.asarray(exe(x, wp)), np.asarray(x) @ np.asarray(w), rtol=1e-5, atol=1e-4)
# the engine's path: register before compiling, the kernel loaded before the program is returned
ran = []
got = exe_cache.compile_cached(None, "k", fn, (x, wp), ready=lambda: ran.append("ready") or rd.ensure(),
                               register=lambda: ran.append("register") or rd.ensure_targets(), lowering=rd.deferred)
assert ran == ["register", "ready"], ran
np.testing.assert_array_equal(np.asarray(got(x, wp)), np.asarray(exe(x, wp)))
print("ok")
"""


def test_a_program_compiles_against_the_forwarders_and_runs_once_the_kernel_is_loaded():
    """XLA sees the kernel's forwarders (rows_dot_stub.cc) under its target names, so a program
    calling it compiles while the kernel builds; run before ``ensure`` it fails with an FFI error
    (never a wrong result), after it computes what the kernel does. A fresh process: this one
    has loaded the kernel long ago."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", _FORWARDERS], capture_output=True, text=True, cwd=root,
                       env={**os.environ, "PYTHONPATH": root})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


def test_cpu_block_attention_matches_xla_and_a_token_gets_the_same_bits_in_a_decode_step():
    """attention 'cpu' (rows_dot.block_attention): XLA's attention within float32 rounding, chain
    and tree masks, GQA; and a block's last token gives the same bits when its earlier tokens are
    in the cache instead (what int8 activations need: their rounding amplifies any last-bit
    difference)."""
    from specjax.models import attention as at

    rng = np.random.default_rng(2)
    L, B, Hkv, S, hd, H, T = 2, 2, 3, 32, 64, 9, 4
    r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    q, kb, vb, ka, va = r(B, T, H, hd), r(B, T, Hkv, hd), r(B, T, Hkv, hd), r(L, B, Hkv, S, hd), r(L, B, Hkv, S, hd)
    tree = jnp.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], bool)  # node 3's path: 0, 2, 3
    # (prefix keys are scored 8 at a time for all of a block's rows, the rest one at a time: at
    # 14 + 2 the decode step scores keys 8-15 in the 8-key loop, the block one at a time)
    for lens in (jnp.array([5, 20], jnp.int32), jnp.array([6, 14], jnp.int32)):
        for mask in (jnp.tril(jnp.ones((T, T), bool)), tree):
            mask = jnp.broadcast_to(mask, (B, T, T))
            got = rd.block_attention(q, kb, vb, ka, va, 1, lens, mask)
            np.testing.assert_allclose(np.asarray(got), np.asarray(at.block_attention_xla(q, kb, vb, ka[1], va[1], lens, mask)),
                                       rtol=1e-5, atol=1e-5)
        blk = rd.block_attention(q, kb, vb, ka, va, 0, lens, jnp.broadcast_to(tree, (B, T, T)))
        kc, vc = ka, va
        for b in range(B):  # node 3 decoded alone after nodes 0 and 2 were committed
            for i, j in enumerate((0, 2)):
                kc = kc.at[0, b, :, int(lens[b]) + i].set(kb[b, j])
                vc = vc.at[0, b, :, int(lens[b]) + i].set(vb[b, j])
        one = rd.block_attention(q[:, 3:], kb[:, 3:], vb[:, 3:], kc, vc, 0, lens + 2, jnp.ones((B, 1, 1), bool))
        np.testing.assert_array_equal(np.asarray(one[:, 0]), np.asarray(blk[:, 3]))


@pytest.mark.parametrize("shape", [(8, 2, 128, 3), (4, 4, 64, 7), (6, 1, 32, 2)], ids=["hd128-gqa4", "mha-7rows", "hd32-mqa"])
def test_cpu_block_attention_other_head_shapes(shape):
    """The CPU attention's tasks group a KV head's (token, query head) rows in blocks of up to 6:
    other head sizes (a 7B model's 128; 32, off the 64-wide register path), no grouping (MHA)
    and one KV head for 6 query heads, with blocks of one and of several tasks, match XLA's
    attention, and a chain's last token gives the same bits decoded alone."""
    from specjax.models import attention as at

    H, Hkv, hd, T = shape
    rng = np.random.default_rng(5)
    B, S = 2, 40
    r = lambda *sh: jnp.asarray(rng.standard_normal(sh), jnp.float32)  # noqa: E731
    q, kb, vb, ka, va = r(B, T, H, hd), r(B, T, Hkv, hd), r(B, T, Hkv, hd), r(1, B, Hkv, S, hd), r(1, B, Hkv, S, hd)
    lens, mask = jnp.array([9, 24], jnp.int32), jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    got = rd.block_attention(q, kb, vb, ka, va, 0, lens, mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(at.block_attention_xla(q, kb, vb, ka[0], va[0], lens, mask)),
                               rtol=1e-5, atol=1e-5)
    kc, vc = ka, va
    for b in range(B):  # the chain's first T - 1 tokens committed, the last decoded alone
        for i in range(T - 1):
            kc = kc.at[0, b, :, int(lens[b]) + i].set(kb[b, i])
            vc = vc.at[0, b, :, int(lens[b]) + i].set(vb[b, i])
    one = rd.block_attention(q[:, -1:], kb[:, -1:], vb[:, -1:], kc, vc, 0, lens + T - 1, jnp.ones((B, 1, 1), bool))
    np.testing.assert_array_equal(np.asarray(one[:, 0]), np.asarray(got[:, -1]))


def _wide_heads_gguf(tmp_path):
    """A two-layer GGUF model with Q4_1 projections, a Q8_0 tied embedding and SmolLM2's head size
    (RoPE tables 32 wide per position, where XLA:CPU's own cos and sin vectorise differently for
    one-token and several-token blocks), hidden size and heads (576 wide: XLA:CPU's own row sums
    add a norm's squares in another order in a block of 8 or more tokens), loaded. The embedding is
    scaled down so that the layers, not a token's own tied embedding, choose the next token (at
    576 wide greedy decoding otherwise repeats one token)."""
    from gguf import GGMLQuantizationType as Q
    from tiny_gguf import _gguf_cfg, tiny_bpe_vocab, write_tiny_gguf

    from specjax.models import llama
    from specjax.models.loader import load_model

    tokens, merges, types = tiny_bpe_vocab()
    cfg = _gguf_cfg("llama_tied", len(tokens)).replace(hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
                                                       num_layers=2)
    path = tmp_path / "q.gguf"
    params = llama.init_random_params(cfg, seed=7)
    params["embed"] = params["embed"] * 0.03
    write_tiny_gguf(path, cfg, params, tokens, merges, types, proj_type=Q.Q4_1, embed_type=Q.Q8_0)
    return load_model(str(path))


def test_a_token_gets_the_same_logits_bits_in_one_token_steps_as_in_a_verify_block(tmp_path):
    """With the rows kernel and the CPU attention, float32 or int8 activations, the whole model
    computes each token's logits with the same bits in a verify block, a chain of 9 or a token
    tree of 12 (ancestor mask, positions by depth), as in one-token steps along the token's path.
    That is what makes speculation token-identical to plain decoding even where int8 rounding
    would turn a last-bit difference into another code. It took RoPE's cos and sin gathered
    independently of the block's shape (llama.rope_tables) and the RMS norms' sums in one fixed
    order (llama.rms_norm: XLA's reduce adds a 576-wide row in another order in a block of 8 or
    more tokens). XLA's attention (prefix and block summed apart) stays within float32 rounding."""
    from specjax import cache as kv
    from specjax import tree
    from specjax.models import llama

    m = _wide_heads_gguf(tmp_path)
    rng = np.random.default_rng(7)
    P = 45
    blocks = {"chain": tree.chain_parents(9), "tree": np.array([-1, 0, 1, 2, 0, 4, 5, 1, 7, 4, 9, 10])}
    prompt, toks = (jnp.asarray(rng.integers(3, m.cfg.vocab_size, (1, n)), jnp.int32) for n in (P, 12))

    def run(params, toks, pos, mask, cache, fwd, use_prefix=True):
        return llama.forward(params, toks, pos, cache, mask, cfg=m.cfg, fwd=fwd, use_prefix=use_prefix)[:2]

    run = jax.jit(run, static_argnames=("fwd", "use_prefix"))
    for fwd in (ForwardOptions(rows_kernel=32, attention="cpu"),
                ForwardOptions(rows_kernel=32, attention="cpu", rows_activations="int8"),
                ForwardOptions(rows_kernel=32, attention="cpu", rows_activations="bfloat16"), ForwardOptions(rows_kernel=32)):
        p = m.params_for(fwd)
        _, cache = run(p, prompt, jnp.arange(P)[None], llama.causal_mask(1, P), llama.init_cache_for(m.cfg, 1, 64),
                       fwd.for_prefill(), use_prefix=False)
        cache = kv.set_lengths(cache, jnp.asarray([P], jnp.int32))
        for kind, parents in blocks.items():
            n = parents.size
            block, _ = run(p, toks[:, :n], jnp.asarray(P + tree.depths(parents))[None],
                           jnp.asarray(tree.ancestor_mask(parents))[None], cache, fwd)
            for path in tree.root_to_leaf_paths(parents):
                c, steps = cache, []
                for d, node in enumerate(path):
                    lg, c = run(p, toks[:, node:node + 1], jnp.asarray([[P + d]]), jnp.ones((1, 1, 1), bool), c, fwd)
                    c = kv.set_lengths(c, c.lengths + 1)
                    steps.append(np.asarray(lg[0, 0]))
                got, want = np.stack(steps), np.asarray(block[0, path])
                if fwd.attention == "cpu":
                    np.testing.assert_array_equal(got, want, err_msg=f"{kind} path {path}, {fwd}")
                else:
                    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_rope_tables_are_the_exact_angles_and_gathered_the_same_in_any_shape():
    """llama.rope_tables: within two float32 roundings of cos and sin of position x inverse
    frequency computed in float64, the same values for a position in any block, the padding
    positions (negative, or past max_position) finite."""
    from specjax.config import get_model_config
    from specjax.models import llama

    cfg = get_model_config("smollm2-135m")
    inv = llama.rope_inv_freq(cfg).astype(np.float64)
    pos = np.array([[0, 1, 63, 64, 65, 4095, 8191, 8192 + 100, -1]], np.int32)
    c, s = (np.asarray(t)[0, :, 0] for t in jax.jit(lambda p: llama.rope_tables(p, cfg))(jnp.asarray(pos)))
    ang = pos[0, :7, None].astype(np.float64) * inv
    np.testing.assert_allclose(c[:7], np.cos(ang), rtol=0, atol=3e-7)
    np.testing.assert_allclose(s[:7], np.sin(ang), rtol=0, atol=3e-7)
    assert np.isfinite(c).all() and np.isfinite(s).all()
    for p in (pos[:, 3:4], pos[:, 2:6]):  # the same bits alone or in another block
        c2, _ = jax.jit(lambda p: llama.rope_tables(p, cfg, barrier=True))(jnp.asarray(p))
        np.testing.assert_array_equal(np.asarray(c2)[0, :, 0], c[np.searchsorted(pos[0, :7], p[0])])


@pytest.mark.parametrize("drafter", ["prompt_lookup", "suffix trees"])
def test_int8_speculation_mixing_decode_calls_and_verify_steps_gives_plain_decodings_tokens(tmp_path, drafter):
    """int8 activations with a drafter: a policy alternating verify steps (K = 8: chains of 9
    tokens from prompt lookup, or token trees of up to 9 nodes from SuffixDecoding) with runs of
    plain decoding calls (K = 0, up to 4 steps a call) gives exactly int8 plain decoding's
    tokens. Before RoPE's tables were shape-independent it did not (a last-bit difference
    between the two programs became another int8 code): int8 was then refused with a drafter;
    and with token trees until the RMS norms summed in a fixed order (blocks of 8 or more tokens
    differed; test above)."""
    from specjax.drafters.prompt_lookup import PromptLookupDrafter
    from specjax.drafters.suffix import SuffixConfig, SuffixDrafter
    from specjax.engine.jax_backend import JaxBackend
    from specjax.engine.loop import ServingEngine
    from specjax.engine.scheduler import Request
    from specjax.generate import Generator
    from specjax.goodput.selector import Policy

    class Alternate(Policy):
        name, call_steps = "alternate", 4

        def __init__(self):
            self.i = 0

        def choose(self, view):
            self.i += 1
            return 8 if self.i % 2 else 0

    m = _wide_heads_gguf(tmp_path)
    i8 = ForwardOptions(rows_kernel=32, rows_activations="int8", attention="cpu")
    p8 = m.params_for(i8)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, m.cfg.vocab_size, 9).tolist() * 4 for _ in range(3)]
    new = 40
    ar = [r.tokens for r in Generator(m.cfg, p8, batch_buckets=(4,), fwd=i8).generate(prompts, max_new_tokens=new)]
    # (suffix: the outputs seen before, and their beginnings ending in another token, each thrice,
    # so that trees branch: the wrong token and the right continuation)
    seen = ar + [o[:j] + [o[j] + 1] for o in ar for j in range(4, new, 4) for _ in range(3)]
    host = PromptLookupDrafter() if drafter == "prompt_lookup" else SuffixDrafter(
        SuffixConfig(min_prob=0.01, use_local=False), history=seen)
    be = JaxBackend(m.cfg, p8, k_buckets=(0, 8), batch_buckets=(4,), slots=256, fwd=i8, drafter=host)
    eng = ServingEngine(be, Alternate())
    outs = eng.run([Request(str(i), p, new) for i, p in enumerate(prompts)])
    assert [o.tokens for o in outs] == ar
    assert sum(o.drafted for o in outs) > 0 and eng.counts.accepted > 0  # verify blocks ran and accepted drafts
