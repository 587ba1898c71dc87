"""SmartSpec goodput (seed 000 §4.3-4.4, Algorithms 1-3): expected generated length, acceptance
estimators, the linear performance model and the K selector. Pure numpy; no model is run."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from specjax.errors import SpecjaxError
from specjax.goodput.acceptance import (AcceptanceEstimator, MovingAverage, ScoreCalibration, TreeNodeRates,
                                        confidence_lengths,
                                        expected_len, expected_len_from_positions, tree_batched_tokens,
                                        tree_expected_len)
from specjax.engine.spec import DrafterSpec, EngineSpec, PolicySpec
from specjax.engine.profiling import row_op_cells
from specjax.goodput.perf_model import (CostCalibration, LinearCost, ProfiledCost, StepCostModel, context_tokens, fit_linear,
                                        fit_step_model, load_profiled, prefill_table_cells, save_table,
                                        table_cells,
                                        least_squares, load_model, r_squared, save_model)
from specjax.goodput.selector import BatchView, DraftPrefillGate, FixedK, GoodputPolicy

N_MC = 200_000


# ----------------------------------------------------------------------------- helpers


def _geom_sum(alpha: float, k: int) -> float:
    """sum_{j=0..k} alpha^j, written independently of the closed form under test."""
    return float(sum(alpha**j for j in range(k + 1)))


def _mc_chain(rng, alpha: float, k: int, n: int = N_MC) -> np.ndarray:
    """Generated tokens of a k-draft chain with i.i.d. Bernoulli(alpha) acceptance: the leading
    run of accepted drafts, plus the bonus token."""
    acc = rng.random((n, k)) < alpha
    return 1 + np.cumprod(acc, axis=1).sum(axis=1)


def _mc_tree(rng, alphas, ks, n: int = N_MC) -> np.ndarray:
    """Generated tokens of a full top-k tree: head i has ks[i] candidates, each accepted w.p.
    alphas[i] independently; 1 + number of leading heads with at least one accepted candidate."""
    hits = np.stack([(rng.random((n, k)) < a).any(axis=1) for a, k in zip(alphas, ks)], axis=1)
    return 1 + np.cumprod(hits, axis=1).sum(axis=1)


def _assert_mc(samples: np.ndarray, expected: float, abs_tol: float = 0.02) -> None:
    se = samples.std() / math.sqrt(samples.size)
    err = abs(samples.mean() - expected)
    assert err < 5 * se + 1e-12, (samples.mean(), expected, se)
    assert err < abs_tol, (samples.mean(), expected)


# ----------------------------------------------------------------------------- expected length (Eq. 8)


def test_expected_len_edge_cases():
    for a in (0.0, 0.3, 0.9, 1.0):
        assert expected_len(a, 0) == 1.0
    for k in (1, 2, 5, 10):
        assert expected_len(0.0, k) == 1.0
        assert expected_len(1.0, k) == float(k + 1)
        # Out-of-range rates are clamped, and the closed form is continuous at alpha -> 1.
        assert expected_len(1.5, k) == float(k + 1)
        assert expected_len(-0.2, k) == 1.0
        assert expected_len(1 - 1e-9, k) == pytest.approx(k + 1, rel=1e-6)


@pytest.mark.parametrize("alpha", [0.05, 0.3, 0.5, 0.7, 0.85, 0.99])
@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_expected_len_geometric_sum(alpha, k):
    assert expected_len(alpha, k) == pytest.approx(_geom_sum(alpha, k), rel=1e-12)


@pytest.mark.parametrize("alpha,k", [(0.2, 3), (0.5, 1), (0.6, 4), (0.8, 5), (0.9, 8)])
def test_expected_len_matches_monte_carlo(alpha, k):
    rng = np.random.default_rng(1234 + k)
    _assert_mc(_mc_chain(rng, alpha, k), expected_len(alpha, k))


def test_expected_len_from_positions():
    for a in (0.0, 0.25, 0.6, 0.95):
        for k in (0, 1, 3, 6):
            assert expected_len_from_positions([a] * max(k, 1), k) == pytest.approx(expected_len(a, k), rel=1e-12)
            # Positions past the measured ones reuse the last rate.
            assert expected_len_from_positions([a], k) == pytest.approx(expected_len(a, k), rel=1e-12)
    rates = [0.9, 0.5, 0.2]
    assert expected_len_from_positions(rates, 0) == 1.0
    assert expected_len_from_positions(rates, 2) == pytest.approx(1 + 0.9 + 0.45)
    assert expected_len_from_positions(rates, 3) == pytest.approx(1 + 0.9 + 0.45 + 0.09)
    assert expected_len_from_positions(rates, 5) == pytest.approx(1 + 0.9 + 0.45 + 0.09 + 0.018 + 0.0036)
    assert expected_len_from_positions([], 4) == 1.0


# ----------------------------------------------------------------------------- trees (Eq. 10)


def test_tree_chain_reduces_to_positions_and_eq8():
    alphas = [0.9, 0.7, 0.4, 0.8]
    assert tree_expected_len(alphas, [1] * 4) == pytest.approx(expected_len_from_positions(alphas, 4), rel=1e-12)
    for a in (0.0, 0.3, 0.75, 1.0):
        for h in (1, 2, 5):
            assert tree_expected_len([a] * h, [1] * h) == pytest.approx(expected_len(a, h), rel=1e-12)
    assert tree_expected_len([], []) == 1.0


def test_tree_expected_len_hand_computed():
    # hit1 = 1 - 0.5^2 = 0.75, hit2 = 0.5:
    # l = 1 * 0.25 + 2 * (0.75 * 0.5) + 3 * (0.75 * 0.5) = 0.25 + 0.75 + 1.125
    assert tree_expected_len([0.5, 0.5], [2, 1]) == pytest.approx(2.125, rel=1e-12)
    # One head, three candidates at alpha 0.5: hit = 0.875 -> l = 1 * 0.125 + 2 * 0.875.
    assert tree_expected_len([0.5], [3]) == pytest.approx(1.875, rel=1e-12)
    # A head with no candidates cuts the tree there.
    assert tree_expected_len([0.5, 0.9], [2, 0]) == pytest.approx(1.75, rel=1e-12)
    with pytest.raises(ValueError):
        tree_expected_len([0.5, 0.5], [1])


@pytest.mark.parametrize("alphas,ks", [((0.5, 0.5), (2, 1)), ((0.6, 0.4, 0.7), (3, 2, 3)),
                                       ((0.3, 0.3, 0.3, 0.3), (4, 3, 2, 1)), ((0.8, 0.5, 0.9), (1, 0, 2))])
def test_tree_expected_len_matches_monte_carlo(alphas, ks):
    rng = np.random.default_rng(sum(ks) * 17 + len(ks))
    _assert_mc(_mc_tree(rng, alphas, ks), tree_expected_len(alphas, ks))


def test_tree_batched_tokens():
    assert tree_batched_tokens([3, 2, 2]) == 3 + 3 * 2 + 3 * 2 * 2 == 21
    assert tree_batched_tokens([3, 2, 3]) == 27  # the paper's Figure 8 example
    assert tree_batched_tokens([1, 1, 1, 1]) == 4  # a chain verifies its drafts
    assert tree_batched_tokens([]) == 0


# ----------------------------------------------------------------------------- estimators (Algorithms 1, 3)


def test_moving_average_window_and_prior():
    m = MovingAverage(window=3, prior=0.2)
    assert m.value == 0.2 and len(m) == 0
    m.add(1.0)
    assert m.value == 1.0
    for x in (2.0, 3.0, 4.0):
        m.add(x)
    assert len(m) == 3
    assert m.value == pytest.approx(3.0)  # mean of the last three
    with pytest.raises(ValueError):
        MovingAverage(window=0)
    # the prior as pseudo-observations: as 3 before any real one, fading out as they come in
    p = MovingAverage(window=8, prior=0.5, prior_weight=3)
    assert p.value == 0.5
    p.add(0.0)
    assert p.value == pytest.approx(1.0 / 3)  # (0 + 2 x 0.5) / 3, where the mean alone says 0
    p.add(1.0)
    assert p.value == pytest.approx(1.5 / 3)
    for x in (0.0, 0.0):
        p.add(x)
    assert p.value == pytest.approx(0.25)  # real observations only from prior_weight on
    with pytest.raises(ValueError):
        MovingAverage(prior_weight=-1)


def test_acceptance_counts_add_merge_and_metrics():
    """One step's counts and their metrics, and merge = the counts of both steps taken at once
    (per-position counts aligned by position, whatever their lengths)."""
    from specjax.goodput import AcceptanceCounts

    a = AcceptanceCounts().add([3, 0, 2], [1, 0, 2], 3, emitted=6, draft_lens=[3, 0, 2])
    b = AcceptanceCounts().add([5], [5], 5, emitted=6)
    k0 = AcceptanceCounts().add([0, 0], [0, 0], 0, emitted=2)
    assert (a.steps, a.offered, a.proposed, a.drafted, a.accepted, a.examined) == (3, 3, 2, 5, 3, 4)
    assert a.acceptance_rate == pytest.approx(3 / 5) and a.examined_rate == pytest.approx(3 / 4)
    assert a.per_position_acceptance == pytest.approx([1.0, 0.5, 0.0])
    assert a.conditional_acceptance == pytest.approx([1.0, 0.5, 0.0])
    assert a.mean_accepted_tokens == pytest.approx(2.0) and a.propose_rate == pytest.approx(2 / 3)
    assert a.draft_len_dist == pytest.approx((1 / 3, 0.0, 1 / 3, 1 / 3)) and b.draft_len_dist is None
    m = AcceptanceCounts.merged([a, b, k0])
    whole = AcceptanceCounts().add([3, 0, 2, 5], [1, 0, 2, 5], 3, emitted=12, draft_lens=[3, 0, 2])
    whole.add([0, 0], [0, 0], 0, emitted=2)
    for f in ("steps", "offered", "proposed", "drafted", "accepted", "examined", "emitted"):
        assert getattr(m, f) == getattr(whole, f), f
    for f in ("pos_drafted", "pos_accepted", "pos_examined", "draft_lens"):
        assert getattr(m, f).tolist() == getattr(whole, f).tolist(), f
    assert m.steps == 6 and m.offered == 4 and m.mean_accepted_tokens == pytest.approx((8 + 6) / 6)
    assert m.summary() == {"steps": 6, "drafted": 10, "accepted": 8, "acceptance_rate": 0.8,
                           "mean_accepted_tokens": m.mean_accepted_tokens,
                           "per_position_acceptance": m.per_position_acceptance}
    assert a.merge(b) is a and a.drafted == 10  # in place
    empty = AcceptanceCounts()
    assert (empty.acceptance_rate, empty.examined_rate, empty.mean_accepted_tokens, empty.propose_rate) == (0, 0, 0, 0)


def test_acceptance_estimator_observe():
    est = AcceptanceEstimator(window=4, prior_alpha=0.3)
    assert est.alpha.value == 0.3 and est.rho.value == 1.0
    est.observe(drafted=[4, 4], accepted=[4, 4], offered=0)  # K = 0: nothing to learn
    est.observe(drafted=[], accepted=[], offered=4)
    assert len(est.alpha) == 0 and len(est.rho) == 0
    est.observe(drafted=[4, 0, 2, 4], accepted=[2, 0, 2, 1], offered=4)
    assert est.rho.value == pytest.approx(0.75)
    # Examined positions: row 0 accepted 2 then a rejection, row 2 all 2, row 3 one then a
    # rejection; row 1 proposed nothing and is not counted: 5 / (5 + 2).
    assert est.alpha.value == pytest.approx(5 / 7)
    est.observe(drafted=[3, 3], accepted=[0, 0], offered=3)
    assert est.alpha.value == pytest.approx((5 / 7 + 0.0) / 2)
    assert est.rho.value == pytest.approx((0.75 + 1.0) / 2)
    est.observe(drafted=[0, 0], accepted=[0, 0], offered=2)  # nobody proposed: rho only
    assert len(est.alpha) == 2
    assert est.rho.value == pytest.approx((0.75 + 1.0 + 0.0) / 3)


def test_acceptance_estimator_per_request():
    est = AcceptanceEstimator(window=8, prior_alpha=0.5, per_request=True, min_request_obs=2)
    est.observe([4, 4], [4, 0], offered=4, request_ids=["a", "b"])
    glob = est.alpha.value
    assert glob == pytest.approx(4 / 5)  # 4 accepted; row b rejected its first
    assert est.request_alpha("a") == glob  # one observation < min_request_obs: global
    assert est.request_alpha("zzz") == glob
    est.observe([2, 2, 0], [2, 0, 0], offered=2, request_ids=["a", "b", "c"])
    assert est.request_alpha("a") == pytest.approx(1.0)
    assert est.request_alpha("b") == pytest.approx(0.0)
    assert est.request_alpha("c") == est.alpha.value  # proposed nothing: no own estimate
    est.forget("a")
    assert est.request_alpha("a") == est.alpha.value


def test_reprobe_and_the_prior_weight_reach_the_per_request_estimates():
    """With a prior weight, a request's own estimate starts from the global one as that many
    observations (its first rejections do not read 0), and a re-probe takes every estimate back
    to the prior: the per-request ones outrank the global one, so a request whose first drafts
    were rejected never drafted again when only the global one was reset."""
    est = AcceptanceEstimator(window=8, prior_alpha=0.5, per_request=True, min_request_obs=2, prior_weight=4)
    for _ in range(2):
        est.observe([1], [0], offered=1, request_ids=["a"], classes=[3])
    glob = 0.5 * 2 / 4  # two rejections and two of the prior's four observations
    assert est.alpha.value == pytest.approx(glob)
    # its own: from the global estimate after its first step (0.375) as 4 observations, two rejections
    assert est.request_alpha("a") == pytest.approx(0.375 * 2 / 4)
    assert est.request_alpha("a", 3) == pytest.approx(est.request_alpha("a"))
    est.reprobe()
    assert est.alpha.value == est.request_alpha("a") == est.request_alpha("a", 3) == 0.5
    pol = GoodputPolicy(_cost(a=0.0, g=1e-6, d=1e-2), window=4, prior_alpha=0.6, reprobe_after=3, per_request=True,
                        prior_weight=2)
    view = BatchView(ctx_lens=[10], bucket=1, k_options=(0, 4), request_ids=["r"])
    for _ in range(3):
        pol.observe(4, [4], [0], request_ids=["r"])
    assert pol.acc.request_alpha("r") == 0.0 and pol.choose(view) == 0
    for _ in range(3):
        pol.observe(0, [0], [0], request_ids=["r"])
    assert pol.acc.request_alpha("r") == pytest.approx(0.6) and pol.choose(view) == 4


def test_acceptance_per_draft_class_outranks_the_request():
    """Prompt lookup's n-gram length (a draft class) predicts acceptance better than the
    request: a class with its own observations decides; an unseen class falls back."""
    est = AcceptanceEstimator(window=8, prior_alpha=0.5, per_request=True, min_request_obs=2)
    for _ in range(2):
        est.observe([2, 2], [2, 0], offered=2, request_ids=["a", "a"], classes=[3, 1])
    assert est.request_alpha("a", 3) == pytest.approx(1.0) and est.request_alpha("a", 1) == pytest.approx(0.0)
    assert est.request_alpha("a", 2) == est.request_alpha("a") == pytest.approx(0.5)  # unseen class: the request
    # The policy verifies the 3-gram match's drafts and not the 1-gram one's, on the same request.
    pol = GoodputPolicy(_cost(g=1e-3, d=3e-3), per_request=True)
    for _ in range(4):
        pol.choose(BatchView(ctx_lens=[10, 10], bucket=2, k_options=(0, 2), request_ids=["x", "y"],
                             draft_lens=[2, 2], draft_classes=[3, 1]))
        pol.observe(2, [2, 2], [2, 0], ["x", "y"])  # classes: those of the choice
    view = lambda c: BatchView(ctx_lens=[10], bucket=1, k_options=(0, 2), request_ids=["z"], draft_lens=[2],
                               draft_classes=[c])
    assert pol.choose(view(3)) == 2 and pol.choose(view(1)) == 0
    pol.observe(2, [2], [0], ["z"], classes=[3])  # a shadow-verified older proposal names its own class
    assert len(pol.acc._cls[3]) == 5


def test_smartspec_wants_a_k_still_being_built_only_where_it_would_pay():
    """While a K bucket is still to be built (``view.k_coming``), SmartSpec chooses among the
    compiled options and names the coming K it would have taken (``want_k``: a backend building
    K steps on demand builds that one); where verification costs more than drafts can earn, it
    wants none."""
    view = BatchView(ctx_lens=[10], bucket=1, k_options=(0,), k_coming=(2, 4), request_ids=["a"], draft_lens=[4])
    pays = GoodputPolicy(_cost(g=1e-5, d=1e-2), prior_alpha=0.9)
    assert pays.choose(view) == 0 and pays.want_k in (2, 4)
    dear = GoodputPolicy(_cost(g=1.0, d=1e-2), prior_alpha=0.9)
    assert dear.choose(view) == 0 and dear.want_k == 0


def test_confidence_lengths():
    nan = np.nan
    conf = np.array([[0.9, 0.8, 0.1, 0.9],
                     [0.2, 0.9, 0.9, 0.9],
                     [0.9, 0.9, 0.9, 0.9],
                     [nan, 0.9, 0.9, 0.9],
                     [0.9, nan, nan, nan],
                     [0.9, 0.5, 0.9, 0.9]])  # == threshold is not above it
    np.testing.assert_array_equal(confidence_lengths(conf, 0.5), [2, 0, 4, 0, 1, 1])
    np.testing.assert_array_equal(confidence_lengths(conf, 0.95), [0] * 6)
    np.testing.assert_array_equal(confidence_lengths(conf, -1.0), [4] * 6)  # NaN -> 0 > -1
    with pytest.raises(ValueError):
        confidence_lengths(np.array([0.9, 0.9]), 0.5)


# ----------------------------------------------------------------------------- performance model (Eq. 7)

TRUE_A, TRUE_G, TRUE_D = 2.0e-6, 5.0e-5, 3.0e-3


def _grid():
    nc, nb = np.meshgrid(np.arange(0, 40_000, 2_500, dtype=float), 2.0 ** np.arange(0, 10))
    return nc.ravel(), nb.ravel()


def test_fit_linear_noiseless_exact():
    nc, nb = _grid()
    t = TRUE_A * nc + TRUE_G * nb + TRUE_D
    fit = fit_linear(nc, nb, t)
    assert fit.alpha == pytest.approx(TRUE_A, rel=1e-9)
    assert fit.gamma == pytest.approx(TRUE_G, rel=1e-9)
    assert fit.delta == pytest.approx(TRUE_D, rel=1e-9)
    assert fit(1234.0, 56.0) == pytest.approx(TRUE_A * 1234 + TRUE_G * 56 + TRUE_D, rel=1e-9)


def test_fit_linear_noisy_recovery_and_r_squared():
    rng = np.random.default_rng(0)
    nc, nb = _grid()
    noise = 2e-5  # ~0.1-0.5 % of the times
    t = TRUE_A * nc + TRUE_G * nb + TRUE_D + rng.normal(0, noise, nc.size)
    fit = fit_linear(nc, nb, t)
    assert fit.alpha == pytest.approx(TRUE_A, rel=1e-2)
    assert fit.gamma == pytest.approx(TRUE_G, rel=1e-2)
    assert fit.delta == pytest.approx(TRUE_D, rel=1e-2)
    # Held-out points, off the grid.
    hc = rng.uniform(0, 40_000, 200)
    hb = rng.uniform(1, 512, 200)
    ht = TRUE_A * hc + TRUE_G * hb + TRUE_D + rng.normal(0, noise, 200)
    pred = np.array([fit(c, b) for c, b in zip(hc, hb)])
    assert r_squared(ht, pred) > 0.99
    assert r_squared(ht, ht.mean() + 0 * ht) == pytest.approx(0.0)  # the mean explains nothing
    assert math.isnan(r_squared(np.ones(4), np.ones(4)))


def test_least_squares_nonneg_drops_negative_column():
    rng = np.random.default_rng(1)
    x1 = rng.uniform(1, 10, 50)
    x2 = rng.uniform(1, 10, 50)
    X = np.stack([x1, x2, np.zeros(50)], axis=1)  # the all-zero column cannot be identified
    y = 2.0 * x1 - 0.5 * x2
    free = least_squares(X, y, nonneg=False)
    np.testing.assert_allclose(free, [2.0, -0.5, 0.0], atol=1e-9)
    c = least_squares(X, y, nonneg=True)
    assert c[1] == 0.0 and c[2] == 0.0 and (c >= 0).all()
    expected_c0 = float(x1 @ y / (x1 @ x1))  # refit on x1 alone
    assert c[0] == pytest.approx(expected_c0, rel=1e-9)


def test_least_squares_relative_error():
    # A cost the line cannot hold exactly: a per-step charge that grows slower than the rows. By
    # absolute error the large (batch 8) steps set the line and the small ones are far off; by
    # relative error every step counts alike (what goodput, comparing steps of one batch, needs).
    rows = np.array([b * (k + 1) for b in (1, 2, 4, 8) for k in range(6)], float)
    X = np.stack([rows, np.ones_like(rows)], axis=1)
    y = 0.004 + 0.002 * rows ** 0.8
    absolute, relative = least_squares(X, y), least_squares(X, y, relative=True)
    rel_err = lambda c: (X @ c - y) / y  # noqa: E731
    assert np.sum(rel_err(relative) ** 2) < np.sum(rel_err(absolute) ** 2)
    assert np.sum((X @ absolute - y) ** 2) < np.sum((X @ relative - y) ** 2)
    small = rows <= 4
    assert np.abs(rel_err(relative))[small].max() < 0.5 * np.abs(rel_err(absolute))[small].max()
    exact = np.array([3e-3, 1e-3])  # a line is recovered either way
    np.testing.assert_allclose(least_squares(X, X @ exact, relative=True), exact, rtol=1e-9)
    with pytest.raises(SpecjaxError):
        least_squares(X, np.zeros_like(y), relative=True)


def test_context_tokens_modes():
    assert context_tokens([100, 300, 5], 4, "sum") == 405.0
    assert context_tokens([100, 300, 5], 4, "padded", chunk=256) == 4 * 256 * 2
    assert context_tokens([256, 1], 8, "padded", chunk=256) == 8 * 256 * 1
    assert context_tokens([257], 2, "padded", chunk=128) == 2 * 128 * 3
    assert context_tokens([], 4, "sum") == 0.0
    assert context_tokens([], 4, "padded") == 0.0
    with pytest.raises(SpecjaxError):
        context_tokens([1], 1, "paged")


def test_fit_step_model_recovers_target_and_draft():
    true_t = np.array([2.0e-6, 4.0e-5, 2.0e-3])
    true_d = np.array([5.0e-7, 1.0e-5, 1.0e-3])
    coef = np.concatenate([true_t, true_d])
    base = StepCostModel(target=LinearCost(), context_mode="sum")
    rng = np.random.default_rng(7)
    feats, times, rows = [], [], []
    for bucket in (1, 2, 4, 8, 16):
        for k in (0, 1, 2, 3, 5):
            for device_draft in (True, False):
                for _ in range(2):
                    ctx = list(rng.integers(1, 3000, size=bucket))
                    f = base.step_features(bucket, k, ctx, device_draft)
                    feats.append(f)
                    times.append(float(f @ coef))
                    rows.append((bucket, k, ctx, device_draft))
    fitted = fit_step_model(np.array(feats), np.array(times), base)
    np.testing.assert_allclose([fitted.target.alpha, fitted.target.gamma, fitted.target.delta], true_t, rtol=1e-6)
    assert fitted.draft is not None
    np.testing.assert_allclose([fitted.draft.alpha, fitted.draft.gamma, fitted.draft.delta], true_d, rtol=1e-6)
    for (bucket, k, ctx, device_draft), t in zip(rows, times):
        if device_draft:
            assert fitted.device_time(bucket, k, ctx) == pytest.approx(t, rel=1e-6)
        else:
            assert fitted.target_time(bucket, k, ctx) == pytest.approx(t, rel=1e-6)
    # The draft forwards of device_time, written out: 2 tokens per row first, then 1.
    ctx = [100, 200]
    d = LinearCost(*true_d)
    manual = sum(d(sum(c + i for c in ctx), 2 * (2 if i == 0 else 1)) for i in range(3))
    assert fitted.draft_time(2, 3, ctx) == pytest.approx(manual, rel=1e-6)

    # No device-draft rows: the draft of the base model is kept.
    host = [f for f, r in zip(feats, rows) if not r[3]]
    host_t = [t for t, r in zip(times, rows) if not r[3]]
    base2 = StepCostModel(target=LinearCost(), draft=LinearCost(9.0, 9.0, 9.0))
    kept = fit_step_model(np.array(host), np.array(host_t), base2)
    assert kept.draft == LinearCost(9.0, 9.0, 9.0)
    assert kept.target.gamma == pytest.approx(true_t[1], rel=1e-6)


def test_save_load_round_trip(tmp_path):
    path = str(tmp_path / "perf.json")
    m1 = StepCostModel(target=LinearCost(1e-6, 2e-5, 3e-3), draft=LinearCost(4e-7, 5e-6, 6e-4),
                       host_step=1e-4, host_row=2e-6, prefill=LinearCost(0.0, 1e-5, 1e-3), context_mode="padded",
                       chunk=128)
    m2 = StepCostModel(target=LinearCost(7e-6, 8e-5, 9e-3), host_draft=1.5e-3)
    save_model(path, "tiny|draft|cpu:cpu", m1, meta={"r2": 0.99})
    save_model(path, "tiny|pld|cpu:cpu", m2)
    assert load_model(path, "tiny|draft|cpu:cpu") == m1
    assert load_model(path, "tiny|pld|cpu:cpu") == m2
    with open(path) as f:
        data = json.load(f)
    assert set(data) == {"tiny|draft|cpu:cpu", "tiny|pld|cpu:cpu"}
    assert data["tiny|draft|cpu:cpu"]["meta"] == {"r2": 0.99}
    # Overwriting one key keeps the other.
    m3 = StepCostModel(target=LinearCost(1.0, 1.0, 1.0))
    save_model(path, "tiny|draft|cpu:cpu", m3)
    assert load_model(path, "tiny|draft|cpu:cpu") == m3
    assert load_model(path, "tiny|pld|cpu:cpu") == m2


def test_registry_policies_are_keyed_by_their_device_draft(tmp_path):
    """Each device draft gets its own performance model (the layer count, the draft model's
    name); host drafters share the target-only one. Every named SmartSpec policy keeps alphas
    per request; only smartspec-req also sets per-request draft counts."""
    from specjax import registry

    def label(name, **knobs):
        return registry.perf_model_label(DrafterSpec(name=name, **knobs))

    assert label("hybrid") == label("suffix") == "prompt_lookup"
    assert label("layer_skip", draft_layers=12) == "layer_skip12"
    assert label("draft_model", draft_model="/w/coder-0.5b.gguf") == "draft_model:coder-0.5b.gguf"
    # hybrid_eagle runs the EAGLE head's chain steps; a head's trees are costed apart from its chains
    assert label("hybrid_eagle") == label("eagle") == "eagle"
    assert label("eagle", eagle_tree_width=3, eagle_tree_depth=3) == "eagle_tree3x3"
    assert label("medusa") == "medusa_tree" and label("medusa", medusa_tree=False) == "medusa"
    tree = DrafterSpec(name="eagle", eagle_tree_width=3, eagle_tree_depth=3)
    assert registry.chain_of(tree) == DrafterSpec(name="eagle", eagle_tree_depth=3)
    assert registry.chain_of(DrafterSpec(name="eagle")) is None and registry.chain_of(DrafterSpec("suffix")) is None
    assert registry.model_name("smollm2-135m") == "smollm2-135m"
    path = str(tmp_path / "perf.json")
    save_model(path, "other", StepCostModel(target=LinearCost()))

    def spec(policy):
        return EngineSpec(model="t.gguf", drafter=DrafterSpec("draft_model", k=8, draft_model="/w/d.gguf"),
                          policy=PolicySpec(policy, perf_models=path))

    pol, label, note = registry.build_policy(spec("auto"), "t.gguf")
    assert isinstance(pol, FixedK) and "t.gguf|draft_model:d.gguf|" in note
    save_model(path, registry.perf_key(spec("auto"), "t.gguf"), StepCostModel(target=LinearCost()))
    for name, req_k in (("auto", False), ("smartspec", False), ("smartspec-req", True)):
        pol, label, note = registry.build_policy(spec(name), "t.gguf")
        assert note is None and pol.acc.per_request and pol.per_request_k == req_k


def test_a_profile_of_other_compiled_code_is_refused_or_noted_never_used(tmp_path):
    """The performance-model key carries the compiled code (forward options, dtype, layout): a
    profile written for the XLA dot is not found by a serving spec with the rows kernel on.
    --policy smartspec refuses in one line naming the difference and the profile command;
    auto falls back to fixed K with a note saying the same; neither costs steps with it."""
    import dataclasses

    from specjax import registry
    from specjax.models.options import ForwardOptions

    path = str(tmp_path / "perf.json")
    profiled = EngineSpec(model="tiny-random", drafter=DrafterSpec("prompt_lookup", k=8))
    save_model(path, registry.perf_key(profiled, "tiny-random"), StepCostModel(target=LinearCost()))
    profiled = dataclasses.replace(profiled, policy=PolicySpec("smartspec", perf_models=path))
    assert isinstance(registry.build_policy(profiled, "tiny-random")[0], GoodputPolicy)  # the same code: used
    serving = dataclasses.replace(profiled, fwd=ForwardOptions(rows_kernel=32))
    with pytest.raises(SpecjaxError) as e:
        registry.build_policy(serving, "tiny-random")
    msg = str(e.value)
    assert "\n" not in msg and "other compiled code" in msg and "rows_kernel 0 (profiled) vs 32" in msg
    assert "launch/profile.py --model tiny-random --drafters prompt_lookup" in msg and "--rows_kernel 32" in msg
    pol, label, note = registry.build_policy(dataclasses.replace(serving, policy=PolicySpec("auto", perf_models=path,
                                                                                             fallback_k=4)),
                                             "tiny-random")
    assert isinstance(pol, FixedK) and pol.k == 4 and label == "K=4 (auto)"
    assert "rows_kernel 0 (profiled) vs 32" in note and "instead of SmartSpec" in note
    # a CPU's key names its vector class: a model of the same code profiled on another class is
    # named in the error, never used
    from specjax.goodput.perf_model import hardware_key
    from specjax.models.cpu.rows_dot import simd_class

    assert hardware_key() == f"cpu:{simd_class()}" and simd_class() in ("avx512", "avx2", "portable")
    other_hw = str(tmp_path / "other_hw.json")
    key = registry.perf_key(profiled, "tiny-random").split("|")
    save_model(other_hw, "|".join(key[:2] + ["cpu:elsewhere"] + key[3:]), StepCostModel(target=LinearCost()))
    with pytest.raises(SpecjaxError, match=f"hardware cpu:elsewhere \\(profiled\\) vs {hardware_key()}"):
        registry.build_policy(dataclasses.replace(profiled, policy=PolicySpec("smartspec", perf_models=other_hw)),
                              "tiny-random")
    # a key of the old format (no compiled code) matches nothing
    old = str(tmp_path / "old.json")
    save_model(old, "tiny-random|prompt_lookup|" + registry.perf_key(profiled, "x").split("|")[2],
               StepCostModel(target=LinearCost()))
    with pytest.raises(SpecjaxError, match="no performance model for"):
        registry.build_policy(dataclasses.replace(profiled, policy=PolicySpec("smartspec", perf_models=old)),
                              "tiny-random")


def test_a_named_perf_models_file_that_is_not_one_is_an_error(tmp_path):
    """--perf_models naming a file that is not a performance-model store is a one-line error when
    the spec is built (before any model load), never a silent fixed K (issue 33)."""
    for text in ('{"runs": [1, 2]}', '[1, 2]', '{"k": {"model": {"target": {"nope": 1}}}}', 'not json'):
        path = tmp_path / "perf.json"
        path.write_text(text)
        with pytest.raises(SpecjaxError, match="--perf_models") as e:
            PolicySpec("auto", perf_models=str(path))
        assert "\n" not in str(e.value)
    save_model(str(path := tmp_path / "good.json"), "k", StepCostModel(target=LinearCost()))
    assert PolicySpec("auto", perf_models=str(path)).perf_models == str(path)


def test_load_model_errors(tmp_path):
    missing = str(tmp_path / "nope.json")
    with pytest.raises(SpecjaxError, match="does not exist"):
        load_model(missing, "k")
    path = str(tmp_path / "perf.json")
    save_model(path, "have", StepCostModel(target=LinearCost()))
    with pytest.raises(SpecjaxError, match=r"no performance model for 'want'.*have"):
        load_model(path, "want")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SpecjaxError, match="not valid JSON"):
        load_model(str(bad), "k")


def test_profiled_table_lookup_and_fallback(tmp_path):
    """The simulator's profiled cost: medians per (bucket, K, context chunks), the fitted line
    off the grid and for prefill, and its own host terms; saved beside the linear model."""
    lin = StepCostModel(target=LinearCost(1e-6, 1e-3, 1e-2), prefill=LinearCost(0.0, 2e-3, 3e-2),
                        context_mode="padded", chunk=256, host_step=5e-3)
    recs = [{"B": 2, "K": 1, "ctx_lens": [10, 200], "t": t} for t in (0.030, 0.050, 0.031)]
    recs += [{"B": 2, "K": 1, "ctx_lens": [300, 5], "t": 0.070}]  # 2 chunks: its own cell
    recs += [{"B": 4, "K": 0, "ctx_lens": [1, 1, 1, 1], "t": 0.020}]
    cells = table_cells(recs, chunk=256)
    assert cells == ((2, 1, 1, 0.031), (2, 1, 2, 0.070), (4, 0, 1, 0.020))
    ops = row_op_cells([{"op": "take", "a": 4, "b": 8, "t": t} for t in (0.09, 0.11, 0.5)]
                       + [{"op": "clear", "a": 8, "b": 8, "t": 0.002}])
    assert ops == (("clear", 8, 8, 0.002), ("take", 4, 8, 0.11))
    pc = ProfiledCost(lin, cells, ops)
    assert pc.row_op_time("take", 4, 8) == 0.11 and pc.row_op_time("take", 8, 4) == 0.0  # untimed: free
    assert lin.row_op_time("take", 4, 8) == 0.0  # Eq. 7 has no row operations
    assert pc.device_time(2, 1, [3, 256]) == 0.031  # the median, not the mean
    assert pc.device_time(2, 1, [257, 1]) == 0.070
    assert pc.device_time(4, 0, [0, 0]) == 0.020  # an empty context still reads one chunk
    assert pc.step_time(2, 1, [3, 4]) == pytest.approx(0.031 + 5e-3)
    off_grid = (8, 3, [600] * 8)
    assert pc.device_time(*off_grid) == pytest.approx(lin.device_time(*off_grid))
    assert pc.step_time(2, 1, [3, 4], tokens_per_row=5) == pytest.approx(lin.step_time(2, 1, [3, 4], tokens_per_row=5))
    assert pc.prefill_time(4, 128) == pytest.approx(lin.prefill_time(4, 128))
    pc2 = pc.with_host(1e-3, 2e-4)
    assert pc2.step_time(2, 1, [3, 4]) == pytest.approx(0.031 + 1e-3 + 2 * 2e-4)
    assert pc.linear.host_step == 5e-3  # with_host returns a copy

    path = str(tmp_path / "perf.json")
    save_model(path, "m|d|cpu:cpu", lin)
    assert load_profiled(path, "m|d|cpu:cpu") == ProfiledCost(lin)  # no table saved: the line alone
    save_table(path, "m|d|cpu:cpu", pc2)
    assert load_profiled(path, "m|d|cpu:cpu") == pc2
    assert load_profiled(path, "m|d|cpu:cpu").row_op_time("take", 4, 8) == 0.11
    # A device drafter's table may know the target-only prefill (requests admitted without the draft).
    plain = LinearCost(0.0, 1e-3, 2e-2)
    pc3 = ProfiledCost(lin, cells, ops, plain)
    assert pc3.prefill_time(2, 64, draft=False) == pytest.approx(plain(0, 128))
    assert pc3.prefill_time(2, 64) == pc2.prefill_time(2, 64, draft=False) == pytest.approx(lin.prefill_time(2, 64))
    save_table(path, "m|d|cpu:cpu", pc3)
    assert load_profiled(path, "m|d|cpu:cpu") == pc3
    # A speed probe scales steps and prefills per bucket (row ops and host terms stay).
    fast = pc3.with_speed({2: 0.5})
    assert fast.device_time(2, 1, [3, 256]) == pytest.approx(0.5 * 0.031)
    assert fast.device_time(4, 0, [0]) == pc3.device_time(4, 0, [0])  # no factor: as profiled
    assert fast.prefill_time(2, 64, draft=False) == pytest.approx(0.5 * plain(0, 128))
    assert fast.row_op_time("take", 4, 8) == 0.11 and fast.with_speed(None) == pc3
    # Measured prefill medians win over the lines where the profile timed that shape.
    pre = [{"B": 1, "Tp": 64, "t": t} for t in (0.15, 0.17, 0.9)]
    pcells = prefill_table_cells(pre, False) + prefill_table_cells([{"B": 1, "Tp": 64, "t": 0.2}], True)
    assert pcells == ((1, 64, 0, 0.17), (1, 64, 1, 0.2))
    pc4 = ProfiledCost(lin, cells, ops, plain, pcells)
    assert pc4.prefill_time(1, 64, draft=False) == 0.17 and pc4.prefill_time(1, 64) == 0.2
    assert pc4.prefill_time(1, 128, draft=False) == pytest.approx(plain(0, 128))  # untimed: the line
    assert pc4.with_speed({1: 2.0}).prefill_time(1, 64) == pytest.approx(0.4)
    save_table(path, "m|d|cpu:cpu", pc4)
    assert load_profiled(path, "m|d|cpu:cpu") == pc4
    assert load_model(path, "m|d|cpu:cpu") == lin  # the selector's model is untouched


def test_calibrate_host_measures_the_loop_outside_the_backend():
    """Host terms come from wall - elapsed (the loop's own work), so a machine that runs 20%
    slower than when it was profiled does not inflate them; the whole-step report shows the drift."""
    from specjax.engine.loop import StepRecord
    from specjax.engine.profiling import calibrate_host

    lin = StepCostModel(target=LinearCost(1e-6, 1e-3, 1e-2), context_mode="padded")
    cells = tuple((b, k, 1, 0.02 * b + 0.003 * k) for b in (1, 2, 4, 8) for k in (0, 1, 2))
    pc = ProfiledCost(lin, cells, (("take", 8, 4, 0.2), ("clear", 8, 8, 0.05), ("clear", 4, 4, 0.03)))
    rng = np.random.default_rng(0)
    steps = []
    for i in range(200):
        n = int(rng.integers(1, 9))
        bucket = 8 if i % 3 else max(4, 1 << (n - 1).bit_length())  # often a larger live bucket than n needs
        ops = [(("take", 8, 4), ("clear", 8, 8), ("clear", 4, 4))[i % 3]] if i % 5 == 0 else []
        k = int(rng.integers(0, 3))
        elapsed = 1.2 * (pc.device_time(bucket, k, [10] * n) + sum(pc.row_op_time(*o) for o in ops))
        wall = elapsed + 2e-3 + 1e-3 * n
        steps.append(StepRecord(0.0, n, bucket, k, k, [10] * n, elapsed, wall, 1, 0, 0, tuple(ops)))
    cal, rep = calibrate_host(steps, pc)
    assert cal.linear.host_step == pytest.approx(2e-3, abs=1e-9) and cal.linear.host_row == pytest.approx(1e-3, abs=1e-9)
    assert rep["calibration_batch_sizes"] == list(range(1, 9)) and rep["host_mean_abs_err_held_out_s"] < 1e-9
    assert -0.2 < rep["mean_rel_err_engine_steps"] < -0.1  # the drift: predicted steps ~15% short
    assert cal.row_ops == pc.row_ops and cal.cells == pc.cells


# ----------------------------------------------------------------------------- the K selector (Algorithm 2)


def _cost(a=0.0, g=0.0, d=0.0, **kw) -> StepCostModel:
    return StepCostModel(target=LinearCost(a, g, d), context_mode="sum", **kw)


def _feed(policy: GoodputPolicy, drafted, accepted, k: int, steps: int = 4) -> None:
    for _ in range(steps):
        policy.observe(k, drafted, accepted)


def test_selector_speculation_cannot_pay():
    pol = GoodputPolicy(_cost(a=1e-7, g=1.0, d=1e-3))  # every verified token is expensive
    _feed(pol, [4, 4, 4, 4], [0, 1, 0, 0], k=4)  # 1 accepted, 4 rejections: alpha = 1/5
    assert pol.acc.alpha.value == pytest.approx(1 / 5)
    view = BatchView(ctx_lens=[100, 200, 300, 400], bucket=4, k_options=(0, 1, 2, 4, 8))
    assert pol.choose(view) == 0
    assert max(pol.last_goodputs, key=pol.last_goodputs.get) == 0
    assert set(pol.last_goodputs) == {0, 1, 2, 4, 8}


def test_selector_cheap_tokens_high_alpha_takes_largest_k():
    pol = GoodputPolicy(_cost(a=1e-9, g=1e-7, d=1.0))  # the step's fixed cost dominates
    _feed(pol, [5, 5, 5], [5, 4, 5], k=5)  # alpha = 14/15 (one rejection)
    view = BatchView(ctx_lens=[50, 60, 70], bucket=4, k_options=(0, 1, 3, 5, 7))
    assert pol.choose(view) == 7


def _brute_force(view, k, alpha, rho, cost):
    """Goodput of K for a device drafter, computed without the library: n (1 + rho (l - 1))
    tokens over draft + target + host time (context mode 'sum')."""
    n = len(view.ctx_lens)
    ctx = np.asarray(view.ctx_lens, float)
    tokens = n * (1 + rho * (_geom_sum(alpha, k) - 1)) if k > 0 else float(n)
    t = cost.target.alpha * ctx.sum() + cost.target.gamma * view.bucket * (k + 1) + cost.target.delta
    if k > 0:
        if cost.draft is None:
            t += cost.host_draft
        else:
            for i in range(k):
                t += (cost.draft.alpha * (ctx + i).sum() + cost.draft.gamma * view.bucket * (2 if i == 0 else 1)
                      + cost.draft.delta)
    t += cost.host_step + cost.host_row * n
    return tokens / t


def test_selector_matches_brute_force_argmax():
    rng = np.random.default_rng(42)
    opts = (0, 1, 2, 3, 5, 8)
    for trial in range(150):
        device = trial % 2 == 0
        cost = StepCostModel(
            target=LinearCost(*(rng.uniform(0, 1) * np.array([1e-6, 1e-4, 1e-2]))),
            draft=LinearCost(*(rng.uniform(0, 1) * np.array([1e-7, 1e-5, 2e-3]))) if device else None,
            host_draft=0.0 if device else float(rng.uniform(0, 5e-3)),
            host_step=float(rng.uniform(0, 1e-3)), host_row=float(rng.uniform(0, 1e-5)))
        pol = GoodputPolicy(cost)
        n = int(rng.integers(1, 33))
        bucket = int(2 ** math.ceil(math.log2(n)))
        drafted = rng.integers(0, 6, size=n)
        drafted[0] = 5  # at least one row proposes
        accepted = np.array([rng.integers(0, d + 1) for d in drafted])
        pol.observe(5, drafted, accepted)
        p = drafted > 0
        alpha = accepted[p].sum() / (accepted[p].sum() + (accepted[p] < drafted[p]).sum())
        rho = (drafted > 0).mean()
        view = BatchView(ctx_lens=list(rng.integers(1, 4000, size=n)), bucket=bucket, k_options=opts)
        ref = {k: _brute_force(view, k, alpha, rho, cost) for k in opts}
        chosen = pol.choose(view)
        for k in opts:
            assert pol.last_goodputs[k] == pytest.approx(ref[k], rel=1e-9)
        best = max(ref.values())
        assert ref[chosen] == pytest.approx(best, rel=1e-9)
        if sorted(ref.values())[-2] < best * (1 - 1e-6):  # unambiguous optimum
            assert chosen == max(ref, key=ref.get)


def test_selector_only_returns_compiled_k():
    rng = np.random.default_rng(3)
    opts = (0, 1, 3, 5)
    seen = set()
    for _ in range(200):
        pol = GoodputPolicy(_cost(a=rng.uniform(0, 1e-6), g=10 ** rng.uniform(-7, -2), d=10 ** rng.uniform(-4, -1)))
        a = rng.uniform(0, 1)
        drafted = np.full(4, 5)
        _feed(pol, drafted, np.round(drafted * a).astype(int), k=5, steps=1)
        k = pol.choose(BatchView(ctx_lens=[100] * 4, bucket=4, k_options=opts))
        assert k in opts
        seen.add(k)
    assert len(seen) >= 3  # the sweep really moves the choice around


def test_selector_proposes_less_for_large_batches():
    cost = _cost(a=1e-7, g=1e-4, d=1e-2)
    opts = tuple(range(9))
    choices = []
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
        pol = GoodputPolicy(cost)
        _feed(pol, [8] * 4, [2, 3, 2, 3], k=8)  # alpha = 10/14
        choices.append(pol.choose(BatchView(ctx_lens=[500] * n, bucket=n, k_options=opts)))
    assert all(b <= a for a, b in zip(choices, choices[1:])), choices
    assert choices[0] >= 3 and choices[-1] <= 1, choices


def test_selector_host_draft_lens():
    cost = _cost(a=1e-8, g=1e-5, d=1e-2, host_draft=1e-3)
    opts = (0, 1, 3, 5)
    pol = GoodputPolicy(cost)
    _feed(pol, [5] * 4, [5] * 4, k=5)  # alpha = 1: drafts always pay, if there are any
    ctx = [100, 200, 300, 400]
    # Nothing proposed: every K generates one token per row at the cost of K = 0.
    view = BatchView(ctx_lens=ctx, bucket=4, k_options=opts, draft_lens=[0, 0, 0, 0])
    assert pol.choose(view) == 0
    for k in opts:
        assert pol.expected_tokens(view, k) == 4.0
    # One row proposes 2: K >= 2 runs the K = 3 block, so K = 5 gains nothing over K = 3.
    view = BatchView(ctx_lens=ctx, bucket=4, k_options=opts, draft_lens=[2, 0, 0, 0])
    assert pol.expected_tokens(view, 1) == pytest.approx(2 + 3)
    assert pol.expected_tokens(view, 3) == pytest.approx(3 + 3)
    assert pol.expected_tokens(view, 5) == pytest.approx(3 + 3)
    t3 = cost.step_time(4, 3, ctx)
    assert pol.goodput(view, 5) == pytest.approx(6 / t3)
    assert pol.choose(view) == 3  # ties go to the smaller K


def test_selector_oracle_uses_true_accept():
    cost = _cost(g=1e-3, d=1e-2)
    pol = GoodputPolicy(cost, estimator="oracle")
    _feed(pol, [5] * 4, [0] * 4, k=5)  # a moving average would say alpha = 0
    ta = [3, 0, 5, 1]
    view = BatchView(ctx_lens=[10] * 4, bucket=4, k_options=(0, 1, 3, 5), true_accept=ta)
    want = {0: 4, 1: 7, 3: 11, 5: 13}
    for k, v in want.items():
        assert pol.expected_tokens(view, k) == v
    ref = {k: want[k] / (1e-3 * 4 * (k + 1) + 1e-2) for k in want}
    assert pol.choose(view) == max(ref, key=ref.get) != 0
    # The same feedback under the moving average turns speculation off.
    ma = GoodputPolicy(cost)
    _feed(ma, [5] * 4, [0] * 4, k=5)
    assert ma.choose(view) == 0


def test_selector_confidence_estimator():
    pol = GoodputPolicy(_cost(g=1e-3, d=1e-2), estimator="confidence", threshold=0.5)
    conf = np.array([[0.9, 0.9, 0.2, 0.9, 0.9], [0.1, 0.9, 0.9, 0.9, 0.9], [0.9, 0.9, 0.9, 0.9, 0.9]])
    view = BatchView(ctx_lens=[10] * 3, bucket=4, k_options=(0, 1, 3, 5), confidences=conf)
    assert pol.expected_tokens(view, 1) == 1 + 1 + 1 + 0 + 1 + 1
    assert pol.expected_tokens(view, 5) == 3 + 2 + 0 + 5


def test_confidence_policy_gates_its_draft_call():
    """The draft call's first forward is spent whatever K: no draft call while the moving
    average says no K pays, and none for reprobe_after steps after window/4 draft calls in a row
    that all chose K = 0; the stale-estimate re-probe opens it again."""
    cost = StepCostModel(target=LinearCost(0.0, 1e-4, 1e-2), draft=LinearCost(0.0, 1e-4, 1e-3), context_mode="sum")
    pol = GoodputPolicy(cost, estimator="confidence", threshold=0.5, window=8, reprobe_after=6)
    assert pol.draft_threshold == 0.5  # prior alpha 0.5: drafting may pay
    sure = np.full((2, 4), 0.9)
    view = BatchView(ctx_lens=[10, 10], bucket=2, k_options=(0, 1, 2, 4), confidences=sure, drafted_ahead=4)
    assert pol.choose(view) > 0 and pol.draft_threshold == 0.5
    pol.observe(4, [4, 4], [0, 0])  # nothing accepted: the moving average says K = 0
    pol.choose(view)
    assert pol.draft_threshold is None
    plain = BatchView(ctx_lens=[10, 10], bucket=2, k_options=(0, 1, 2, 4), draft_lens=[4, 4])
    for _ in range(6):  # K = 0 steps without a draft call, until the stale estimate is reset
        assert pol.choose(plain) == 0 and pol.draft_threshold is None
        pol.observe(0, [0, 0], [0, 0])
    pol.choose(plain)
    assert pol.draft_threshold == 0.5  # prior again: the next step drafts ahead (a probe)
    # Draft calls whose confidences never pass the threshold: closed after window / 4 = 2 of them.
    unsure = BatchView(ctx_lens=[10, 10], bucket=2, k_options=(0, 1, 2, 4), confidences=np.full((2, 4), 0.1),
                       drafted_ahead=1)
    assert pol.choose(unsure) == 0 and pol.draft_threshold == 0.5
    assert pol.choose(unsure) == 0 and pol.draft_threshold is None
    assert GoodputPolicy(cost).draft_threshold is None  # moving average: drafts inside the step


def test_fixed_k_and_bad_estimator():
    view = BatchView(ctx_lens=[1, 2], bucket=2, k_options=(0, 1, 3, 5))
    assert FixedK(3).choose(view) == 3
    assert FixedK(0).choose(view) == 0 and FixedK(0).name == "no-SD"
    with pytest.raises(ValueError):
        FixedK(2).choose(view)
    # a K whose step a background warm-up still builds: the largest compiled K below it until it
    # is in; nothing is ever decided, so calls may run as many steps as the backend can
    pol = FixedK(4)
    assert pol.choose(BatchView(ctx_lens=[1], bucket=1, k_options=(0,), k_coming=(1, 4))) == 0
    assert pol.call_steps > 1
    assert pol.choose(BatchView(ctx_lens=[1], bucket=1, k_options=(0, 1), k_coming=(4,))) == 1
    assert pol.choose(BatchView(ctx_lens=[1], bucket=1, k_options=(0, 1, 4))) == 4 and pol.call_steps > 1
    zero = FixedK(0)
    zero.call_steps = 1  # (a caller's own commitment stays)
    assert zero.choose(view) == 0 and zero.call_steps == 1
    with pytest.raises(ValueError):
        GoodputPolicy(_cost(), estimator="psychic")


def test_draft_prefill_gate():
    gate = DraftPrefillGate(threshold=0.7, window=10)
    assert gate.speculate()
    for k in [0] * 7 + [3] * 3:
        gate.record(k)
    assert gate.speculate()  # exactly 70 % proposed nothing: not more than the threshold
    gate.record(0)  # the window drops a leading 0: still 7/10
    assert gate.speculate()
    for _ in range(6):
        gate.record(0)  # -> [3, 3, 3] + [0] * 7
    assert gate.speculate()
    gate.record(0)  # drops a 3: 8/10 > 70 %
    assert not gate.speculate()
    for _ in range(3):
        gate.record(2)  # 5/10
    assert gate.speculate()
    short = DraftPrefillGate(threshold=0.7, reopen_after=2)
    for k in (0, 0, 0, 1):
        short.record(k)
    for _ in range(5):
        short.record(0, could_draft=False)  # no running request could draft: not evidence
    assert short.speculate() is False  # 3/4 of the recorded steps, however few
    # A closed gate reopens for one probe after reopen_after refusals in a row.
    assert [short.speculate() for _ in range(4)] == [False, True, False, False]
    # A fruitless probe doubles the refusals before the next (here up to max_reopen_after = 64) ...
    assert [short.speculate() for _ in range(3)] == [False, False, True]
    assert [short.speculate() for _ in range(9)] == [False] * 8 + [True]
    for _ in range(4):
        short.record(3)  # ... and the gate opening (drafts pay again) resets them
    assert short.speculate() and short._spacing == 2
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError):
            DraftPrefillGate(threshold=bad)
    DraftPrefillGate(threshold=0.0)
    DraftPrefillGate(threshold=1.0)


def test_could_pay_is_the_ceiling_of_every_draft_accepted():
    """A draft forward dearer than a target step can never pay: ``could_pay`` says so whatever
    the acceptance estimate (the engine then skips its draft prefill); a draft that pays only
    near full acceptance could, though the policy chooses K = 0 at the prior; FixedK follows K."""
    view = BatchView(ctx_lens=[100, 120], bucket=2, k_options=(0, 2), k_coming=(4,))
    for draft_s, could in ((1.1e-2, False), (8e-3, True)):
        pol = GoodputPolicy(_cost(d=1e-2, draft=LinearCost(0.0, 0.0, draft_s)))
        assert pol.choose(view) == 0 and pol.could_pay(view) is could, draft_s
        _feed(pol, [2, 2], [2, 2], k=2)  # everything accepted: the ceiling stays where it was
        assert pol.could_pay(view) is could
    assert not GoodputPolicy(_cost(d=1e-2, draft=LinearCost(0.0, 0.0, 1e-3))).could_pay(
        dataclasses.replace(view, k_options=(0,), k_coming=()))  # no K > 0 to run
    assert FixedK(2).could_pay(view) and not FixedK(0).could_pay(view)


def test_min_gain_keeps_k0_where_drafting_is_estimated_only_a_little_ahead():
    """K = 2 estimated 5% ahead of K = 0: taken with no margin, not with a 10% one (nor wanted
    while still being built); 20% ahead, taken either way. The launch policies carry the
    registry's margin, the oracle none."""
    from specjax import registry

    view = BatchView(ctx_lens=[100], bucket=1, k_options=(0, 2))
    for gain, want in ((1.05, (2, 0)), (1.2, (2, 2))):
        # one row, alpha 1 (every draft accepted): K = 2 makes 3 tokens for 3 / gain step costs
        cost = _cost(d=1e-2, draft=LinearCost(0.0, 0.0, (3.0 / gain - 1.0) * 1e-2 / 2))
        got = []
        for margin in (0.0, 0.1):
            pol = GoodputPolicy(cost, min_gain=margin)
            _feed(pol, [2], [2], k=2)
            got.append(pol.choose(view))
            assert pol.last_goodputs[2] / pol.last_goodputs[0] == pytest.approx(gain, rel=1e-6)
        assert tuple(got) == want, (gain, got)
    pol = GoodputPolicy(_cost(d=1e-2, draft=LinearCost(0.0, 0.0, (3.0 / 1.05 - 1.0) * 1e-2 / 2)), min_gain=0.1)
    _feed(pol, [2], [2], k=2)
    assert pol.choose(dataclasses.replace(view, k_options=(0,), k_coming=(2,))) == 0 and pol.want_k == 0
    assert registry.policy_for("smartspec").min_gain == registry.MIN_GAIN > 0
    assert registry.policy_for("oracle").min_gain == 0.0
    with pytest.raises(ValueError, match="min_gain"):
        GoodputPolicy(_cost(d=1e-2), min_gain=-0.1)


def test_a_larger_k_needs_half_the_margin_over_a_smaller_one():
    """K = 2 estimated 3% ahead of K = 1: taken with no margin, not with the launch policies'
    10% one (a larger K must beat the smaller by half of it); 8% ahead, taken either way."""
    view = BatchView(ctx_lens=[100], bucket=1, k_options=(1, 2))
    for gain, want in ((1.03, (2, 1)), (1.08, (2, 2))):
        # one row, alpha 1: K drafts make K + 1 tokens in d + K x, so K = 2 over K = 1 is 1.5 (d + x) / (d + 2 x)
        x = 1e-2 * (1.5 - gain) / (2 * gain - 1.5)
        got = []
        for margin in (0.0, 0.1):
            pol = GoodputPolicy(_cost(d=1e-2, draft=LinearCost(0.0, 0.0, x)), min_gain=margin)
            _feed(pol, [2], [2], k=2)
            got.append(pol.choose(view))
            assert pol.last_goodputs[2] / pol.last_goodputs[1] == pytest.approx(gain, rel=1e-6)
        assert tuple(got) == want, (gain, got)


def test_cost_calibration_corrects_an_underestimating_model():
    """The fitted line says drafting pays at batch 1; the measured steps say K = 4 costs twice
    its prediction: after observing them the selector falls back to K = 0. Unmeasured shapes
    borrow the nearest measured one of their bucket."""
    cost = _cost(a=0.0, g=1e-3, d=1e-2)
    pol = GoodputPolicy(cost)
    _feed(pol, [4], [1], k=4)  # alpha 0.5: l(0.5, 4) = 1.94 tokens for 1.5x the K = 0 time
    view = BatchView(ctx_lens=[100], bucket=1, k_options=(0, 4))
    assert pol.choose(view) == 4
    for _ in range(3):
        pol.observe_time(view, 0, 1, pol._model_cost(view, 0, 1))  # K = 0 as predicted
        pol.observe_time(view, 4, 5, 2.0 * pol._model_cost(view, 4, 5))  # K = 4 costs 2x
    assert pol.calibration.factors() == {(1, 0, 1): pytest.approx(1.0), (1, 4, 5): pytest.approx(2.0)}
    assert pol.choose(view) == 0
    cal = CostCalibration(window=3)
    assert cal.factor((1, 2, 3)) == 1.0  # nothing measured
    cal.observe((1, 4, 5), 1.0, 2.0)
    cal.observe((1, 0, 1), 1.0, 1.1)
    cal.observe((8, 2, 24), 1.0, 0.5)
    assert cal.factor((1, 2, 3)) == pytest.approx(1.1)  # nearest by tokens in bucket 1: (1, 0, 1) ties (1, 4, 5); smaller K
    assert cal.factor((1, 8, 9)) == pytest.approx(2.0)
    assert cal.factor((4, 1, 8)) == 1.0  # no shape of bucket 4 measured
    for r in (3.0, 100.0, 3.0):
        cal.observe((1, 4, 5), 1.0, r)
    assert cal.factor((1, 4, 5)) == pytest.approx(3.0)  # the median of the last 3: one outlier is ignored
    assert GoodputPolicy(cost, calibrate=False).calibration is None
    # with a prior weight, what a shape borrows counts as that many observations until real ones come
    cal = CostCalibration(window=8, prior_weight=3)
    for _ in range(4):
        cal.observe((1, 0, 1), 1.0, 0.9)
    cal.observe((1, 1, 2), 1.0, 1.3)  # one slow step (it also settled the head, say)
    assert cal.factor((1, 1, 2)) == pytest.approx(0.9)  # median of 1.3 and K = 0's 0.9 twice
    cal.observe((1, 1, 2), 1.0, 1.0)
    assert cal.factor((1, 1, 2)) == pytest.approx(1.0)  # 0.9, 1.0, 1.3
    cal.observe((1, 1, 2), 1.0, 1.2)
    assert cal.factor((1, 1, 2)) == pytest.approx(1.2)  # its own three
    with pytest.raises(ValueError):
        CostCalibration(prior_weight=-1)


def test_k0_cost_is_its_decode_calls_once_they_run():
    """Under a model without the call's own cost (call_s 0), K = 0's cost is calibrated by single
    steps until K = 0 has run in a full decode call; from then on only by such calls' steps: the
    single K = 0 steps and short calls speculation leaves between verify steps (a host round trip
    each) no longer raise it, so they cannot make K > 0 look better."""
    cost = _cost(a=0.0, g=1e-3, d=1e-2)
    pol = GoodputPolicy(cost)
    view = BatchView(ctx_lens=[100, 120, 90, 80], bucket=4, k_options=(0, 2), call_ks=(0,), call_steps=16)
    m0 = pol._model_cost(view, 0, 4)
    for _ in range(3):
        pol.observe_time(view, 0, 4, 1.5 * m0)  # no call yet: single steps are what K = 0 costs
    assert pol.step_cost(view, 0) == pytest.approx(1.5 * m0)
    for _ in range(3):
        pol.observe_time(view, 0, 4, m0, full_call=True, call_len=16)
    for _ in range(16):
        pol.observe_time(view, 0, 4, 1.5 * m0)  # between speculative steps, or a short call: left out
    assert pol.calibration.factors()[(4, 0, 4)] == pytest.approx(1.0)
    pol.observe_time(view, 2, 12, 3.0 * pol._model_cost(view, 2, 12))  # K > 0 steps calibrate as before
    assert pol.calibration.factors()[(4, 2, 12)] == pytest.approx(3.0)
    two = dataclasses.replace(view, ctx_lens=[100, 120], bucket=2)  # another bucket: no full call there yet
    pol.observe_time(two, 0, 2, 1.5 * pol._model_cost(two, 0, 2))
    assert pol.calibration.factors()[(2, 0, 2)] == pytest.approx(1.5)


def test_selector_reprobes_after_stale_k0_steps():
    """Once alpha reads 0 only K = 0 is chosen and nothing new is learnt; after `reprobe_after`
    such steps the window is emptied (the prior decides once), and one real observation then
    rules the estimate again."""
    pol = GoodputPolicy(_cost(a=0.0, g=1e-6, d=1e-2), window=4, prior_alpha=0.6, reprobe_after=10)
    view = BatchView(ctx_lens=[10, 10], bucket=2, k_options=(0, 2, 4))
    _feed(pol, [4, 4], [0, 0], k=4, steps=4)
    assert pol.acc.alpha.value == 0.0 and pol.choose(view) == 0
    for _ in range(9):
        pol.observe(0, [0, 0], [0, 0])
    assert pol.acc.alpha.value == 0.0
    pol.observe(0, [0, 0], [0, 0])  # the 10th stale step
    assert pol.acc.alpha.value == pytest.approx(0.6)
    assert pol.choose(view) > 0
    pol.observe(4, [4, 4], [0, 0])  # the probe fails
    assert pol.acc.alpha.value == 0.0 and pol.choose(view) == 0


def test_tree_node_rates_learn_every_smaller_budget_and_reprobe():
    """A device tree's nodes come best first, so a verified 6-node tree says what each smaller
    budget would have accepted: node i scores how often it was on the accepted path. SmartSpec
    sums them into the expected length of each budget and picks the one with the best goodput;
    a run of K = 0 choices (no tree verified) reopens the prior."""
    rates = TreeNodeRates(window=4, prior=0.5, reprobe_after=3)
    assert list(rates.scores(3)) == [0.5, 0.5, 0.5]
    for path in ([1, 3], [1], [2], [1, 3]):  # node 1 on 3 of 4 paths, node 2 on 1, node 3 on 2
        rates.observe(6, path)
    rates.observe(2, [1])  # a 2-node tree: nodes 3.. unobserved this time
    sc = rates.scores(6)
    assert list(sc) == pytest.approx([0.75, 0.25, 0.5, 0.0, 0.0, 0.0])  # window 4: the first path dropped
    # Verify cost 10 ms + 2 ms per block token: 3 nodes (2.5 tokens in 18 ms) beat 1 node (1.75 in
    # 14 ms) and K = 0 (1 in 12 ms); the 3 never-accepted nodes after them only cost.
    cost = StepCostModel(target=LinearCost(0.0, 2e-3, 1e-2), draft=LinearCost(0.0, 0.0, 0.0))
    pol = GoodputPolicy(cost, min_gain=0.0)
    view = BatchView(ctx_lens=[50], bucket=1, k_options=[0, 1, 3, 6], request_ids=["a"], draft_lens=[6],
                     draft_scores=[sc])
    assert pol.expected_tokens(view, 3) == pytest.approx(1 + 0.75 + 0.25 + 0.5)
    assert pol.choose(view) == 3
    for _ in range(3):
        rates.scores(6)  # proposals with no tree verified (K = 0 chosen)
    assert list(rates.scores(6)) == [0.5] * 6  # the fourth: back to the prior


def test_goodput_over_scored_trees_chooses_and_calibrates():
    """Tree drafters' node probabilities predict accepted drafts (the sum over the first m
    nodes): a confident tree makes the selector use a large node budget, an unlikely one K = 0,
    and the calibration (accepted / predicted) learnt from verified steps scales the scores, so
    a drafter that overrates its trees is trusted less."""
    # Verify cost grows with the block: 10 ms + 5 ms per block token (batch 1).
    cost = StepCostModel(target=LinearCost(0.0, 5e-3, 1e-2), draft=LinearCost(0.0, 0.0, 0.0))
    pol = GoodputPolicy(cost)
    sure = np.full(8, 0.95)
    view = BatchView(ctx_lens=[100], bucket=1, k_options=[0, 2, 4, 8], request_ids=["a"], draft_lens=[8],
                     draft_scores=[sure])
    assert pol.choose(view) == 8
    assert pol.expected_tokens(view, 4) == pytest.approx(1 + 4 * 0.95)
    weak = BatchView(ctx_lens=[100], bucket=1, k_options=[0, 2, 4, 8], request_ids=["b"], draft_lens=[8],
                     draft_scores=[np.full(8, 0.02)])
    assert pol.choose(weak) == 0
    # A request without scores (a prompt-lookup chain from the hybrid's fallback) uses alpha.
    mixed = BatchView(ctx_lens=[100, 100], bucket=2, k_options=[0, 4], request_ids=["a", "c"], draft_lens=[4, 4],
                      draft_scores=[sure, None])
    assert pol.expected_tokens(mixed, 4) == pytest.approx(1 + 4 * 0.95 + expected_len(pol.acc.alpha.value, 4))
    # The drafter overrates: its 8-node trees predict 7.6 accepted drafts, 1 is accepted each time.
    for _ in range(16):
        pol.choose(view)
        pol.observe(8, [8], [1], ["a"])
    assert pol.score_calibration.factor(sure) == pytest.approx(1 / 7.6)
    assert pol.choose(view) < 8
    # Calibrated per band of the first node's score: a drafter certain of a continuation (every
    # node 1.0: seen once) overrates it far more than its hedged trees; a band not yet observed
    # borrows the pooled ratio.
    cal = ScoreCalibration(window=4)
    assert cal.factor(np.ones(3)) == 1.0 and len(cal) == 0
    for _ in range(4):
        cal.observe(np.ones(6), 4, 1)  # predicted 4 (the first 4 nodes), 1 accepted
        cal.observe(np.array([0.6, 0.5, 0.4]), 3, 1)  # predicted 1.5, 1 accepted
    assert cal.factor(np.ones(2)) == pytest.approx(1 / 4)
    assert cal.factor(np.array([0.7, 0.1])) == pytest.approx(1 / 1.5)
    assert cal.factor(np.array([0.1])) == pytest.approx(8 / 22)  # (pooled) and the window keeps 4 a band
    assert len(cal) == 8
    pol.finish("a")
    assert "a" not in pol._scores


def test_a_draft_free_step_costs_the_verify_alone():
    """hybrid_eagle's steps whose rows all took suffix chains run none of the head: SmartSpec
    costs them without the draft forwards (which here would make a 0.6-accepted chain not pay),
    and calibrates them apart from the head's steps of the same shape."""
    # Verify: 10 ms + 2 ms per block token; each draft forward 4 ms (a head's chain of 2: 8 ms).
    cost = StepCostModel(target=LinearCost(0.0, 2e-3, 1e-2), draft=LinearCost(0.0, 0.0, 4e-3))
    pol = GoodputPolicy(cost, min_gain=0.0)
    chain = dict(ctx_lens=[50], bucket=1, k_options=[0, 2], request_ids=["a"], draft_lens=[2],
                 draft_scores=[np.array([0.6, 0.3])])
    head, free = BatchView(**chain), BatchView(**chain, draft_free=True)
    # 1.9 tokens: in 24 ms with the head's drafting (0.079 / ms < K = 0's 1 in 12 ms), in 16 without
    assert pol._model_cost(head, 2, 3) == pytest.approx(0.024)
    assert pol._model_cost(free, 2, 3) == pytest.approx(0.016)
    assert pol.choose(head) == 0 and pol.choose(free) == 2
    pol.observe_time(free, 2, 3, 0.032)  # the draft-free step measured 2x its prediction
    assert pol.step_cost(free, 2) == pytest.approx(0.032) and pol.step_cost(head, 2) == pytest.approx(0.024 * 2)
    pol.observe_time(head, 2, 3, 0.024)  # the head's step as predicted: its own shape's factor
    assert pol.step_cost(head, 2) == pytest.approx(0.024) and pol.step_cost(free, 2) == pytest.approx(0.032)
    assert pol.choose(free) == 0  # 1.9 tokens in 32 ms


def test_a_step_that_ran_row_ops_does_not_calibrate_its_k():
    """PolicyFeedback hands the policy a step that also ran row ops (a new request's state cleared
    or allocated, milliseconds at batch 1) as cold: its seconds are not its K's cost."""
    import types

    from specjax.engine.observers import PolicyFeedback

    seen = []

    class Recorder(FixedK):
        def observe_time(self, view, k_step, tokens, seconds, full_call=False, cold=False, call_len=1):
            seen.append(cold)

    pol = Recorder(1)
    for ops in ((("clear", 1, 1),), ()):
        ev = types.SimpleNamespace(proposal=types.SimpleNamespace(draft_lens=None, drafts=None), k=1, k_step=1,
                                   drafted=[1], accepted=[0], view=BatchView(ctx_lens=[9], bucket=1, k_options=(0, 1)),
                                   policy=pol, first_of_call=True, tokens=2, wall=0.01, full_call=False, cold=False,
                                   call_len=1, row_ops=ops, rows=[])
        PolicyFeedback(None).on_step(ev)
    assert seen == [True, False]


def test_a_k_run_in_calls_needs_half_the_margin():
    """A K the backend runs in calls (``call_ks``) ends no K = 0 decode call when chosen, so it
    needs only half of ``min_gain`` over K = 0; elsewhere the whole margin."""
    pol = GoodputPolicy(_cost(g=1e-3, d=4e-3), prior_alpha=0.3, min_gain=0.1)  # K = 1: 1.3 tokens for 1.2x
    alone = BatchView(ctx_lens=[10], bucket=1, k_options=(0, 1))
    assert pol.choose(alone) == 0  # 1.083x < 1.1x
    assert pol.choose(dataclasses.replace(alone, call_ks=(0, 1), call_steps=16)) == 1  # 1.083 x 1.05 > 1.1


def test_a_held_k_reads_each_draft_positions_own_acceptance():
    """The pool's rates per draft position (``chain_rates``): a first draft accepted half the
    time and a second, after it, a tenth; a position never examined takes the rate before it;
    the prior fills a position seen too few times. So K = 2 (1.55 tokens) does not beat K = 1
    (1.5) at these costs, where one rate pooled over both positions (0.37, geometric) put K = 2
    8% ahead."""
    from specjax.goodput.acceptance import chain_rates

    steps = [(0, 1)] * 50 + [(1, 2)] * 45 + [(2, 2)] * 5
    assert chain_rates(steps, 3, 0.9, 0) == pytest.approx([0.5, 0.1, 0.1])
    assert chain_rates([(1, 1)] * 2, 2, 0.5, 4) == pytest.approx([(2 + 2 * 0.5) / 4, (2 + 2 * 0.5) / 4 * 1.0])
    pol = GoodputPolicy(_cost(g=2e-5, d=1e-3), min_gain=0.1, hold_requests=True)
    view = lambda rid: BatchView(ctx_lens=[10], bucket=1, k_options=(0, 1, 2), request_ids=[rid], call_ks=(0, 1, 2),
                                 call_steps=16)
    pol.choose(view("p"))
    for a, _ in steps:
        pol.observe(2, [2], [a], ["p"])
    assert pol.choose(view("q")) == 1
    assert pol.last_goodputs[2] / pol.last_goodputs[1] == pytest.approx(1.55 / 1.5 * 1.04 / 1.06)


def test_a_lone_request_of_a_device_head_holds_the_k_chosen_when_it_arrived():
    """``hold_requests``: at batch 1, where every K runs in calls, a request keeps the K chosen
    from the acceptance pooled over earlier requests when it arrived, whatever its own steps
    read; the next request chooses again from the pool; one held at K = 0 ``probe_every``
    times in a row is followed by one at the best K > 0. A batch of two chooses per step."""
    pol = GoodputPolicy(_cost(g=1e-3, d=4e-3), prior_alpha=0.5, min_gain=0.1, prior_weight=4, hold_requests=True)
    pol.probe_every = 2
    view = lambda rid: BatchView(ctx_lens=[10], bucket=1, k_options=(0, 1), request_ids=[rid], call_ks=(0, 1),
                                 call_steps=16)
    assert pol.choose(view("a")) == 1  # the prior: 1.5 tokens for 1.2x a plain step
    for _ in range(12):  # its drafts are all rejected: a per-step choice would turn to K = 0
        pol.observe(1, [1], [0], ["a"])
        assert pol.choose(view("a")) == 1
    assert pol.choose(view("b")) == 0  # the pool: 12 rejections
    assert pol.choose(view("c")) == 0 and pol.choose(view("c")) == 0
    assert pol.choose(view("d")) == 1  # a probe after 2 requests held at K = 0
    for _ in range(64):
        pol.observe(1, [1], [1], ["d"])
    assert pol.choose(view("e")) == 1
    for _ in range(200):  # its drafts now all rejected; it finishes, and a new request of the same id
        pol.observe(1, [1], [0], ["e"])                     # (a run numbers its requests from 0 again)
    pol.finish("e")
    assert pol.choose(view("e")) == 0  # chooses again, from the pool
    two = BatchView(ctx_lens=[10, 10], bucket=2, k_options=(0, 1), request_ids=["e", "f"], call_ks=(0, 1))
    assert pol._held(two) is None  # (chosen per step)
    assert pol._held(dataclasses.replace(view("e"), call_ks=(0,))) is None  # (K = 1 would run alone)
    # a K still compiling that would pay: held at K = 0 meanwhile, and asked for (want_k)
    fresh = GoodputPolicy(_cost(g=1e-3, d=4e-3), prior_alpha=0.5, min_gain=0.1, prior_weight=4, hold_requests=True)
    coming = BatchView(ctx_lens=[10], bucket=1, k_options=(0,), k_coming=(1,), request_ids=["x"], call_ks=(0, 1))
    assert fresh.choose(coming) == 0 and fresh.want_k == 1
