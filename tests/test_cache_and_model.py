"""KV cache + Llama forward consistency on the tiny random model (fp32).

The invariant behind everything speculative: running tokens one at a time
through the cache, in blocks (chain or tree mask), after rolled-back scratch
writes, or all at once without a cache must give the same logits. A plain
numpy implementation of the Llama forward (written independently here) anchors
the whole-sequence forward itself.

Jit compiles dominate the runtime, so the jitted helpers below are shared and
the shapes are few: exact T in {1, 5, 17} for the parametrized full forward,
one padded reference length REF_T, one block size (4), batch sizes 1 and 3.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import cache as kv
from specjax.config import RopeScaling, get_model_config
from specjax.errors import SpecjaxError
from specjax.generate import Generator, validate_request
from specjax.verify import verify_chain
from specjax.reference_ar import reference_generate
from specjax.models import llama
from specjax.sampling import SamplingArrays, SamplingParams, sample

CFG = get_model_config("tiny-random")
PARAMS = llama.init_random_params(CFG, seed=0)
V = CFG.vocab_size
SLOTS = 32  # cache slots for every hand-driven cache below
REF_T = 32  # padded length of the "full forward" reference (causality makes padding harmless)
BLOCK = 4
TOL = dict(rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- shared jitted helpers


@partial(jax.jit, static_argnames=("cfg", "use_prefix"))
def _fwd(params, tokens, positions, cache, mask, *, cfg, use_prefix):
    return llama.forward(params, tokens, positions, cache, mask, cfg=cfg, use_prefix=use_prefix)


@partial(jax.jit, static_argnames=("cfg",))
def _step(params, cache, tok, active, *, cfg):
    """One token per row at position = row length; rows advance by `active` (0 or 1)."""
    B = tok.shape[0]
    logits, cache = llama.forward(params, tok[:, None], cache.lengths[:, None], cache, llama.causal_mask(B, 1),
                                  cfg=cfg)
    return logits[:, 0], kv.advance(cache, active.astype(jnp.int32))


def full_logits(params, cfg, ids, pad_to=None):
    """Whole-sequence forward: fresh cache, causal mask, use_prefix=False. [T, V] numpy."""
    T = len(ids)
    Tp = pad_to or T
    assert Tp >= T
    toks = np.zeros((1, Tp), np.int32)
    toks[0, :T] = ids
    toks[0, T:] = 3  # arbitrary padding; causality means it cannot affect the first T positions
    cache = llama.init_cache_for(cfg, 1, max(SLOTS, Tp))
    pos = jnp.arange(Tp, dtype=jnp.int32)[None]
    logits, _ = _fwd(params, jnp.asarray(toks), pos, cache, llama.causal_mask(1, Tp), cfg=cfg, use_prefix=False)
    return np.asarray(logits)[0, :T]


def ref_logits(params, cfg, ids):
    return full_logits(params, cfg, ids, pad_to=REF_T)


def decode_rows(params, cfg, rows, cache=None, garbage_tok=7):
    """Feed each row's tokens one at a time (batched; a row that has run out is
    inactive: it still writes a garbage token to scratch but advances by 0).
    Returns (list of [len(row), V] logits, final cache)."""
    B = len(rows)
    if cache is None:
        cache = llama.init_cache_for(cfg, B, SLOTS)
    out = [np.zeros((len(r), cfg.vocab_size), np.float32) for r in rows]
    for t in range(max(len(r) for r in rows)):
        active = np.array([t < len(r) for r in rows])
        tok = np.array([r[t] if t < len(r) else garbage_tok for r in rows], np.int32)
        logits, cache = _step(params, cache, jnp.asarray(tok), jnp.asarray(active), cfg=cfg)
        logits = np.asarray(logits)
        for b in range(B):
            if active[b]:
                out[b][t] = logits[b]
    return out, cache


def prefill(params, cfg, ids):
    """Prefill a batch-1 cache with `ids` in one forward (use_prefix=False), then commit."""
    T = len(ids)
    cache = llama.init_cache_for(cfg, 1, SLOTS)
    logits, cache = _fwd(params, jnp.asarray([ids], jnp.int32), jnp.arange(T, dtype=jnp.int32)[None], cache,
                         llama.causal_mask(1, T), cfg=cfg, use_prefix=False)
    return np.asarray(logits)[0], kv.set_lengths(cache, jnp.asarray([T]))


def block_forward(params, cfg, cache, toks, positions, mask):
    """One block of BLOCK tokens for a batch-1 cache with prefix (shared compile)."""
    logits, cache = _fwd(params, jnp.asarray([toks], jnp.int32), jnp.asarray([positions], jnp.int32), cache,
                         jnp.asarray(mask)[None], cfg=cfg, use_prefix=True)
    return np.asarray(logits)[0], cache


def rand_ids(n, seed):
    return np.random.default_rng(seed).integers(0, V, size=n).tolist()


# ---------------------------------------------------------------- independent numpy reference


def np_llama3_inv_freq(head_dim, theta, s: RopeScaling | None):
    """Llama-3 RoPE scaling written the way Meta's reference `apply_scaling` does (a loop)."""
    freqs = [1.0 / theta ** (2 * i / head_dim) for i in range(head_dim // 2)]
    if s is None:
        return np.array(freqs)
    low_wl = s.original_max_position / s.low_freq_factor
    high_wl = s.original_max_position / s.high_freq_factor
    out = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(f)
        elif wl > low_wl:
            out.append(f / s.factor)
        else:
            smooth = (s.original_max_position / wl - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
            out.append((1 - smooth) * f / s.factor + smooth * f)
    return np.array(out)


def np_forward(params, cfg, ids):
    """Plain float64 numpy Llama forward over a whole sequence (HF conventions). [T, V]."""
    P = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    T, H, Hkv, hd = len(ids), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    G = H // Hkv
    inv = np_llama3_inv_freq(hd, cfg.rope_theta, cfg.rope_scaling)
    ang = np.arange(T)[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(a):  # [T, n, hd], rotate-half
        a1, a2 = a[..., : hd // 2], a[..., hd // 2:]
        return np.concatenate([a1 * cos - a2 * sin, a2 * cos + a1 * sin], axis=-1)

    def rms(a, w):
        return a / np.sqrt(np.mean(a * a, axis=-1, keepdims=True) + cfg.rms_eps) * w

    x = P["embed"][np.asarray(ids)]
    causal = np.tril(np.ones((T, T), bool))
    for lp in P["layers"]:
        h = rms(x, lp["attn_norm"])
        q, k, v = h @ lp["wq"], h @ lp["wk"], h @ lp["wv"]
        if cfg.qkv_bias:
            q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
        q = rope(q.reshape(T, H, hd))
        k = np.repeat(rope(k.reshape(T, Hkv, hd)), G, axis=1)  # HF repeat_kv: q head h uses kv head h // G
        v = np.repeat(v.reshape(T, Hkv, hd), G, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
        s = np.where(causal[None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", p, v).reshape(T, H * hd)
        x = x + o @ lp["wo"]
        h = rms(x, lp["mlp_norm"])
        g = h @ lp["w_gate"]
        x = x + (g / (1 + np.exp(-g)) * (h @ lp["w_up"])) @ lp["w_down"]
    x = rms(x, P["final_norm"])
    head = P["embed"].T if cfg.tie_embeddings else P["lm_head"]
    return x @ head


def assert_close_ref(jax_logits, ref, what):
    scale = max(1.0, float(np.abs(ref).max()))
    err = float(np.abs(jax_logits - ref).max())
    assert err < 1e-4 * scale, f"{what}: max abs error {err} vs numpy reference (logit scale {scale})"


# ---------------------------------------------------------------- full forward vs token-by-token


@pytest.mark.parametrize("n", [1, 5, 17])
def test_full_forward_matches_token_by_token(n):
    ids = rand_ids(n, seed=n)
    full = full_logits(PARAMS, CFG, ids)
    assert full.shape == (n, V)
    assert_close_ref(full, np_forward(PARAMS, CFG, ids), f"full forward n={n}")
    (step,), cache = decode_rows(PARAMS, CFG, [ids])
    np.testing.assert_allclose(step, full, **TOL)
    assert np.asarray(cache.lengths).tolist() == [n]
    # Padding the whole-sequence forward does not change the first n logits (causality).
    np.testing.assert_allclose(ref_logits(PARAMS, CFG, ids), full, **TOL)


def test_mixed_length_batch_token_by_token():
    lens = [5, 1, 17]
    rows = [rand_ids(n, seed=100 + n) for n in lens]
    out, cache = decode_rows(PARAMS, CFG, rows)
    # Inactive rows advanced by 0: each row's committed length is its own.
    assert np.asarray(cache.lengths).tolist() == lens
    for b, ids in enumerate(rows):
        np.testing.assert_allclose(out[b], full_logits(PARAMS, CFG, ids), **TOL, err_msg=f"row {b}")
    # Rows kept writing garbage into their scratch slot while inactive; one more
    # step for every row must still see only the committed prefix.
    nxt = [11, 22, 33]
    logits, cache = _step(PARAMS, cache, jnp.asarray(nxt, jnp.int32), jnp.ones(3, bool), cfg=CFG)
    assert np.asarray(cache.lengths).tolist() == [n + 1 for n in lens]
    for b, ids in enumerate(rows):
        np.testing.assert_allclose(np.asarray(logits)[b], ref_logits(PARAMS, CFG, ids + [nxt[b]])[-1], **TOL,
                                   err_msg=f"row {b} after inactivity")


def test_inactive_row_garbage_does_not_leak():
    """The same mixed batch with a different garbage token gives identical logits."""
    rows = [rand_ids(3, seed=1), rand_ids(9, seed=2), rand_ids(6, seed=3)]
    a, ca = decode_rows(PARAMS, CFG, rows, garbage_tok=7)
    b, cb = decode_rows(PARAMS, CFG, rows, garbage_tok=200)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(np.asarray(ca.lengths), np.asarray(cb.lengths))


# ---------------------------------------------------------------- blocks, rollback, trees


def _chain_logits_after(cache, toks):
    """Feed toks one at a time into a batch-1 cache; returns [len, V] and the cache."""
    (out,), cache = decode_rows(PARAMS, CFG, [toks], cache=cache)
    return out, cache


def test_prefix_plus_causal_block_matches_one_at_a_time():
    n = 17
    prompt = rand_ids(n, seed=5)
    blk = rand_ids(BLOCK, seed=6)
    pre_logits, cache = prefill(PARAMS, CFG, prompt)
    np.testing.assert_allclose(pre_logits, full_logits(PARAMS, CFG, prompt), **TOL)
    blk_logits, cache_blk = block_forward(PARAMS, CFG, cache, blk, list(range(n, n + BLOCK)),
                                          np.tril(np.ones((BLOCK, BLOCK), bool)))
    # The forward writes the block to scratch but does not commit it.
    assert np.asarray(cache_blk.lengths).tolist() == [n]
    one, _ = _chain_logits_after(cache, blk)
    np.testing.assert_allclose(blk_logits, one, **TOL)
    np.testing.assert_allclose(blk_logits, ref_logits(PARAMS, CFG, prompt + blk)[n:], **TOL)
    # After committing the block, decoding continues as if it had been fed one by one.
    nxt, _ = _chain_logits_after(kv.advance(cache_blk, jnp.asarray([BLOCK])), [42])
    np.testing.assert_allclose(nxt[0], ref_logits(PARAMS, CFG, prompt + blk + [42])[-1], **TOL)


def test_rollback_is_not_advancing():
    n = 5
    prompt = rand_ids(n, seed=7)
    blk_a = rand_ids(BLOCK, seed=8)
    blk_b = rand_ids(BLOCK, seed=9)
    assert blk_a != blk_b
    causal = np.tril(np.ones((BLOCK, BLOCK), bool))
    pos = list(range(n, n + BLOCK))
    follow = [1, 2, 3]
    _, cache = prefill(PARAMS, CFG, prompt)

    # Never wrote A.
    clean_b, c_clean = block_forward(PARAMS, CFG, cache, blk_b, pos, causal)
    clean_next, _ = _chain_logits_after(kv.advance(c_clean, jnp.asarray([BLOCK])), follow)

    # Wrote A (rejected: not advanced), then B over it.
    _, c_a = block_forward(PARAMS, CFG, cache, blk_a, pos, causal)
    assert np.asarray(c_a.lengths).tolist() == [n]
    assert not np.array_equal(np.asarray(c_a.k), np.asarray(cache.k)), "block A was not written to scratch"
    rb_b, c_rb = block_forward(PARAMS, CFG, c_a, blk_b, pos, causal)
    rb_next, _ = _chain_logits_after(kv.advance(c_rb, jnp.asarray([BLOCK])), follow)

    # Masked scratch contributes exact zeros, so results are bit-identical.
    np.testing.assert_array_equal(rb_b, clean_b)
    np.testing.assert_array_equal(rb_next, clean_next)
    np.testing.assert_allclose(rb_next, ref_logits(PARAMS, CFG, prompt + blk_b + follow)[n + BLOCK:], **TOL)


def test_partial_accept_then_continue():
    """Write a block, commit only its first 2 entries, continue: equals the chain."""
    n = 5
    prompt = rand_ids(n, seed=10)
    blk = rand_ids(BLOCK, seed=11)
    _, cache = prefill(PARAMS, CFG, prompt)
    _, c = block_forward(PARAMS, CFG, cache, blk, list(range(n, n + BLOCK)), np.tril(np.ones((BLOCK, BLOCK), bool)))
    c = kv.advance(c, jnp.asarray([2]))
    out, c = _chain_logits_after(c, [99, 98])
    assert np.asarray(c.lengths).tolist() == [n + 4]
    np.testing.assert_allclose(out, ref_logits(PARAMS, CFG, prompt + blk[:2] + [99, 98])[n + 2:], **TOL)


PARENTS = [-1, 0, 0, 1]


def _tree_mask(parents):
    T = len(parents)
    m = np.zeros((T, T), bool)
    depth = []
    for i, p in enumerate(parents):
        j, d = i, 0
        while j != -1:
            m[i, j] = True
            j = parents[j]
            d += 1
        depth.append(d - 1)
    return m, depth


def _path(parents, i):
    out = []
    while i != -1:
        out.append(i)
        i = parents[i]
    return out[::-1]


def test_tree_mask_matches_root_to_node_chains():
    n = 5
    prompt = rand_ids(n, seed=12)
    toks = [17, 40, 41, 90]  # siblings 1 and 2 differ
    mask, depth = _tree_mask(PARENTS)
    assert depth == [0, 1, 1, 2]
    _, cache = prefill(PARAMS, CFG, prompt)
    tree_logits, c_tree = block_forward(PARAMS, CFG, cache, toks, [n + d for d in depth], mask)
    for i in range(len(PARENTS)):
        path = [toks[j] for j in _path(PARENTS, i)]
        chain, _ = _chain_logits_after(cache, path)
        np.testing.assert_allclose(tree_logits[i], chain[-1], **TOL, err_msg=f"node {i} (path {path})")
    # Siblings see different tokens: the mask really isolates branches.
    assert not np.allclose(tree_logits[1], tree_logits[2])

    # Accept path 0 -> 1 -> 3: compact it into contiguous slots, commit, continue.
    acc = _path(PARENTS, 3)
    src = np.array([acc + [0]], np.int32)
    dst = np.array([[0, 1, 2, 3]], np.int32)
    valid = np.array([[True, True, True, False]])
    c = kv.gather_block(c_tree, jnp.asarray(src), jnp.asarray(dst), jnp.asarray(valid))
    c = kv.advance(c, jnp.asarray([len(acc)]))
    out, _ = _chain_logits_after(c, [55])
    seq = prompt + [toks[j] for j in acc] + [55]
    np.testing.assert_allclose(out[0], ref_logits(PARAMS, CFG, seq)[-1], **TOL)


# ---------------------------------------------------------------- config variants


VARIANTS = {
    "qkv_bias": CFG.replace(name="tiny-qwen2", arch="qwen2", qkv_bias=True),
    "tied": CFG.replace(name="tiny-tied", tie_embeddings=True),
    "llama3_rope": CFG.replace(name="tiny-llama3", rope_scaling=RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=64)),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_variants_forward(variant):
    cfg = VARIANTS[variant]
    params = llama.init_random_params(cfg, seed=3)
    if variant == "qkv_bias":
        assert {"bq", "bk", "bv"} <= set(params["layers"][0])
    if variant == "tied":
        assert "lm_head" not in params
    ids = rand_ids(9, seed=13)
    full = ref_logits(params, cfg, ids)
    assert_close_ref(full, np_forward(params, cfg, ids), variant)
    (step,), _ = decode_rows(params, cfg, [ids])
    # (decode and the full forward sum in other orders: float32 rounding at the logits' scale,
    # which a machine's vector width moves; a wrong position or cache entry is off by O(1))
    np.testing.assert_allclose(step, full, rtol=1e-5, atol=4e-6 * float(np.abs(full).max()))
    # The variant must matter: the plain config on the same params gives different
    # logits (tied: there is no lm_head at all, checked above).
    if variant != "tied":
        assert not np.allclose(np_forward(params, CFG, ids), full, atol=1e-3)


# ---------------------------------------------------------------- RoPE


def test_rope_tables_behind_a_conditional_change_nothing():
    """ForwardOptions.rope_once (the tables computed once, behind a conditional XLA:CPU cannot
    fuse into each layer) gives the same logits and cache, bit for bit, as the fused tables."""
    from specjax.models.options import ForwardOptions

    params = llama.init_random_params(CFG, seed=4)
    B, T = 2, 5
    toks = jnp.asarray(np.random.default_rng(4).integers(0, CFG.vocab_size, (B, T)), jnp.int32)
    # (a negative position, which a draft's re-fed padding can carry, must not change the tables)
    pos = jnp.asarray([[-1, 0, 1, 2, 3], [7, 8, 9, 10, 11]], jnp.int32)
    outs = []
    for once in (False, True):
        fwd = ForwardOptions(rope_once=once)
        assert fwd.rope_barrier() is once
        cache = llama.init_cache_for(CFG, B, 32)
        f = jax.jit(partial(llama.forward, cfg=CFG, fwd=fwd))
        outs.append(f(params, toks, pos, cache, llama.causal_mask(B, T)))
    assert "conditional" in jax.jit(partial(llama.forward, cfg=CFG, fwd=ForwardOptions(rope_once=True))).lower(
        params, toks, pos, llama.init_cache_for(CFG, B, 32), llama.causal_mask(B, T)).as_text("hlo")
    for a, b in zip(jax.tree_util.tree_leaves(outs[0]), jax.tree_util.tree_leaves(outs[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert ForwardOptions().rope_barrier() is (jax.default_backend() == "cpu")


def test_scanned_layer_stack_equals_the_layer_list():
    """ForwardOptions.scan_layers (one lax.scan over llama.stack_layers' [L, ...] weights, the cache
    written at the loop counter's layer) gives the list forward's logits and cache bit for bit,
    also for the first n layers (num_layers); the wrong params form is refused."""
    from specjax.models.options import ForwardOptions

    params = llama.init_random_params(CFG, seed=5)
    stacked = llama.stack_layers(params)
    assert llama.stack_layers(stacked) is stacked and stacked["layers"]["wq"].shape[0] == CFG.num_layers
    B, T = 2, 4
    toks = jnp.asarray(np.random.default_rng(5).integers(0, CFG.vocab_size, (B, T)), jnp.int32)
    for n in (None, 2):
        L = n or CFG.num_layers
        cache = llama.init_cache_for(CFG, B, 32, num_layers=L)
        cache = kv.set_lengths(cache, jnp.asarray([0, 3], jnp.int32))
        pos = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        outs = [jax.jit(partial(llama.forward, cfg=CFG, fwd=ForwardOptions(scan_layers=s), num_layers=n))(
            p, toks, pos, cache, llama.causal_mask(B, T)) for p, s in ((params, False), (stacked, True))]
        for a, b in zip(jax.tree_util.tree_leaves(outs[0]), jax.tree_util.tree_leaves(outs[1])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="stack_layers"):
        llama.forward(params, toks, pos, cache, llama.causal_mask(B, T), cfg=CFG, fwd=ForwardOptions(scan_layers=True))
    # launch scripts get the stacked form from the loaded model (--scan_layers)
    from specjax.models.loader import load_model

    m = load_model("tiny-random")
    assert isinstance(m.params_for(ForwardOptions(scan_layers=True))["layers"], dict)
    assert isinstance(m.params_for(ForwardOptions())["layers"], list)


def test_rope_inv_freq_unscaled():
    np.testing.assert_allclose(llama.rope_inv_freq(CFG), 10000.0 ** (-np.arange(0, 16, 2) / 16), rtol=1e-6)


@pytest.mark.parametrize("cfg", [
    get_model_config("llama3-8b"),
    CFG.replace(rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position=64)),
    CFG.replace(head_dim=64, rope_theta=500000.0, num_heads=4, num_kv_heads=2,
                rope_scaling=RopeScaling(factor=32.0, low_freq_factor=2.0, high_freq_factor=8.0,
                                         original_max_position=1024)),
], ids=["llama3-8b", "tiny-orig64", "hd64-f32-lf2-hf8"])
def test_rope_llama3_scaling_matches_reference(cfg):
    s = cfg.rope_scaling
    assert s is not None
    ref = np_llama3_inv_freq(cfg.head_dim, cfg.rope_theta, s)
    got = llama.rope_inv_freq(cfg)
    assert got.shape == (cfg.head_dim // 2,)
    np.testing.assert_allclose(got, ref, rtol=1e-6)
    # The case exercises all three regimes (kept, scaled, smoothed).
    base = np_llama3_inv_freq(cfg.head_dim, cfg.rope_theta, None)
    kept = np.isclose(ref, base, rtol=1e-9)
    scaled = np.isclose(ref, base / s.factor, rtol=1e-9)
    assert kept.any() and scaled.any() and (~kept & ~scaled).any()


# ---------------------------------------------------------------- generate.Generator

PROMPT_LENS = [3, 14, 9]
MAX_NEW = 10


@pytest.fixture(scope="module")
def gen_prompts():
    return [rand_ids(n, seed=200 + n) for n in PROMPT_LENS]


def naive_greedy(prompt, n_new):
    """No cache: full forward over prompt + generated every step, argmax."""
    seq = list(prompt)
    for _ in range(n_new):
        seq.append(int(np.argmax(ref_logits(PARAMS, CFG, seq)[-1])))
    return seq[len(prompt):]


@pytest.fixture(scope="module")
def greedy_batch(gen_prompts):
    return Generator(CFG, PARAMS).generate(gen_prompts, max_new_tokens=MAX_NEW)


def test_generator_greedy_batch_equals_single_and_naive(gen_prompts, greedy_batch):
    gen = Generator(CFG, PARAMS)
    assert len(greedy_batch) == 3
    for b, (p, r) in enumerate(zip(gen_prompts, greedy_batch)):
        assert r.prompt_len == len(p)
        assert r.finish_reason == "length"
        assert len(r.tokens) == MAX_NEW
        single = gen.generate([p], max_new_tokens=MAX_NEW)[0]
        assert single.tokens == r.tokens, f"row {b}: batched != alone"
        assert naive_greedy(p, MAX_NEW) == r.tokens, f"row {b}: != naive no-cache loop"
    # The plain reference loop (the oracle of the speculative tests) agrees too.
    assert [r.tokens for r in reference_generate(CFG, PARAMS, gen_prompts, max_new_tokens=MAX_NEW)] == \
        [r.tokens for r in greedy_batch]


def test_generator_eos_stopping(gen_prompts, greedy_batch):
    full = [r.tokens for r in greedy_batch]
    # An eos id that row 0's greedy continuation produces, first appearing after a few tokens.
    cand = [t for i, t in enumerate(full[0]) if i >= 2 and t not in full[0][:i]]
    assert cand, f"row 0 continuation has no usable eos candidate: {full[0]}"
    eos = cand[0]
    res = Generator(CFG, PARAMS, eos_ids=(eos, V + 5)).generate(gen_prompts, max_new_tokens=MAX_NEW)
    for b, r in enumerate(res):
        if eos in full[b]:
            k = full[b].index(eos)
            assert r.tokens == full[b][: k + 1], f"row {b}"
            assert r.finish_reason == "eos"
        else:
            assert r.tokens == full[b], f"row {b}"
            assert r.finish_reason == "length"
    assert res[0].finish_reason == "eos" and len(res[0].tokens) < MAX_NEW
    ign = Generator(CFG, PARAMS, eos_ids=(eos,)).generate(gen_prompts, max_new_tokens=MAX_NEW, ignore_eos=True)
    assert [r.tokens for r in ign] == full
    assert all(r.finish_reason == "length" for r in ign)


_sample1 = jax.jit(sample, static_argnames=("greedy_only",))
_verify0 = jax.jit(verify_chain)


def test_generator_sampling_batch_independent_and_matches_naive(gen_prompts):
    """Seeded sampling in a mixed-length batch equals, per row, a naive loop that samples
    from full-forward logits with the key of (seed, absolute position)."""
    sps = [SamplingParams(temperature=1.0, seed=11), SamplingParams(temperature=0.8, top_k=20, seed=12),
           SamplingParams(temperature=1.3, top_p=0.9, seed=13)]
    gen = Generator(CFG, PARAMS)
    batch = gen.generate(gen_prompts, sps, max_new_tokens=6)
    assert any(r.tokens != g.tokens for r, g in zip(batch, gen.generate(gen_prompts, max_new_tokens=6))), \
        "sampling produced exactly the greedy output for every row"
    # The naive loop runs each row alone, so agreeing with it also shows the batch
    # (its composition, padding rows, bucket) does not affect a row's samples.
    # Generator is the engine's K = 0 step: the first token is sampled by the prefill (sample()),
    # every later one as the bonus token of a verify step with no drafts (its residual stream);
    # both are keyed by (seed, absolute position) only.
    for b in range(3):
        seq = list(gen_prompts[b])
        arrs = SamplingArrays.build([sps[b]], 1)
        for i in range(6):
            logits = jnp.asarray(ref_logits(PARAMS, CFG, seq)[-1:])
            pos = jnp.asarray([len(seq)])
            if i == 0:
                seq.append(int(_sample1(logits, arrs, pos, greedy_only=False)[0]))
            else:
                toks, _, _ = _verify0(logits[:, None], jnp.zeros((1, 0), jnp.int32), jnp.zeros(1, jnp.int32), arrs, pos)
                seq.append(int(toks[0, 0]))
        assert seq[len(gen_prompts[b]):] == batch[b].tokens, f"row {b}: != naive sampling loop"


def test_validate_request_errors():
    with pytest.raises(SpecjaxError, match="empty prompt"):
        validate_request([], 4, CFG)
    with pytest.raises(SpecjaxError, match="max_new_tokens"):
        validate_request([1], 0, CFG)
    with pytest.raises(SpecjaxError, match="out of range"):
        validate_request([1, V], 4, CFG)
    with pytest.raises(SpecjaxError, match="context"):
        validate_request([1] * CFG.max_position, 4, CFG)
    with pytest.raises(SpecjaxError, match="one SamplingParams per prompt"):
        Generator(CFG, PARAMS).generate([[1], [2]], [SamplingParams()], max_new_tokens=2)


def test_sum_fixed_order_is_its_definition_in_any_block():
    """llama.sum_fixed_order: pieces of 64 (zero-padded) added in turn, then 8 pieces of 8, then
    the 8 in turn; a row's sum the same bits alone or in a block of rows."""
    from specjax.models import llama

    def numpy_order(row):
        a = row.astype(np.float32)
        for w in (64, 8, 1):
            a = np.concatenate([a, np.zeros((-len(a)) % w, np.float32)])
            s = a[:w].copy()
            for i in range(1, len(a) // w):
                s = s + a[i * w:(i + 1) * w]
            a = s
        return a

    rng = np.random.default_rng(3)
    for n in (576, 100, 2048):
        x = (rng.standard_normal((9, n)) * np.exp(rng.standard_normal((9, n)) * 3)).astype(np.float32)
        block = np.asarray(jax.jit(llama.sum_fixed_order)(jnp.asarray(x)))
        assert block.shape == (9, 1)
        for i in range(9):
            np.testing.assert_array_equal(block[i], numpy_order(x[i]))
            np.testing.assert_array_equal(block[i], np.asarray(jax.jit(llama.sum_fixed_order)(jnp.asarray(x[i:i + 1])))[0])
