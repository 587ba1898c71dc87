"""Sampling: logit warping vs a numpy reference, sample() statistics and
per-request determinism, SamplingParams validation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specjax.errors import SpecjaxError
from specjax.sampling import SamplingArrays, SamplingParams, argmax, probs_from_logits, sample, warp_logits

_warp = jax.jit(warp_logits)
_sample = jax.jit(sample, static_argnames=("greedy_only",))
_probs = jax.jit(probs_from_logits)


# ---------------------------------------------------------------- numpy reference


def ref_warp_row(logits, temperature, top_k, top_p):
    """Temperature -> top-k -> top-p, written out plainly.

    top-p is computed on the renormalised top-k distribution; the kept set is the
    smallest prefix (by descending probability) whose mass reaches top_p, never
    empty; tokens tied with the last kept one are kept too (also at the top-k cut).
    Returns (scaled logits with -inf for dropped tokens, margin of the top-p cut)."""
    V = logits.shape[-1]
    t = temperature if temperature > 0 else 1.0
    x = logits.astype(np.float32) / np.float32(t)  # same fp32 scaling as the library
    keep = np.ones(V, bool)
    if top_k > 0 and top_k < V:
        kth = np.sort(x)[::-1][top_k - 1]
        keep = x >= kth
    margin = np.inf
    if top_p < 1.0:
        xs = x.astype(np.float64)
        p = np.where(keep, np.exp(xs - xs[keep].max()), 0.0)
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        n = int(np.argmax(cum >= top_p)) + 1 if (cum >= top_p).any() else int(keep.sum())
        n = max(1, min(n, int(keep.sum())))
        thresh = x[order[n - 1]]
        keep = keep & (x >= thresh)
        margin = float(np.min(np.abs(cum - top_p)))
    return np.where(keep, x, -np.inf).astype(np.float32), margin


def ref_warp(logits, temps, ks, ps):
    """logits [B, ..., V]; per-row params."""
    out = np.empty(logits.shape, np.float32)
    margins = []
    for b in range(logits.shape[0]):
        flat = logits[b].reshape(-1, logits.shape[-1])
        rows = []
        for r in flat:
            w, m = ref_warp_row(r, temps[b], ks[b], ps[b])
            rows.append(w)
            margins.append(m)
        out[b] = np.stack(rows).reshape(logits[b].shape)
    return out, min(margins)


def softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def arrays(temps, ks, ps, seeds=None):
    n = len(temps)
    seeds = seeds if seeds is not None else [0] * n
    return SamplingArrays(temperature=jnp.asarray(temps, jnp.float32), top_k=jnp.asarray(ks, jnp.int32),
                          top_p=jnp.asarray(ps, jnp.float32), seed=jnp.asarray(np.asarray(seeds, np.uint32)))


V = 50
# (temperature, top_k, top_p) per row.
ROWS = [
    (1.0, 0, 1.0),  # nothing
    (0.7, 0, 1.0),  # temperature only
    (1.5, 5, 1.0),  # top-k only
    (1.0, 1, 1.0),  # top-k = 1
    (0.5, 0, 0.9),  # top-p only
    (1.2, 10, 0.5),  # both: top-p on the renormalised top-10
    (0.0, 3, 0.8),  # greedy row: scaled by 1, still warped
    (1.0, V + 5, 0.95),  # top_k > V
    (2.0, V, 0.3),  # top_k == V
    (0.9, 7, 0.02),  # tiny top_p: only the top token
    (3.0, 0, 0.999),
    (0.3, 20, 0.7),
]


def _check_warp(logits, temps, ks, ps):
    got = np.asarray(_warp(jnp.asarray(logits), jnp.asarray(temps, jnp.float32), jnp.asarray(ks, jnp.int32),
                           jnp.asarray(ps, jnp.float32)))
    want, margin = ref_warp(logits, temps, ks, ps)
    # The inputs must not sit on a top-p boundary (fp32 vs fp64 cumsum could then disagree).
    assert margin > 1e-5, f"test input too close to a top-p boundary ({margin})"
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want), err_msg="kept sets differ")
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-6)
    return got


def test_warp_logits_matches_reference_2d():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((len(ROWS), V)).astype(np.float32)
    temps, ks, ps = map(list, zip(*ROWS))
    got = _check_warp(logits, temps, ks, ps)
    kept = np.isfinite(got).sum(-1)
    assert kept[0] == V and kept[1] == V
    assert kept[2] == 5 and kept[3] == 1 and kept[9] == 1
    assert 1 < kept[4] < V and 1 <= kept[5] < 10
    # The top token is always kept.
    assert np.all(np.isfinite(got[np.arange(len(ROWS)), logits.argmax(-1)]))


def test_warp_logits_matches_reference_3d():
    """Verification warps [B, T, V] blocks with per-row params broadcast over T."""
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((len(ROWS), 3, V)).astype(np.float32)
    temps, ks, ps = map(list, zip(*ROWS))
    _check_warp(logits, temps, ks, ps)


def test_warp_logits_ties_at_cutoff_are_kept():
    neg = -10.0
    logits = np.full((4, 8), neg, np.float32)
    logits[0, :5] = [5, 4, 4, 4, 1]  # top_k=2 cuts inside a 3-way tie: all of it stays
    logits[1, :5] = [3, 2, 2, 0, 0]  # top_p=0.6: prefix [3, 2] reaches it; the tied 2 stays
    logits[2, :4] = [1, 1, 1, 0]  # top_k=1 with a 3-way tie at the top
    logits[3, :4] = [2, 2, 0, 0]  # top_p tiny with tied top tokens
    temps, ks, ps = [1.0, 1.0, 1.0, 1.0], [2, 0, 1, 0], [1.0, 0.6, 1.0, 0.01]
    got = _check_warp(logits, temps, ks, ps)
    assert np.isfinite(got).sum(-1).tolist() == [4, 3, 3, 2]


def test_top_p_one_keeps_the_whole_tail():
    """top_p=1 is "off" even where the fp32 cumsum reaches 1.0 before the tail."""
    logits = np.zeros((2, V), np.float32)
    logits[:, 0] = 25.0
    logits[:, -1] = -10.0
    got = np.asarray(_warp(jnp.asarray(logits), jnp.asarray([1.0, 0.0]), jnp.asarray([0, 0]),
                           jnp.asarray([1.0, 1.0])))
    assert np.isfinite(got).all(), f"top_p=1 dropped tokens {np.flatnonzero(~np.isfinite(got))}"
    _check_warp(logits, [1.0, 0.0], [0, 0], [1.0, 1.0])


def test_warp_temperature_scaling():
    logits = np.array([[1.0, 2.0, 4.0], [1.0, 2.0, 4.0]], np.float32)
    got = np.asarray(_warp(jnp.asarray(logits), jnp.asarray([2.0, 0.0]), jnp.asarray([0, 0]),
                           jnp.asarray([1.0, 1.0])))
    np.testing.assert_allclose(got, [[0.5, 1.0, 2.0], [1.0, 2.0, 4.0]])


# ---------------------------------------------------------------- sample()


def test_greedy_rows_return_argmax():
    rng = np.random.default_rng(2)
    B = 8
    logits = jnp.asarray(rng.standard_normal((B, V)).astype(np.float32))
    temps = [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 2.0]
    ks = [0, 3, 1, 0, 0, 5, 0, 0]
    ps = [1.0, 0.5, 1.0, 0.1, 1.0, 1.0, 0.9, 1.0]
    s = arrays(temps, ks, ps, seeds=list(range(B)))
    pos = jnp.arange(B, dtype=jnp.int32) + 10
    tok = np.asarray(_sample(logits, s, pos, greedy_only=False))
    am = np.asarray(jnp.argmax(logits, -1))
    greedy = np.array(temps) == 0
    np.testing.assert_array_equal(tok[greedy], am[greedy])
    np.testing.assert_array_equal(np.asarray(_sample(logits, s, pos, greedy_only=True)), am)


def test_argmax_is_jnp_argmax_with_ties_nans_and_infinities():
    """sampling.argmax (two plain reductions, the fast path on XLA:CPU) picks the index jnp.argmax
    picks: the first maximum, the first NaN where there is one, index 0 of an all -inf row."""
    rng = np.random.default_rng(3)
    x = rng.integers(-3, 4, (6, 3, 50)).astype(np.float32)  # many ties at the maximum
    x[0, 0, 7] = np.nan
    x[0, 1, [4, 40]] = np.nan
    x[1, 0] = -np.inf
    x[1, 1, 9] = np.inf
    x[1, 2, [2, 30]] = np.inf
    x[2, 0, :] = np.nan
    for a in (x, x.astype(jnp.bfloat16), x[:, 0]):
        want = np.asarray(jnp.argmax(jnp.asarray(a), axis=-1))
        got = np.asarray(jax.jit(argmax)(jnp.asarray(a)))
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, want)
    assert int(argmax(jnp.asarray(x[0, 0]))) == 7 and int(argmax(jnp.asarray(x[0, 2]))) == int(np.argmax(x[0, 2]))


def test_sample_frequencies_match_warped_softmax():
    """Over many (seed, position) keys the empirical distribution is softmax(warp(logits))."""
    Vs = 8
    base = np.array([2.0, 1.5, 1.2, 1.0, 0.3, 0.0, -0.5, -3.0], np.float32)
    cases = [(0.8, 5, 0.95), (1.5, 0, 1.0), (1.0, 0, 0.7)]
    N = 6000
    logits, temps, ks, ps, seeds, pos = [], [], [], [], [], []
    for ci, (t, k, p) in enumerate(cases):
        for i in range(N):
            logits.append(base)
            temps.append(t), ks.append(k), ps.append(p)
            # Half the draws vary the seed at a fixed position, half the position at a fixed seed.
            if i < N // 2:
                seeds.append(1000 * ci + i), pos.append(17)
            else:
                seeds.append(99 + ci), pos.append(i)
    tok = np.asarray(_sample(jnp.asarray(np.stack(logits)), arrays(temps, ks, ps, seeds),
                             jnp.asarray(pos, jnp.int32), greedy_only=False))
    for ci, (t, k, p) in enumerate(cases):
        w, _ = ref_warp(base[None], [t], [k], [p])
        expected = softmax(w[0])
        counts = np.bincount(tok[ci * N:(ci + 1) * N], minlength=Vs)
        support = expected > 0
        assert counts[~support].sum() == 0, f"case {ci}: sampled excluded tokens {counts}"
        assert support.sum() >= 3
        chi2, pval = stats.chisquare(counts[support], N * expected[support])
        assert pval > 1e-4, f"case {ci}: counts {counts} vs expected {np.round(N * expected)} (p={pval:.2g})"


def test_same_seed_and_position_same_token_regardless_of_batch():
    rng = np.random.default_rng(3)
    n = 16
    logits = rng.standard_normal((n, V)).astype(np.float32) * 0.5  # high entropy: keys matter
    temps = [1.0 + 0.1 * (i % 3) for i in range(n)]
    ks = [0 if i % 2 else 30 for i in range(n)]
    ps = [1.0 if i % 4 else 0.95 for i in range(n)]
    seeds = rng.integers(0, 2**32, size=n, dtype=np.uint64).tolist()
    pos = rng.integers(0, 1000, size=n).tolist()
    alone = np.asarray(_sample(jnp.asarray(logits), arrays(temps, ks, ps, seeds), jnp.asarray(pos, jnp.int32)))

    # Same rows, shuffled into a bigger batch among other (different) requests.
    perm = rng.permutation(2 * n)
    other = rng.standard_normal((n, V)).astype(np.float32)
    L = np.concatenate([logits, other])[perm]
    T = (temps + [0.5] * n)
    K = (ks + [0] * n)
    P = (ps + [1.0] * n)
    S = (seeds + list(range(n)))
    Q = (pos + list(range(n)))
    mixed = np.asarray(_sample(jnp.asarray(L), arrays([T[i] for i in perm], [K[i] for i in perm],
                                                     [P[i] for i in perm], [S[i] for i in perm]),
                               jnp.asarray([Q[i] for i in perm], jnp.int32)))
    inv = np.argsort(perm)
    np.testing.assert_array_equal(mixed[inv[:n]], alone)

    # The key really depends on seed and position (otherwise the above proves little).
    shifted_pos = np.asarray(_sample(jnp.asarray(logits), arrays(temps, ks, ps, seeds),
                                     jnp.asarray(pos, jnp.int32) + 1))
    other_seed = np.asarray(_sample(jnp.asarray(logits), arrays(temps, ks, ps, [s + 1 for s in seeds]),
                                    jnp.asarray(pos, jnp.int32)))
    assert (shifted_pos != alone).sum() >= 4
    assert (other_seed != alone).sum() >= 4


def test_probs_from_logits():
    rng = np.random.default_rng(4)
    temps, ks, ps = map(list, zip(*ROWS))
    logits = (rng.standard_normal((len(ROWS), 2, V)) * 2).astype(np.float32)
    got = np.asarray(_probs(jnp.asarray(logits), arrays(temps, ks, ps)))
    w, _ = ref_warp(logits, temps, ks, ps)
    want = softmax(w)
    for b, t in enumerate(temps):
        if t == 0:
            want[b] = np.eye(V)[logits[b].argmax(-1)]
    np.testing.assert_allclose(got, want, atol=1e-6)
    np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-5)


def test_sampling_arrays_build_pads_with_greedy():
    s = SamplingArrays.build([SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=2**32 - 1)], 3)
    assert np.asarray(s.temperature).tolist() == pytest.approx([0.7, 0.0, 0.0])
    assert np.asarray(s.top_k).tolist() == [5, 0, 0]
    assert np.asarray(s.top_p).tolist() == pytest.approx([0.9, 1.0, 1.0])
    assert np.asarray(s.seed).tolist() == [2**32 - 1, 0, 0]


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("kw,needle", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=-0.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=1.5), "top_k"),
    (dict(seed=-1), "seed"),
    (dict(seed=2**32), "seed"),
])
def test_sampling_params_validation(kw, needle):
    with pytest.raises(SpecjaxError, match=needle):
        SamplingParams(**kw)


def test_sampling_params_valid_edges():
    assert SamplingParams().greedy
    p = SamplingParams(temperature=0.5, top_k=0, top_p=1.0, seed=2**32 - 1)
    assert not p.greedy
    SamplingParams(top_p=1e-6, top_k=1)


def test_no_cut_skips_the_sort_with_the_same_bits():
    """With no row cutting (top_k 0 or >= V, top_p 1), warp_logits skips the vocabulary sort and
    keeps every token, as the cut would: the scaled logits' bits, -inf and NaN as -inf, +inf as
    is; a batch where one row cuts takes the cut for every row."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(3, 2, 64)).astype(np.float32)
    x[0, 0, 3], x[1, 1, 7], x[2, 0, 9] = -np.inf, np.nan, np.inf
    t = jnp.asarray([0.7, 1.0, 0.0], jnp.float32)
    off_k, off_p = jnp.asarray([0, 64, 0], jnp.int32), jnp.ones(3, jnp.float32)
    fast = np.asarray(warp_logits(jnp.asarray(x), t, off_k, off_p))
    assert np.isneginf(fast[1, 1, 7]) and np.isneginf(fast[0, 0, 3]) and np.isposinf(fast[2, 0, 9])
    finite = np.isfinite(x)
    scaled = x / np.where(np.asarray(t) > 0, np.asarray(t), np.float32(1.0))[:, None, None]
    assert np.isfinite(fast[finite]).all()
    np.testing.assert_allclose(fast[finite], scaled[finite], rtol=1e-6)
    cut = np.asarray(warp_logits(jnp.asarray(x), t, off_k.at[1].set(5), off_p))  # one row cuts: the sorted path
    assert (np.isfinite(cut[1]).sum(axis=-1) == 5).all() and np.isfinite(cut[0, 1]).all()
