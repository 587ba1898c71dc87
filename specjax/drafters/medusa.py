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
prefix store and the sharding rules handle it like any head's) and nothing deferred (a plain
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
from specjax.drafters.device import DeviceTreeDrafter, FeatureHeadDraft, FeatureHeadDrafter, frequent_tokens
from specjax.errors import require
from specjax.models import llama

DEFAULT_HEADS = 4  # Medusa-1's usual; K above it is refused
DEFAULT_VOCAB = 4096


@dataclasses.dataclass(frozen=True)
class MedusaDraft(FeatureHeadDraft):
    """The heads as the compiled step runs them (hashable: part of the compile key)."""

    label: str = "medusa"
    features: tuple[int, ...] = ()
    heads: int = DEFAULT_HEADS
    shared_head: bool = True
    # Tree mode: nodes 1..M of a static token tree as (parent node, rank) pairs, parents first
    # (node 0: the pending token); node i's token is the rank-th best of head depth(i) - 1. A
    # step with a budget of k nodes verifies the first k (a prefix of this order is a tree).
    # Empty: chains (draft j = head j's choice).
    tree: tuple[tuple[int, int], ...] = ()

    @property
    def head_kind(self) -> head_io.HeadKind:
        return KIND

    def init_cache(self, B, slots, dtype):
        D, F = self.cfg.hidden_size, len(self.features) * self.cfg.hidden_size
        z = jnp.zeros((0, B, self.cfg.num_kv_heads, slots, self.cfg.head_dim), dtype)
        # (a deferred window of 1, never used: a zero-width per-row field loses its row sharding
        # on a mesh, XLA returning empty arrays replicated)
        return kv.FeatureCache(k=z, v=z, lengths=jnp.zeros((B,), jnp.int32), feat=jnp.zeros((B, D), dtype),
                               lag_tok=jnp.zeros((B, 1), jnp.int32), lag_feat=jnp.zeros((B, 1, F), dtype),
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
        lg = self.reduced(dparams, dcache.feat, K)  # [B, K, N]
        picks = [self._pick(dparams, lg[:, j], j, target_lengths, samp, greedy_only) for j in range(K)]
        toks = jnp.stack([d for d, _, _ in picks], axis=1)
        qs = None if greedy_only else jnp.stack([q for _, q, _ in picks], axis=1)
        return toks, qs, dcache

    def max_drafts(self, trees: bool) -> int | None:
        return len(self.tree) if trees else self.heads

    def tree_forwards(self) -> int:
        return 1  # (every head at once on the carried state)

    def tree_parents(self, n: int) -> np.ndarray:
        """Parents [n + 1] of the tree's first n nodes (-1 for node 0)."""
        require(n <= len(self.tree), f"the Medusa tree has {len(self.tree)} nodes: at most K = {len(self.tree)}")
        return np.asarray([-1] + [p for p, _ in self.tree[:n]], np.int32)

    @property
    def drafts_trees(self) -> bool:
        return bool(self.tree)

    def draft_tree(self, dparams, dcache, pending, lengths, n: int):
        """Tokens [B, n + 1] of the tree's first n nodes (node 0 left 0: the pending token) and
        its parents [n + 1]: each node the rank-th most likely token of its depth's head (the
        same at every temperature: distinct deterministic siblings, verified as such)."""
        parents = self.tree_parents(n)
        depth = np.zeros(n + 1, np.int32)
        for i in range(1, n + 1):
            depth[i] = depth[parents[i]] + 1
        ranks = np.asarray([0] + [r for _, r in self.tree[:n]], np.int32)
        top = int(ranks.max()) + 1
        _, ids = jax.lax.top_k(self.reduced(dparams, dcache.feat, int(depth.max())), top)  # [B, H, top]
        toks = dparams["vocab_ids"][ids]
        nodes = toks[:, np.maximum(depth - 1, 0), ranks]  # [B, n + 1]
        return nodes.at[:, 0].set(0), jnp.asarray(parents)

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


def best_tree(accuracy, n: int) -> tuple[tuple[int, int], ...]:
    """The n-node tree whose nodes have the largest chance of being on the accepted path, given
    ``accuracy`` [heads, ranks]: the chance that head d's rank-r token is the target's (node
    value: the product along its path, as Medusa builds its trees). Best first, so every prefix
    is itself the best tree of its size under this model, parents before children."""
    import heapq

    acc = np.asarray(accuracy, np.float64)
    H, R = acc.shape
    out: list[tuple[int, int]] = []
    heap = [(-acc[0, r], r, 0, 0, r) for r in range(R)]  # (-value, tie, parent node, depth, rank)
    depth_of = [0]
    while heap and len(out) < n:
        v, _, parent, d, r = heapq.heappop(heap)
        out.append((parent, r))
        depth_of.append(d + 1)
        if d + 1 < H:
            node = len(out)
            for r2 in range(R):
                heapq.heappush(heap, (v * acc[d + 1, r2], node * R + r2, node, d + 1, r2))
    return tuple(out)


# The tree a head set starts with, before its accuracy is measured: head d's rank-r token taken
# to be right 0.5 * 0.7^d * 0.45^r of the time (head 0 about as good as a weak EAGLE head's first
# draft; each later head and each lower rank less likely).
def prior_accuracy(heads: int, ranks: int = 4) -> np.ndarray:
    return 0.5 * 0.7 ** np.arange(heads)[:, None] * 0.45 ** np.arange(ranks)[None, :]


TREE_NODES = 16  # the largest node budget a default tree offers


def _draft(cfg: ModelConfig, ids: np.ndarray, shared_head: bool = True, heads: int = DEFAULT_HEADS,
           tree=None) -> MedusaDraft:
    require(1 <= heads <= 16, f"Medusa heads: 1..16, got {heads}")
    tree = () if tree is None else tuple((int(p), int(r)) for p, r in tree)
    # (a config for its label and sizes only: the heads run no decoder layer, their cache has none)
    return MedusaDraft(cfg.replace(name=f"{cfg.name}|medusa", num_layers=1, tie_embeddings=False),
                       vocab=int(ids.size), features=(cfg.num_layers,), heads=int(heads), shared_head=shared_head,
                       tree=tree)


def init_params(cfg: ModelConfig, params, vocab_ids=None, seed: int = 0, shared_head: bool = True,
                heads: int = DEFAULT_HEADS, scale: float = 0.0, tree=None) -> tuple[MedusaDraft, dict]:
    """Heads for the target (``cfg``, ``params``): (MedusaDraft, its params). W starts at
    ``scale`` times a normal draw with ``seed`` (0, Medusa's start: every head is the target's
    own head) and b at zero; the vocabulary rows are the target's for ``vocab_ids`` (default:
    the ``DEFAULT_VOCAB`` lowest ids), copied and trained unless ``shared_head``."""
    D = cfg.hidden_size
    if vocab_ids is None:
        vocab_ids = frequent_tokens([], cfg.vocab_size, min(DEFAULT_VOCAB, cfg.vocab_size))
    ids = head_io.check_ids(vocab_ids, cfg.vocab_size)
    dtype = params["embed"].dtype
    draft = _draft(cfg, ids, shared_head, heads, tree)
    w = np.random.default_rng(seed).standard_normal((heads, D, D), dtype=np.float32) * (scale / np.sqrt(D))
    trainable = {"w": jnp.asarray(w, dtype), "b": jnp.zeros((heads, D), dtype)}
    if not shared_head:
        trainable["lm_head"] = head_io.target_rows(cfg, params, ids)
    return draft, head_io.with_target(draft, trainable, ids, cfg, params)


def check_k(k: int, settings: dict) -> None:
    """A chain's draft j is head j's (``MedusaDraft.max_drafts``): K above the heads is refused
    from the settings alone, before a model is loaded."""
    heads = settings.get("heads", DEFAULT_HEADS)
    require(k <= heads, f"--k {k} drafts more than --medusa_heads {heads} heads can")


KIND = head_io.HeadKind("medusa", "Medusa", init_params, _draft, settings=("heads", "tree"),
                        train_step="specjax.distill.medusa_train:batch_step", options=(("heads", "medusa_heads"),),
                        after_round="specjax.distill.medusa_train:after_round", check=check_k,
                        chain_hits="specjax.distill.medusa_train:chain_hits")


def build(model, head: str | None = None, tree: bool = True) -> FeatureHeadDrafter:
    """The medusa drafter on ``model``: the heads saved in ``head`` (heads.save_head with
    ``KIND``), else the ones shipped for this target, else fresh ones (each the target's head);
    ``tree``: drafting the heads' tree (their saved one, else ``best_tree`` of the prior), else
    chains."""
    head = head or head_io.shipped_head(KIND, model.cfg)
    draft, dparams = (head_io.load_head(KIND, head, model.cfg, model.params) if head
                      else init_params(model.cfg, model.params))
    if not tree:
        return FeatureHeadDrafter(dataclasses.replace(draft, tree=()), dparams)
    if not draft.tree:
        draft = dataclasses.replace(draft, tree=best_tree(prior_accuracy(draft.heads), TREE_NODES))
    return DeviceTreeDrafter(draft, dparams)


def build_kind(model, spec, draft=None) -> FeatureHeadDrafter:
    """The ``medusa`` kind from its DrafterSpec (drafters.table)."""
    return build(model, spec.medusa_head, spec.medusa_tree)
