"""Divergences between the target's next-token distribution p and the draft's q at the same
positions (Online Speculative Decoding, eq. 4), each on logits softened by one temperature:

- forward KL, KL(p || q): mean-seeking; the draft covers everything the target might say;
- reverse KL, KL(q || p): mode-seeking;
- JSD[beta] = beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q;
- total variation, TV(p, q) = 1/2 sum |p - q|. 1 - TV is the probability that a token drawn
  from q is accepted when verified against p (speculative sampling's acceptance rate), the
  quantity speculation pays for, so it is what the online loop reports.

Every function takes ``[..., V]`` logits and returns ``[...]`` per position; ``mean_over``
averages them over the positions a mask selects. Gradients flow into both arguments (the
teacher's are stopped by the caller, who knows which side is trained).

The teacher may also be kept as its top k tokens (``TopK``: what verification can afford to
store per position). Truncation is stated, not hidden: p is renormalised over its k tokens,
the forward KL and TV are computed against that renormalised p over the draft's full softmax,
and the reverse KL / JSD, which need p everywhere q has mass, refuse a truncated teacher.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.errors import require

DIVERGENCES = ("fkl", "rkl", "jsd", "tvd")


def log_probs(logits: jax.Array, temperature: float) -> jax.Array:
    require(temperature > 0, f"temperature must be > 0, got {temperature}")
    return jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)


def _kl(log_a: jax.Array, log_b: jax.Array) -> jax.Array:
    """KL(a || b) from log-probabilities; terms with a = 0 contribute 0 (0 log 0), and a NaN
    anywhere stays NaN (a bad teacher row must fail the step, not vanish from it)."""
    a = jnp.exp(log_a)
    return jnp.sum(jnp.where(a == 0, 0.0, a * (log_a - log_b)), axis=-1)


def forward_kl(p_logits: jax.Array, q_logits: jax.Array, temperature: float = 1.0) -> jax.Array:
    return _kl(log_probs(p_logits, temperature), log_probs(q_logits, temperature))


def reverse_kl(p_logits: jax.Array, q_logits: jax.Array, temperature: float = 1.0) -> jax.Array:
    return _kl(log_probs(q_logits, temperature), log_probs(p_logits, temperature))


def jsd(p_logits: jax.Array, q_logits: jax.Array, beta: float = 0.5, temperature: float = 1.0) -> jax.Array:
    require(0.0 <= beta <= 1.0, f"JSD beta must be in [0, 1], got {beta}")
    lp, lq = log_probs(p_logits, temperature), log_probs(q_logits, temperature)
    if beta in (0.0, 1.0):  # the mixture is q (or p): the side with weight is KL(q || q) (or KL(p || p))
        return jnp.zeros(lp.shape[:-1], jnp.float32)
    lm = jnp.logaddexp(jnp.log(beta) + lp, jnp.log1p(-beta) + lq)  # log(beta p + (1 - beta) q), stably
    return beta * _kl(lp, lm) + (1.0 - beta) * _kl(lq, lm)


def tvd(p_logits: jax.Array, q_logits: jax.Array, temperature: float = 1.0) -> jax.Array:
    p = jnp.exp(log_probs(p_logits, temperature))
    q = jnp.exp(log_probs(q_logits, temperature))
    return 0.5 * jnp.sum(jnp.abs(p - q), axis=-1)


@dataclasses.dataclass(frozen=True)
class TopK:
    """A teacher kept as its k most likely tokens per position: ids [..., k] and the logits
    there [..., k] (raw, before temperature). Bytes per position: 8 k (int32 + float32)."""

    ids: jax.Array
    logits: jax.Array

    @staticmethod
    def of(logits: jax.Array, k: int) -> "TopK":
        vals, ids = jax.lax.top_k(logits.astype(jnp.float32), k)
        return TopK(ids.astype(jnp.int32), vals)


jax.tree_util.register_dataclass(TopK, data_fields=["ids", "logits"], meta_fields=[])


def topk_forward_kl(p: TopK, q_logits: jax.Array, temperature: float = 1.0) -> jax.Array:
    """KL(p_k || q) with p_k the teacher renormalised over its top k (temperature applied before
    renormalising), q the draft's full softmax."""
    lp = log_probs(p.logits, temperature)  # renormalised over the k kept tokens
    lq = jnp.take_along_axis(log_probs(q_logits, temperature), p.ids, axis=-1)
    return _kl(lp, lq)


def topk_tvd(p: TopK, q_logits: jax.Array, temperature: float = 1.0) -> jax.Array:
    """TV(p_k, q): on the kept tokens |p_k - q|, elsewhere q's whole remaining mass."""
    pk = jnp.exp(log_probs(p.logits, temperature))
    qk = jnp.exp(jnp.take_along_axis(log_probs(q_logits, temperature), p.ids, axis=-1))
    return 0.5 * (jnp.sum(jnp.abs(pk - qk), axis=-1) + jnp.clip(1.0 - jnp.sum(qk, axis=-1), 0.0, 1.0))


def restrict(teacher, vocab_ids: jax.Array, vocab_size: int):
    """The teacher over a reduced-vocabulary draft's N tokens (``vocab_ids`` [N], target ids),
    in the draft's column order, and the positions where it keeps any mass: (teacher', covered
    [...] bool). The teacher is renormalised over the N tokens (its mass elsewhere is what the
    draft can never propose, stated, not trained toward). Full logits [..., V] -> [..., N]; a
    TopK keeps the ids inside the N (others get logit -inf); a position with none of its k
    inside is not covered (its row is made finite and must be masked out)."""
    if not isinstance(teacher, TopK):
        return jnp.take(teacher, vocab_ids, axis=-1), jnp.ones(teacher.shape[:-1], bool)
    col = jnp.full((vocab_size,), -1, jnp.int32).at[vocab_ids].set(jnp.arange(vocab_ids.shape[0], dtype=jnp.int32))
    at = col[teacher.ids]
    inside = at >= 0
    covered = jnp.any(inside, axis=-1)
    logits = jnp.where(inside, teacher.logits, -jnp.inf)
    logits = jnp.where(covered[..., None], logits, 0.0)  # no NaN from a row of -inf; masked by the caller
    return TopK(jnp.maximum(at, 0), logits), covered


def divergence(name: str, teacher, q_logits: jax.Array, *, temperature: float = 1.0, beta: float = 0.5
               ) -> jax.Array:
    """Per-position divergence ``name`` (one of DIVERGENCES) between a teacher (full logits
    [..., V] or TopK) and the draft's logits [..., V]."""
    require(name in DIVERGENCES, f"unknown divergence {name!r}; use one of {', '.join(DIVERGENCES)}")
    if isinstance(teacher, TopK):
        require(name in ("fkl", "tvd"), f"divergence {name!r} needs the teacher's whole distribution; a top-k "
                "teacher supports fkl and tvd")
        return topk_forward_kl(teacher, q_logits, temperature) if name == "fkl" else topk_tvd(
            teacher, q_logits, temperature)
    if name == "fkl":
        return forward_kl(teacher, q_logits, temperature)
    if name == "rkl":
        return reverse_kl(teacher, q_logits, temperature)
    if name == "jsd":
        return jsd(teacher, q_logits, beta, temperature)
    return tvd(teacher, q_logits, temperature)


def mean_over(values: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of ``values`` over the positions where ``mask`` is true (0 when there are none)."""
    m = mask.astype(jnp.float32)
    return jnp.sum(values * m) / jnp.maximum(jnp.sum(m), 1.0)
