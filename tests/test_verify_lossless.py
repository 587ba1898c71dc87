"""Statistical losslessness of chain verification (Leviathan et al. / Chen et al.).

A synthetic Markov "target" (logits table P[prev] -> next over a small vocabulary)
and a different "draft" table Q. Speculative generation is simulated fully
vectorised over a large batch: every step drafts K tokens from the *warped* draft
chain, builds the target logits of the block ``[pending, d_1..d_K]`` from P, calls
``verify_chain`` and appends ``tokens[:n+1]``. The empirical joint distribution of
the first three generated tokens must match the exact warped target chain
(Pearson chi-square); deliberately wrong acceptance rules must fail the very
same test. Greedy rows are checked exactly.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from markov_tables import P_TABLE, Q_TABLE, V, X0
from suite_xla import run_time_options
from specjax.sampling import SamplingArrays, probs_from_logits
from specjax.verify import SALT_ACCEPT, SALT_RESIDUAL, _sample_rows, stream_keys, verify_chain

try:
    from scipy.stats import chi2 as _scipy_chi2
except ImportError:  # pragma: no cover - scipy is in the test venv; keep a fallback anyway
    _scipy_chi2 = None

N_GEN = 3  # compare the joint distribution of the first three generated tokens
N = 120_000  # rows per simulation
P_ALPHA = 0.01  # a correct rule must pass at this level
P_WRONG = 1e-6  # a wrong rule must fail below this


def chi2_sf(stat: float, df: int) -> float:
    if _scipy_chi2 is not None:
        return float(_scipy_chi2.sf(stat, df))
    return float(jax.scipy.special.gammaincc(df / 2.0, stat / 2.0))


def test_chi2_sf_sanity():
    # Known quantiles of the chi-square distribution, through whichever implementation is active.
    assert abs(chi2_sf(3.841458820694124, 1) - 0.05) < 1e-6
    assert abs(chi2_sf(23.209251158954356, 10) - 0.01) < 1e-6
    assert abs(float(jax.scipy.special.gammaincc(5.0, 23.209251158954356 / 2)) - 0.01) < 1e-5




def samp_arrays(params, seeds):
    """params: list of (temperature, top_k, top_p) per row."""
    t, k, p = (np.asarray(x) for x in zip(*params))
    return SamplingArrays(temperature=jnp.asarray(t, jnp.float32), top_k=jnp.asarray(k, jnp.int32),
                          top_p=jnp.asarray(p, jnp.float32), seed=jnp.asarray(np.asarray(seeds, np.uint32)))


# ---------------------------------------------------------------- wrong rule (local copy)


def wrong_residual_verify(target_logits, draft_tokens, num_draft, samp, first_pos, draft_probs, residual_is_p):
    """A local copy of verify.verify_sampled; with residual_is_p the correction after a
    rejection is sampled from p instead of norm(max(p - q, 0)) (a classic mistake)."""
    B, K1, V_ = target_logits.shape
    K = K1 - 1
    p = probs_from_logits(target_logits, samp)
    q = draft_probs.astype(p.dtype)
    p_d = jnp.take_along_axis(p[:, :K], draft_tokens[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, draft_tokens[..., None], axis=-1)[..., 0]
    pos = first_pos[:, None] + jnp.arange(K)[None, :]
    u = jax.vmap(jax.vmap(jax.random.uniform))(stream_keys(samp.seed, pos, SALT_ACCEPT))
    accept = (u * q_d < p_d) & (jnp.arange(K)[None, :] < num_draft[:, None])
    n = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)
    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]
    q_pad = jnp.concatenate([q, jnp.zeros((B, 1, V_), q.dtype)], axis=1)
    q_n = jnp.take_along_axis(q_pad, n[:, None, None], axis=1)[:, 0]
    rejected = n < num_draft
    if residual_is_p:
        resid = p_n
    else:
        resid = jnp.where(rejected[:, None], jnp.maximum(p_n - q_n, 0.0), p_n)
        resid = jnp.where(jnp.sum(resid, axis=-1, keepdims=True) > 0, resid, p_n)
    rkeys = stream_keys(samp.seed, (first_pos + n)[:, None], SALT_RESIDUAL)[:, 0]
    corr = _sample_rows(rkeys, resid)
    idx = jnp.arange(K1)[None, :]
    drafts_pad = jnp.concatenate([draft_tokens, jnp.zeros((B, 1), jnp.int32)], axis=1)
    tokens = jnp.where(idx < n[:, None], drafts_pad, corr[:, None])
    return tokens, n


# ---------------------------------------------------------------- the simulation

# Verification rules the simulation can apply (a traced switch, so one compile per K serves all).
LIBRARY = 0  # verify_chain with the right draft_probs: q for sampled drafts, None for deterministic ones
NO_Q = 1  # verify_chain(draft_probs=None) although the drafts were sampled from q (still lossless, see below)
RAW_Q = 2  # WRONG: draft_probs = the *unwarped* draft softmax while drafts come from the warped q
RESID_P = 3  # WRONG: local copy of the rule with the correction drawn from p instead of max(p - q, 0)


@partial(jax.jit, static_argnames=("K",),
         compiler_options=run_time_options())  # run time dominates here (suite_xla)
def simulate(P, Q, samp, key, draft_argmax, nd_random, rule, *, K: int):
    """Speculative generation of >= N_GEN tokens per row; returns (first tokens [B, N_GEN], stats).

    draft_argmax: drafts = argmax of Q (deterministic; verified with draft_probs=None) instead of
      samples from the warped draft chain.
    nd_random: num_draft uniform in [0, K] per row and step instead of K.
    rule: LIBRARY, NO_Q, RAW_Q or RESID_P.
    """
    B = samp.temperature.shape[0]
    width = N_GEN * (K + 1) + 1
    out = jnp.zeros((B, width), jnp.int32)
    count = jnp.zeros((B,), jnp.int32)
    pending = jnp.full((B,), X0, jnp.int32)
    first_pos = jnp.ones((B,), jnp.int32)  # X0 sits at position 0, d_1 of the first block at 1
    drafted = accepted = jnp.zeros((), jnp.int32)
    ok = jnp.array(True)
    # Every step emits at least one token, so N_GEN steps suffice for every row.
    for step in range(N_GEN):
        key, kd, kn = jax.random.split(key, 3)
        drafts, qs, qraw = [], [], []
        prev = pending
        for j in range(K):
            lg = Q[prev]  # [B, V]
            q = probs_from_logits(lg, samp)  # the warped draft distribution
            sampled = jax.random.categorical(jax.random.fold_in(kd, j), jnp.log(q), axis=-1)
            d = jnp.where(draft_argmax, jnp.argmax(lg, axis=-1), sampled).astype(jnp.int32)
            drafts.append(d)
            qs.append(q)
            qraw.append(jax.nn.softmax(lg, axis=-1))
            prev = d
        drafts = jnp.stack(drafts, axis=1)
        q_all = jnp.stack(qs, axis=1)
        target_logits = P[jnp.concatenate([pending[:, None], drafts], axis=1)]  # [B, K+1, V]
        num_draft = jnp.where(nd_random, jax.random.randint(kn, (B,), 0, K + 1, jnp.int32), K)
        t_none, n_none, v_none = verify_chain(target_logits, drafts, num_draft, samp, first_pos, draft_probs=None)
        q_pass = jnp.where(rule == RAW_Q, jnp.stack(qraw, axis=1), q_all)
        t_q, n_q, v_q = verify_chain(target_logits, drafts, num_draft, samp, first_pos, draft_probs=q_pass)
        t_w, n_w = wrong_residual_verify(target_logits, drafts, num_draft, samp, first_pos, q_all,
                                         residual_is_p=True)
        use_none = (draft_argmax & (rule == LIBRARY)) | (rule == NO_Q)
        tokens = jnp.where(rule == RESID_P, t_w, jnp.where(use_none, t_none, t_q))
        n = jnp.where(rule == RESID_P, n_w, jnp.where(use_none, n_none, n_q))
        # Invariants of the output format.
        idx = jnp.arange(K + 1)[None, :]
        ok &= jnp.all(v_none == (idx <= n_none[:, None])) & jnp.all(v_q == (idx <= n_q[:, None]))
        ok &= jnp.all((n >= 0) & (n <= num_draft))
        ok &= jnp.all(jnp.where(jnp.arange(K)[None, :] < n[:, None], tokens[:, :K] == drafts, True))
        out = jax.vmap(lambda o, t, c: jax.lax.dynamic_update_slice(o, t, (c,)))(out, tokens, count)
        count = count + n + 1
        first_pos = first_pos + n + 1
        pending = jnp.take_along_axis(tokens, n[:, None], axis=1)[:, 0]
        drafted = drafted + jnp.sum(num_draft)
        accepted = accepted + jnp.sum(n)
    return out[:, :N_GEN], dict(ok=ok, min_count=jnp.min(count), drafted=drafted, accepted=accepted)


def exact_joint(params) -> np.ndarray:
    """Exact distribution [V**N_GEN] of the first N_GEN tokens of the warped target chain from X0."""
    s = samp_arrays([params] * V, [0] * V)
    T = np.asarray(probs_from_logits(jnp.asarray(P_TABLE), s), np.float64)  # T[prev, next]
    T /= T.sum(-1, keepdims=True)
    joint = np.zeros([V] * N_GEN)
    for a in range(V):
        for b in range(V):
            joint[a, b, :] = T[X0, a] * T[a, b] * T[b, :]
    return joint.reshape(-1)


def chi_square(tokens: np.ndarray, probs: np.ndarray) -> tuple[float, int, float]:
    """Pearson chi-square of joint-token counts against exact probabilities.

    Zero-probability cells must be empty (asserted); cells with expected count < 5
    are pooled (and the pool joined to the smallest cell if it is still < 5)."""
    n = len(tokens)
    cell = np.zeros(n, np.int64)
    for i in range(N_GEN):
        cell = cell * V + tokens[:, i]
    obs = np.bincount(cell, minlength=V ** N_GEN).astype(np.float64)
    zero = probs == 0
    assert obs[zero].sum() == 0, f"{int(obs[zero].sum())} samples in zero-probability cells {np.flatnonzero(zero & (obs > 0))[:10]}"
    exp = probs * n
    small = (~zero) & (exp < 5)
    big = (~zero) & ~small
    o = list(obs[big])
    e = list(exp[big])
    if small.any():
        po, pe = obs[small].sum(), exp[small].sum()
        if pe < 5:
            i = int(np.argmin(e))
            o[i] += po
            e[i] += pe
        else:
            o.append(po)
            e.append(pe)
    o, e = np.asarray(o), np.asarray(e)
    stat = float(((o - e) ** 2 / e).sum())
    df = len(o) - 1
    assert df >= 10, f"too few cells for a meaningful test ({df + 1})"
    return stat, df, chi2_sf(stat, df)


def run_case(groups, *, K, draft_argmax=False, nd_random=False, rule=LIBRARY, seed=0, n_rows=N):
    """groups: list of (temperature, top_k, top_p) in equal shares of the batch. Returns
    ({group index: p-value}, tokens per group, simulation stats)."""
    G = len(groups)
    per = n_rows // G
    params = [g for g in groups for _ in range(per)]
    seeds = np.arange(len(params), dtype=np.uint32) + np.uint32(seed * 1_000_003)
    samp = samp_arrays(params, seeds)
    toks, st = simulate(jnp.asarray(P_TABLE), jnp.asarray(Q_TABLE), samp, jax.random.PRNGKey(seed + 7),
                        jnp.asarray(draft_argmax), jnp.asarray(nd_random), jnp.asarray(rule, jnp.int32), K=K)
    toks = np.asarray(toks)
    st = {k: int(v) for k, v in st.items()}
    assert st["ok"], "verify_chain output violates its format invariants"
    assert st["min_count"] >= N_GEN
    pvals, per_group = {}, {}
    for gi, g in enumerate(groups):
        t = toks[gi * per:(gi + 1) * per]
        per_group[gi] = t
        if g[0] > 0:
            pvals[gi] = chi_square(t, exact_joint(g))[2]
    return pvals, per_group, st


def greedy_chain() -> list[int]:
    out, x = [], X0
    for _ in range(N_GEN):
        x = int(np.argmax(P_TABLE[x]))
        out.append(x)
    return out


# ---------------------------------------------------------------- lossless: must pass

TEMP = (0.9, 0, 1.0)
TOPK = (1.3, 3, 1.0)
TOPP = (1.1, 0, 0.75)
BOTH = (0.8, 4, 0.9)
GREEDY = (0.0, 0, 1.0)

CASES = {
    # id: (groups, K, options)
    "temperature-K1": ([TEMP], 1, {}),
    "temperature-K3": ([TEMP], 3, {}),
    "top_k-K3": ([TOPK], 3, {}),
    "top_k-K1": ([TOPK], 1, {}),
    "top_p-K3": ([TOPP], 3, {}),
    "top_p-K1": ([TOPP], 1, {}),
    "mixed-rows-K3": ([TEMP, TOPK, BOTH, GREEDY], 3, {}),
    "mixed-rows-K1": ([TOPP, BOTH, GREEDY], 1, {}),
    "deterministic-drafts-K3": ([TEMP, BOTH], 3, dict(draft_argmax=True)),
    "deterministic-drafts-K1": ([TOPK], 1, dict(draft_argmax=True)),
    "num_draft-lt-K-K3": ([TEMP, TOPP, GREEDY], 3, dict(nd_random=True)),
    "num_draft-lt-K-deterministic-K3": ([TOPK, BOTH], 3, dict(draft_argmax=True, nd_random=True)),
    # Verifying *sampled* drafts as if deterministic (one-hot q) is a valid rule too, only with a
    # lower acceptance: given d, accepting with p(d) and otherwise sampling from p without d
    # (the one-hot residual) yields p exactly, whatever distribution d came from.
    "sampled-drafts-verified-one-hot-K3": ([TEMP, TOPK], 3, dict(rule=NO_Q)),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_lossless_joint_distribution(case):
    groups, K, opts = CASES[case]
    pvals, per_group, st = run_case(groups, K=K, seed=len(case), **opts)
    # The draft must be imperfect for the test to mean anything: some but not all drafts accepted.
    rate = st["accepted"] / max(st["drafted"], 1)
    assert 0.02 < rate < 0.95, st
    assert len(pvals) == sum(g[0] > 0 for g in groups) > 0
    for gi, p in pvals.items():
        assert p > P_ALPHA, f"{case}: group {groups[gi]} deviates from the warped target chain (p={p:.3g})"
    for gi, g in enumerate(groups):
        if g[0] == 0:  # greedy rows in the same batch: exactly the target's argmax chain
            np.testing.assert_array_equal(per_group[gi], np.broadcast_to(greedy_chain(), per_group[gi].shape))


_verify_jit = jax.jit(verify_chain, static_argnames=("greedy_only",))
_wrong_jit = jax.jit(wrong_residual_verify, static_argnames=("residual_is_p",))


def test_wrong_rules_local_copy_matches_library_when_correct():
    """The local copy used for the wrong-residual variant is token-for-token the library rule
    when the residual is left correct, so its failure below is due to the residual alone."""
    rng = np.random.default_rng(5)
    B, K = 512, 3
    logits = jnp.asarray(rng.standard_normal((B, K + 1, V)).astype(np.float32) * 1.5)
    dlogits = jnp.asarray(rng.standard_normal((B, K, V)).astype(np.float32) * 1.5)
    samp = samp_arrays([TEMP] * B, np.arange(B))
    q = probs_from_logits(dlogits, samp)
    drafts = jnp.asarray(rng.integers(0, V, (B, K)), jnp.int32)
    nd = jnp.asarray(rng.integers(0, K + 1, B), jnp.int32)
    fp = jnp.asarray(rng.integers(1, 100, B), jnp.int32)
    t1, n1, _ = _verify_jit(logits, drafts, nd, samp, fp, draft_probs=q)
    t2, n2 = _wrong_jit(logits, drafts, nd, samp, fp, q, residual_is_p=False)
    np.testing.assert_array_equal(np.asarray(n1), np.asarray(n2))
    np.testing.assert_array_equal(np.asarray(t1), np.asarray(t2))
    t3, n3 = _wrong_jit(logits, drafts, nd, samp, fp, q, residual_is_p=True)
    np.testing.assert_array_equal(np.asarray(n1), np.asarray(n3))  # same acceptances ...
    assert (np.asarray(t1) != np.asarray(t3)).any()  # ... different corrections


# ---------------------------------------------------------------- wrong rules: must fail

WRONG = {
    # Correction drawn from p instead of norm(max(p - q, 0)) after a rejection.
    "residual-is-p-K1": ([TEMP], 1, dict(rule=RESID_P)),
    "residual-is-p-K3": ([TEMP], 3, dict(rule=RESID_P)),
    # Drafts sampled from the warped q but the acceptance ratio / residual use the unwarped
    # draft softmax (warping forgotten on the draft side).
    "unwarped-q-K1": ([TOPK], 1, dict(rule=RAW_Q)),
    "unwarped-q-K3": ([TOPK], 3, dict(rule=RAW_Q)),
}
WRONG_P: dict[str, float] = {}


@pytest.mark.parametrize("case", list(WRONG), ids=list(WRONG))
def test_wrong_rule_fails_the_same_test(case):
    groups, K, opts = WRONG[case]
    pvals, _, _ = run_case(groups, K=K, seed=100 + len(case), **opts)
    WRONG_P[case] = pvals[0]
    print(f"wrong rule {case}: p = {pvals[0]:.3g}")
    assert pvals[0] < P_WRONG, f"the chi-square test failed to detect the wrong rule {case} (p={pvals[0]:.3g})"


# ---------------------------------------------------------------- greedy rows (exact)


def _greedy_case():
    rng = np.random.default_rng(7)
    B, K, Vg = 8, 4, 32
    logits = rng.standard_normal((B, K + 1, Vg)).astype(np.float32)
    g = logits.argmax(-1)
    drafts = rng.integers(0, Vg, (B, K)).astype(np.int32)
    # Make drafts differ from the argmax everywhere, then plant matching prefixes.
    drafts = np.where(drafts == g[:, :K], (drafts + 1) % Vg, drafts)
    match_len = [4, 0, 2, 4, 1, 2, 4, 4]
    num_draft = [4, 4, 4, 2, 4, 4, 0, 3]
    for b in range(B):
        drafts[b, :match_len[b]] = g[b, :match_len[b]]
    drafts[5, 3] = g[5, 3]  # a match *after* the mismatch at index 2 must not count
    want_n = np.minimum(match_len, num_draft)
    return logits, drafts, np.asarray(num_draft, np.int32), g, want_n


def test_greedy_rows_return_target_argmax_chain():
    logits, drafts, num_draft, g, want_n = _greedy_case()
    B, K1, _ = logits.shape
    samp = samp_arrays([GREEDY] * B, np.arange(B))
    fp = jnp.arange(B, dtype=jnp.int32) + 5
    for greedy_only in (False, True):
        tokens, n, valid = _verify_jit(jnp.asarray(logits), jnp.asarray(drafts), jnp.asarray(num_draft), samp, fp,
                                        greedy_only=greedy_only)
        tokens, n, valid = np.asarray(tokens), np.asarray(n), np.asarray(valid)
        np.testing.assert_array_equal(n, want_n)
        np.testing.assert_array_equal(valid, np.arange(K1)[None, :] <= want_n[:, None])
        for b in range(B):
            # Accepted drafts then the target's argmax at the first mismatch (or the bonus).
            np.testing.assert_array_equal(tokens[b, :n[b] + 1], g[b, :n[b] + 1])


def test_mixed_greedy_and_sampled_rows_behave_per_row():
    logits, drafts, num_draft, g, want_n = _greedy_case()
    B, K1, Vg = logits.shape
    rng = np.random.default_rng(8)
    q = probs_from_logits(jnp.asarray(rng.standard_normal((B, K1 - 1, Vg)).astype(np.float32)),
                          samp_arrays([TEMP] * B, [0] * B))
    seeds = np.arange(B) + 100
    fp = jnp.arange(B, dtype=jnp.int32) + 5
    mixed = [GREEDY if b % 2 == 0 else (TEMP, TOPK, TOPP, BOTH)[b // 2] for b in range(B)]
    sampled_only = [TEMP if p[0] == 0 else p for p in mixed]
    args = (jnp.asarray(logits), jnp.asarray(drafts), jnp.asarray(num_draft))
    tm, nm, vm = map(np.asarray, _verify_jit(*args, samp_arrays(mixed, seeds), fp, draft_probs=q))
    tg, ng, _ = map(np.asarray, _verify_jit(*args, samp_arrays([GREEDY] * B, seeds), fp, draft_probs=q))
    ts, ns, _ = map(np.asarray, _verify_jit(*args, samp_arrays(sampled_only, seeds), fp, draft_probs=q))
    greedy = np.array([p[0] == 0 for p in mixed])
    np.testing.assert_array_equal(nm[greedy], want_n[greedy])
    np.testing.assert_array_equal(nm[greedy], ng[greedy])
    np.testing.assert_array_equal(nm[~greedy], ns[~greedy])
    for b in range(B):
        ref = tg if greedy[b] else ts
        np.testing.assert_array_equal(tm[b, :nm[b] + 1], ref[b, :nm[b] + 1])
        np.testing.assert_array_equal(vm[b], np.arange(K1) <= nm[b])
        np.testing.assert_array_equal(tm[b, :nm[b]], drafts[b, :nm[b]])
    # The sampled rows really are sampled: with these drafts (far from the target argmax) the
    # sampled rows do not all reproduce the greedy outcome.
    assert (ns[~greedy] != ng[~greedy]).any() or (ts[~greedy, 0] != tg[~greedy, 0]).any()
