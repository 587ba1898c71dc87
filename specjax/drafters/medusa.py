"""Medusa heads: a device drafter whose K drafts all come from the target's last hidden state.

The target forward (prefill and every step) also returns the last layer's output at every
block position (``features = (num_layers,)``; ``CompileKey.features``). The drafter keeps, per
row, that output at the last committed position (``FeatureCache.feat``): the hidden state the
target's own head turned into the pending token. Head i (0-based) reads it and predicts the
token i + 2 positions after it, i.e. draft i + 1 of the chain that follows the pending token:

    x = final_norm(h);   y_i = x + SiLU(x W_i + b_i);   logits_i = y_i lm_head

(Medusa-1's residual block, W_i starting at zero so every head starts as the target's own head,
over a reduced vocabulary whose rows are, by default, the target's: logits scattered back to the
full vocabulary with -inf elsewhere, so q_i stays an exact distribution.) The heads do not see
one another's drafts; q_i is still a distribution the draft is drawn from, so chain verification
with it (greedy, or min(1, p/q) with the residual on rejection) stays lossless.

There is no KV cache to keep: ``FeatureCache`` with a zero-layer KV (the row operations, the
prefix store and the sharding rules handle it like any head's) and no deferred window (a plain
step only stores its output at the committed position; nothing reads the heads' weights).

Params (``init_params``): ``w`` [H, D, D], ``b`` [H, D]; ``lm_head`` [D, N] (the target's rows
for ``vocab_ids`` unless trained) and ``vocab_ids`` [N]; the target's ``final_norm`` and
``embed``, shared.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax import cache as kv
from specjax.config import ModelConfig
from specjax.drafters import heads as head_io
from specjax.drafters.device import FeatureHeadDrafter, ModelDraft, frequent_tokens
from specjax.errors import require
from specjax.models import llama

DEFAULT_HEADS = 4  # Medusa-1's usual; K above it is refused
DEFAULT_VOCAB = 4096


@dataclasses.dataclass(frozen=True)
class MedusaDraft(ModelDraft):
    """The heads as the compiled step runs them (hashable: part of the compile key)."""

    label: str = "medusa"
    features: tuple[int, ...] = ()
    heads: int = DEFAULT_HEADS
    shared_head: bool = True

    def init_cache(self, B, slots, dtype):
        D, F = self.cfg.hidden_size, len(self.features) * self.cfg.hidden_size
        z = jnp.zeros((0, B, self.cfg.num_kv_heads, slots, self.cfg.head_dim), dtype)
        return kv.FeatureCache(k=z, v=z, lengths=jnp.zeros((B,), jnp.int32), feat=jnp.zeros((B, D), dtype),
                               lag_tok=jnp.zeros((B, 0), jnp.int32), lag_feat=jnp.zeros((B, 0, F), dtype),
                               lag=jnp.zeros((B,), jnp.int32))

    def reduced(self, dparams, h, n: int | None = None):
        """Last hidden states [..., D] -> the first ``n`` heads' logits over their N tokens
        [..., n, N] (what training fits)."""
        n = self.heads if n is None else n
        x = llama.rms_norm(h, dparams["final_norm"], self.cfg.rms_eps)
        z = jnp.einsum("...d,hde->...he", x, dparams["w"][:n], preferred_element_type=jnp.float32) + dparams["b"][:n]
        y = x[..., None, :] + jax.nn.silu(z).astype(x.dtype)
        return jnp.dot(y, dparams["lm_head"], preferred_element_type=jnp.float32)

    def draft(self, dparams, dcache, prev, pending, target_lengths, K: int, samp, greedy_only: bool):
        """Draft j of every row from head j on the carried hidden state (greedy, or sampled from
        head j's warped distribution with the (seed, position) draft stream, as ModelDraft)."""
        require(K <= self.heads, f"the Medusa drafter has {self.heads} heads: at most K = {self.heads}")
        lg = self._full(dparams, self.reduced(dparams, dcache.feat, K))  # [B, K, V]
        picks = [self._pick(lg[:, j], j, target_lengths, samp, greedy_only) for j in range(K)]
        toks = jnp.stack([d for d, _, _ in picks], axis=1)
        qs = None if greedy_only else jnp.stack([q for _, q, _ in picks], axis=1)
        return toks, qs, dcache

    def prefill(self, dparams, dcache, tokens, positions, mask, n_valid, first: bool, feats=None):
        """A prefill chunk: the last valid position's hidden state is carried."""
        last = jnp.take_along_axis(feats, jnp.maximum(n_valid - 1, 0)[:, None, None], axis=1)[:, 0]
        return dataclasses.replace(kv.advance(dcache, n_valid),
                                   feat=jnp.where((n_valid > 0)[:, None], last.astype(dcache.feat.dtype), dcache.feat))

    def catch_up(self, dparams, dcache, feat0, block, feats, lengths, n_commit):
        """After verification: the hidden state of the last committed position (``n_commit``:
        accepted + 1, 0 for inactive rows)."""
        last = jnp.take_along_axis(feats, jnp.maximum(n_commit - 1, 0)[:, None, None], axis=1)[:, 0]
        return dataclasses.replace(kv.set_lengths(dcache, lengths + n_commit),
                                   feat=jnp.where((n_commit > 0)[:, None], last.astype(feat0.dtype), feat0))

    def settle(self, dparams, dcache):
        return dcache  # (nothing is ever deferred)

    def defer(self, dparams, dcache, token, feats, active):
        """A plain step: its one position's hidden state, for active rows."""
        return dataclasses.replace(kv.advance(dcache, active.astype(jnp.int32)),
                                   feat=jnp.where(active[:, None], feats.astype(dcache.feat.dtype), dcache.feat))


def _draft(cfg: ModelConfig, ids: np.ndarray, shared_head: bool = True, heads: int = DEFAULT_HEADS) -> MedusaDraft:
    require(1 <= heads <= 16, f"Medusa heads: 1..16, got {heads}")
    # (a config for its label and sizes only: the heads run no decoder layer, their cache has none)
    return MedusaDraft(cfg.replace(name=f"{cfg.name}|medusa", num_layers=1, tie_embeddings=False),
                       vocab=int(ids.size), features=(cfg.num_layers,), heads=int(heads), shared_head=shared_head)


def init_params(cfg: ModelConfig, params, vocab_ids=None, seed: int = 0, shared_head: bool = True,
                heads: int = DEFAULT_HEADS, scale: float = 0.0) -> tuple[MedusaDraft, dict]:
    """Heads for the target (``cfg``, ``params``): (MedusaDraft, its params). W starts at
    ``scale`` times a normal draw with ``seed`` (0, Medusa's start: every head is the target's
    own head) and b at zero; the vocabulary rows are the target's for ``vocab_ids`` (default:
    the ``DEFAULT_VOCAB`` lowest ids), copied and trained unless ``shared_head``."""
    D = cfg.hidden_size
    if vocab_ids is None:
        vocab_ids = frequent_tokens([], cfg.vocab_size, min(DEFAULT_VOCAB, cfg.vocab_size))
    ids = head_io.check_ids(vocab_ids, cfg.vocab_size)
    dtype = params["embed"].dtype
    draft = _draft(cfg, ids, shared_head, heads)
    w = np.random.default_rng(seed).standard_normal((heads, D, D), dtype=np.float32) * (scale / np.sqrt(D))
    trainable = {"w": jnp.asarray(w, dtype), "b": jnp.zeros((heads, D), dtype)}
    if not shared_head:
        trainable["lm_head"] = head_io.target_rows(cfg, params, ids)
    return draft, head_io.with_target(draft, trainable, ids, cfg, params)


KIND = head_io.HeadKind("medusa", "Medusa", init_params, _draft, settings=("heads",))


def build(model, head: str | None = None) -> FeatureHeadDrafter:
    """The medusa drafter on ``model``: the heads saved in ``head`` (heads.save_head with
    ``KIND``), else the ones shipped for this target, else fresh ones (each the target's head)."""
    head = head or head_io.shipped_head(KIND, model.cfg)
    if head:
        return FeatureHeadDrafter(*head_io.load_head(KIND, head, model.cfg, model.params))
    return FeatureHeadDrafter(*init_params(model.cfg, model.params))
