"""Distillation (specjax.distill): the divergences and their gradients against direct float64
numpy computations (so a swapped KL direction or a forgotten temperature fails here), the
top-k teacher's stated truncation, and the optax train step on a layer-skip self-draft."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from specjax.distill import divergences as dv
from specjax.errors import SpecjaxError

T = 1.7  # a temperature != 1: forgetting it changes every value below


def _np_probs(z, t):
    z = np.asarray(z, np.float64) / t
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _np_kl(a, b):
    return np.sum(np.where(a > 0, a * (np.log(np.where(a > 0, a, 1)) - np.log(b)), 0), -1)


def _np_divergence(name, p_logits, q_logits, t, beta=0.3):
    p, q = _np_probs(p_logits, t), _np_probs(q_logits, t)
    if name == "fkl":
        return _np_kl(p, q)
    if name == "rkl":
        return _np_kl(q, p)
    if name == "jsd":
        m = beta * p + (1 - beta) * q
        return beta * _np_kl(p, m) + (1 - beta) * _np_kl(q, m)
    return 0.5 * np.abs(p - q).sum(-1)


@pytest.fixture(scope="module")
def logits():
    rng = np.random.default_rng(0)
    return rng.standard_normal((3, 5, 11)) * 2, rng.standard_normal((3, 5, 11)) * 2


@pytest.mark.parametrize("name", dv.DIVERGENCES)
def test_divergences_and_gradients_equal_numpy(logits, name):
    p_logits, q_logits = logits
    got = np.asarray(dv.divergence(name, jnp.asarray(p_logits, jnp.float32), jnp.asarray(q_logits, jnp.float32),
                                   temperature=T, beta=0.3))
    np.testing.assert_allclose(got, _np_divergence(name, p_logits, q_logits, T), rtol=2e-5, atol=2e-6)
    # d/d(draft logits) of the summed divergence, against float64 central differences
    f = jax.grad(lambda q: jnp.sum(dv.divergence(name, jnp.asarray(p_logits, jnp.float32), q, temperature=T,
                                                 beta=0.3)))
    g = np.asarray(f(jnp.asarray(q_logits, jnp.float32)))
    eps, num = 1e-5, np.zeros_like(q_logits)
    for idx in np.ndindex(q_logits.shape):
        hi, lo = q_logits.copy(), q_logits.copy()
        hi[idx] += eps
        lo[idx] -= eps
        num[idx] = (_np_divergence(name, p_logits, hi, T).sum() - _np_divergence(name, p_logits, lo, T).sum()) / (2 * eps)
    np.testing.assert_allclose(g, num, rtol=1e-3, atol=2e-5)


def test_direction_and_temperature_are_not_interchangeable(logits):
    """The reference test above would catch either mistake; this states why: on these inputs
    KL(p || q) and KL(q || p) differ, and so do the values at temperature 1 and at T."""
    p, q = (jnp.asarray(a, jnp.float32) for a in logits)
    assert not np.allclose(dv.forward_kl(p, q, T), dv.reverse_kl(p, q, T), rtol=1e-2)
    assert not np.allclose(dv.forward_kl(p, q, T), dv.forward_kl(p, q, 1.0), rtol=1e-2)
    # forward KL's gradient in the draft's logits is (q - p) / T
    g = jax.grad(lambda z: jnp.sum(dv.forward_kl(p, z, T)))(q)
    np.testing.assert_allclose(g, (_np_probs(logits[1], T) - _np_probs(logits[0], T)) / T, atol=1e-6)
    # 1 - TV is the acceptance probability of speculative sampling: sum over tokens of min(p, q)
    pp, qq = _np_probs(logits[0], T), _np_probs(logits[1], T)
    np.testing.assert_allclose(1 - np.asarray(dv.tvd(p, q, T)), np.minimum(pp, qq).sum(-1), atol=1e-6)
    for b in (0.0, 1.0):  # the mixture is one of the two: nothing to diverge from
        np.testing.assert_allclose(dv.jsd(p, q, b, T), 0.0, atol=1e-7)


def test_topk_teacher_states_its_truncation(logits):
    p_logits, q_logits = (jnp.asarray(a, jnp.float32) for a in logits)
    full = dv.TopK.of(p_logits, p_logits.shape[-1])  # every token kept: the full divergences
    np.testing.assert_allclose(dv.divergence("fkl", full, q_logits, temperature=T),
                               dv.forward_kl(p_logits, q_logits, T), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dv.divergence("tvd", full, q_logits, temperature=T),
                               dv.tvd(p_logits, q_logits, T), rtol=1e-5, atol=1e-6)
    k = 3
    top = dv.TopK.of(p_logits, k)
    ids = np.argsort(-np.asarray(logits[0]), -1)[..., :k]
    pk = _np_probs(np.take_along_axis(logits[0], ids, -1), T)  # renormalised over the k kept
    qf = _np_probs(logits[1], T)
    qk = np.take_along_axis(qf, ids, -1)
    np.testing.assert_allclose(dv.divergence("fkl", top, q_logits, temperature=T), _np_kl(pk, qk), rtol=2e-5)
    np.testing.assert_allclose(dv.divergence("tvd", top, q_logits, temperature=T),
                               0.5 * (np.abs(pk - qk).sum(-1) + 1 - qk.sum(-1)), rtol=2e-5, atol=1e-6)
    for name in ("rkl", "jsd"):
        with pytest.raises(SpecjaxError, match="whole distribution"):
            dv.divergence(name, top, q_logits)
    with pytest.raises(SpecjaxError, match="unknown divergence"):
        dv.divergence("kl", p_logits, q_logits)
    with pytest.raises(SpecjaxError, match="temperature"):
        dv.forward_kl(p_logits, q_logits, 0.0)
