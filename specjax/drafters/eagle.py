"""EAGLE-style feature head (EAGLE-3 layout): a device drafter that drafts from the target's own
hidden states.

The target forward (prefill and every chain step) also returns the inputs of a low, a middle
and a high layer (``llama.feature_layers``; ``CompileKey.features``). The head fuses them
(``fc``: 3D -> D) and runs a decoder layer of the target's structure (``llama._layer``) whose
attention reads [the token's embedding (the target's, shared), the feature] while its residual
stream is the feature (one such layer, EAGLE's; ``layers`` > 1 adds layers shaped like the
target's on top); the last layer's output, through the target's final norm and a head over a
reduced vocabulary (N frequent target ids, logits scattered back to the full vocabulary with
-inf elsewhere, so q stays an exact distribution), gives the next token. Drafting is a chain:
each draft feeds the head's own output hidden as the next feature, as EAGLE does; or, with
``tree_width``, a dynamic token tree (EAGLE-2: ``draft_tree``) drafted inside the tree step.

Alignment: the head's entry at position p pairs token x_p with the fused target feature of
position p - 1 (zeros for p = 0), so it predicts x_{p+1}, as the target at p does. Its cache
(``cache.FeatureCache``, one layer) keeps, at the start of every step, the entries of every
committed position (its length equals the target's) and ``feat``, the fused target feature of
the last committed position, which goes with the pending token. Drafting writes speculative
entries from the head's own features; after verification, in the same executable,
``catch_up`` rewrites the block's entries with the target's real features and commits the
accepted ones. A K = 0 step only keeps its token and target features (``defer``; the head's
lengths then trail the target's): the head catches up on them in one block forward when its
window (``lag_window``) is full or before it drafts (``settle``), so plain steps do not read the
head's weights each time.

Params (``init_params``): ``fc`` [3D, D]; ``layer`` (``llama`` layer names; wq/wk/wv [2D, .],
``embed_norm`` for the token half); with ``layers`` > 1, ``upper``: the further layers' arrays
stacked [layers - 1, ...]; ``lm_head`` [D, N] and ``vocab_ids`` [N]; plus the
target's ``embed`` and ``final_norm``, shared (never copied, never saved with the head).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from specjax import cache as kv
from specjax.config import ModelConfig
from specjax.drafters import heads
from specjax.drafters.device import DeviceTreeDrafter, FeatureHeadDraft, FeatureHeadDrafter, frequent_tokens
from specjax.errors import require
from specjax.models import llama
from specjax.models.options import ForwardOptions

DEFAULT_VOCAB = 32768  # reduced head rows (EAGLE-3's draft vocabulary), at most the target's
trainable_of = heads.trainable_of  # (its own arrays: what is trained and saved)


@dataclasses.dataclass(frozen=True)
class EagleDraft(FeatureHeadDraft):
    """The head as the compiled step runs it (hashable: part of the compile key). ``cfg``: the
    target's config as a one-layer model; ``features``: the target layers it reads."""

    label: str = "eagle"
    features: tuple[int, ...] = ()
    shared_head: bool = False  # lm_head: the target's own rows for vocab_ids (not trained, not saved)
    # Plain (K = 0) steps leave the head's entries for later (``defer``): up to this many
    # positions per row, caught up in one block forward when the window is full or the head
    # drafts (``settle``). One entry per step read the head's weights each step (its float32
    # layer and fc, about a fifth of the Q4_1 target's bytes) while SmartSpec chose not to draft.
    lag_window: int = 16
    # Dynamic trees (EAGLE-2): ``tree_width`` > 0 drafts a token tree inside the tree step instead
    # of a chain: ``tree_depth`` expansions, each keeping the ``tree_width`` most likely new nodes
    # (cumulative draft probability) among the top-``tree_width`` children of the last ones; the
    # step's node budget takes the best nodes of all depths. 0: chains.
    tree_width: int = 0
    tree_depth: int = 4
    # The head's MLP width (``cfg.intermediate_size``): 0 is the target's. A setting its file
    # records (``KIND.settings``); ``grow`` grows a trained head to a wider one.
    mlp_width: int = 0
    # Decoder layers (``cfg.num_layers``): the first reads [embedding, feature], the others are
    # target-shaped. A setting its file records; ``grow`` stacks new layers on a trained head.
    layers: int = 1

    @property
    def drafts_trees(self) -> bool:
        return self.tree_width > 0

    @property
    def head_kind(self) -> heads.HeadKind:
        return KIND

    def init_cache(self, B, slots, dtype):
        c = llama.init_cache_for(self.cfg, B, slots, dtype)
        W, F = self.lag_window, len(self.features) * self.cfg.hidden_size
        return kv.FeatureCache(k=c.k, v=c.v, lengths=c.lengths, feat=jnp.zeros((B, self.cfg.hidden_size), dtype),
                               lag_tok=jnp.zeros((B, W), jnp.int32), lag_feat=jnp.zeros((B, W, F), dtype),
                               lag=jnp.zeros((B,), jnp.int32))

    def _fuse(self, dparams, feats):
        """Target features [B, T, 3D] -> the head's feature space [B, T, D]."""
        pack = dparams.get(FC_ROWS)
        if pack is None:
            return jnp.dot(feats, dparams["fc"], preferred_element_type=jnp.float32).astype(feats.dtype)
        fwd = self._copies_fwd(feats.shape[0] * feats.shape[1])
        return llama.dense(feats, dparams["fc"], fwd, pack, n=dparams["fc"].shape[-1]).astype(feats.dtype)

    def _forward(self, dparams, dc: kv.FeatureCache, tokens, feat, positions, mask, use_prefix: bool = True,
                 kv_before=None):
        """The head's layers on a block: (output hidden [B, T, D], dc with the block's K/V written
        at its lengths). ``kv_before``: one llama._layer ``kv_before`` per layer (training: earlier
        unroll steps). Serving params from ``for_rows_kernel`` run blocks of up to 32 rows on the
        rows kernel."""
        rope = llama.rope_tables(positions, self.cfg)
        packs = dparams.get(LAYER_ROWS)
        fwd = ForwardOptions() if packs is None else self._copies_fwd(tokens.shape[0] * tokens.shape[1])
        before = kv_before or (None,) * self.layers
        x, k, v = llama._layer(self.cfg, rope, fwd, use_prefix, feat,
                               dparams["layer"], dc.k, dc.v, 0, dc.lengths, positions, mask,
                               embed_in=dparams["embed"][tokens], kv_before=before[0], packs=packs)
        for i in range(1, self.layers):  # (the upper layers' stacks hold them alone: pack_layer)
            lp = jax.tree_util.tree_map(lambda a: a[i - 1], dparams["upper"])
            x, k, v = llama._layer(self.cfg, rope, fwd, use_prefix, x, lp, k, v, i, dc.lengths, positions, mask,
                                   kv_before=before[i], packs=dparams.get(UPPER_ROWS), pack_layer=i - 1)
        return x, dataclasses.replace(dc, k=k, v=v)

    def _reduced(self, dparams, h):
        """Output hidden [..., D] -> logits over the head's N tokens [..., N] (what training fits)."""
        x = llama.rms_norm(h, dparams["final_norm"], self.cfg.rms_eps)
        pack = dparams.get(HEAD_ROWS)
        if pack is None:
            return jnp.dot(x, dparams["lm_head"], preferred_element_type=jnp.float32)
        rows = math.prod(x.shape[:-1])
        return llama.dense(x, dparams["lm_head"], self._copies_fwd(rows), pack, n=dparams["lm_head"].shape[-1])

    def _copies_fwd(self, rows: int) -> ForwardOptions:
        """The forward the serving copies (``for_rows_kernel``) run a block of ``rows`` activation
        rows with: ``fwd`` (``copies_forward``: the engine's activations), a block past the rows
        kernel's size under a low-precision mode with XLA's attention, as the target's prefill."""
        f = self.fwd
        return f.for_prefill() if f.rows_low and rows > f.rows_kernel else f

    def _feed(self, dparams, dc: kv.FeatureCache, tok, feat):
        """One entry per row (token, feature) at the cache's lengths: (the head's logits of the
        next token, over its N; dc advanced by one, its ``feat`` the head's own output: the next
        entry's feature)."""
        B = tok.shape[0]
        h, dc = self._forward(dparams, dc, tok[:, None], feat[:, None], dc.lengths[:, None], llama.causal_mask(B, 1))
        dc = dataclasses.replace(kv.advance(dc, jnp.ones((B,), jnp.int32)), feat=h[:, 0])
        return self._reduced(dparams, h[:, 0]), dc

    # ModelDraft.draft / propose run their chain through these two.
    def _refeed(self, dparams, dcache, prev, pending, target_lengths):
        """The pending token with the last committed position's real feature: the first draft."""
        return self._feed(dparams, kv.set_lengths(dcache, target_lengths), pending, dcache.feat)

    def _next(self, dparams, dc, d):
        return self._feed(dparams, dc, d, dc.feat)

    def max_drafts(self, trees: bool) -> int | None:
        return self.tree_width * self.tree_depth if trees else None  # (chains: any K, one forward each)

    def tree_forwards(self) -> int:
        return self.tree_depth  # (one expansion per depth)

    def draft_tree(self, dparams, dcache, pending, lengths, n: int):
        """A token tree of ``n`` nodes per row drafted from the pending token (EAGLE-2's dynamic
        tree): (tokens [B, n + 1] (node 0 left 0: the pending token), parents [B, n + 1]).

        The drafting block holds the root (the pending token with the carried feature) and
        ``tree_width`` nodes per depth, each with its parent's output hidden as its feature, at
        position ``lengths`` + depth; every expansion runs the head's layer on the whole block
        under its ancestor mask (on a CPU a block of a few dozen tokens reads the weights once,
        as one token does) over the committed entries, so no drafted entry needs keeping. The
        tree is the ``n`` drafted nodes of the highest cumulative log-probability (a child's is
        at most its parent's, so they form a tree), best first (so parents first). The head's
        committed entries are untouched (the block is written past them, as scratch)."""
        W, Dp = self.tree_width, self.tree_depth
        M = 1 + W * Dp
        require(1 <= n <= M - 1, f"an EAGLE tree of width {W} and depth {Dp} has {M - 1} nodes: at most K = {M - 1}")
        B = pending.shape[0]
        D = self.cfg.hidden_size
        dc = kv.set_lengths(dcache, lengths)
        toks = jnp.zeros((B, M), jnp.int32).at[:, 0].set(pending)
        feat = jnp.zeros((B, M, D), dcache.feat.dtype).at[:, 0].set(dcache.feat)
        parent = jnp.full((B, M), -1, jnp.int32)
        depth = jnp.zeros((B, M), jnp.int32)
        cum = jnp.full((B, M), -jnp.inf, jnp.float32).at[:, 0].set(0.0)
        mask = jnp.broadcast_to(jnp.eye(M, dtype=bool), (B, M, M))
        rows = jnp.arange(B)[:, None]
        for d in range(1, Dp + 1):
            h, _ = self._forward(dparams, dc, toks, feat, lengths[:, None] + depth, mask)
            lo, width = (0, 1) if d == 1 else (1 + (d - 2) * W, W)  # the frontier: the last depth's nodes
            logp = jax.nn.log_softmax(self._reduced(dparams, h[:, lo:lo + width]), axis=-1)  # [B, width, N]
            top, idx = jax.lax.top_k(logp, W)  # each frontier node's W best children
            score = (cum[:, lo:lo + width, None] + top).reshape(B, width * W)
            best, pick = jax.lax.top_k(score, W)  # the W best new nodes
            par = lo + pick // W
            slots = 1 + (d - 1) * W + jnp.arange(W)
            toks = toks.at[:, slots].set(dparams["vocab_ids"][idx.reshape(B, width * W)[rows, pick]])
            feat = feat.at[:, slots].set(h[rows, par])
            parent = parent.at[:, slots].set(par)
            depth = depth.at[:, slots].set(d)
            cum = cum.at[:, slots].set(best)
            own = jax.nn.one_hot(slots, M, dtype=bool)[None]  # [1, W, M]
            mask = mask.at[:, slots].set(mask[rows, par] | own)
        # the n best drafted nodes, best first (top_k puts the earlier slot first on a tie, so a
        # parent comes before its child): the first m of them are the m-node tree, for every m
        _, keep = jax.lax.top_k(jnp.where(jnp.arange(M) > 0, cum, -jnp.inf), n)
        new_of = jnp.zeros((B, M), jnp.int32).at[rows, keep].set(jnp.arange(1, n + 1, dtype=jnp.int32)[None])
        parents = jnp.concatenate([jnp.full((B, 1), -1, jnp.int32),
                                   new_of[rows, jnp.take_along_axis(parent, keep, axis=1)]], axis=1)
        tokens = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), jnp.take_along_axis(toks, keep, axis=1)], axis=1)
        return tokens, parents

    def prefill(self, dparams, dcache, tokens, positions, mask, n_valid, first: bool, feats=None):
        """One prefill chunk: entries for the chunk's tokens, each with the fused target feature of
        the position before it (the carried ``feat`` for the first)."""
        fused = self._fuse(dparams, feats)
        g = jnp.concatenate([dcache.feat[:, None], fused[:, :-1]], axis=1)
        _, dc = self._forward(dparams, dcache, tokens, g, positions, mask, use_prefix=not first)
        last = jnp.take_along_axis(fused, jnp.maximum(n_valid - 1, 0)[:, None, None], axis=1)[:, 0]
        return dataclasses.replace(kv.advance(dc, n_valid), feat=jnp.where((n_valid > 0)[:, None], last, dcache.feat))

    def catch_up(self, dparams, dcache, feat0, block, feats, lengths, n_commit):
        """After verification: the step's block [pending, d_1..d_K] at the target's positions
        ``lengths`` + i, each token with the real feature of the position before it (``feat0``,
        the step's carried one, for the pending token), written over the draft-time entries;
        the first ``n_commit`` (accepted + 1; 0 for inactive rows) are committed and the feature
        of the last committed position is carried."""
        B, T = block.shape
        fused = self._fuse(dparams, feats)
        g = jnp.concatenate([feat0[:, None], fused[:, :-1]], axis=1)
        pos = lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        _, dc = self._forward(dparams, kv.set_lengths(dcache, lengths), block, g, pos, llama.causal_mask(B, T))
        last = jnp.take_along_axis(fused, jnp.maximum(n_commit - 1, 0)[:, None, None], axis=1)[:, 0]
        return dataclasses.replace(kv.advance(dc, n_commit), feat=jnp.where((n_commit > 0)[:, None], last, feat0))


    def settle(self, dparams, dcache):
        """The head caught up on the positions plain steps deferred (``catch_up`` of its lag
        window, each token with the target feature of the position before it), its lengths the
        target's again; unchanged where nothing is deferred."""
        def go(dc):
            dc = self.catch_up(dparams, dc, dc.feat, dc.lag_tok, dc.lag_feat, dc.lengths, dc.lag)
            return dataclasses.replace(dc, lag=jnp.zeros_like(dc.lag))

        return jax.lax.cond(jnp.any(dcache.lag > 0), go, lambda dc: dc, dcache)

    def defer(self, dparams, dcache, token, feats, active):
        """A plain step's committed token [B] and its target features [B, F], kept for a later
        catch-up by active rows (a full window is caught up first)."""
        W = self.lag_window
        dcache = jax.lax.cond(jnp.any(active & (dcache.lag >= W)), lambda dc: self.settle(dparams, dc),
                              lambda dc: dc, dcache)
        rows, at = jnp.arange(token.shape[0]), jnp.where(active, dcache.lag, W)  # (W: dropped)
        return dataclasses.replace(dcache, lag_tok=dcache.lag_tok.at[rows, at].set(token, mode="drop"),
                                   lag_feat=dcache.lag_feat.at[rows, at].set(feats.astype(dcache.lag_feat.dtype),
                                                                             mode="drop"),
                                   lag=dcache.lag + active.astype(jnp.int32))


# Serving copies for the CPU rows kernel (for_rows_kernel): the first layer's projections as
# one-layer stacks (read at the head's layer index 0), the upper layers' as their own stacks, the
# vocabulary head and fc, each Q8_0.
LAYER_ROWS, UPPER_ROWS, HEAD_ROWS, FC_ROWS = ("layer" + llama.ROWS_SUFFIX, "upper" + llama.ROWS_SUFFIX,
                                              "lm_head" + llama.ROWS_SUFFIX, "fc" + llama.ROWS_SUFFIX)


def copies_forward(activations: str = "float32") -> ForwardOptions:
    """The head's own forward (``EagleDraft.fwd``) on its serving copies in an engine whose rows
    kernel multiplies ``activations``: blocks of up to 32 rows on the kernel in that mode (under
    bfloat16 or int8 the CPU attention, which those need; in float32 XLA's). In float32 the
    head's Q8_0 projections ran at 21-27 GMAC/s, about 0.45 ms of a K = 1 step that costs 0.93 ms
    more than a plain one (benchmarks/step_breakdown.py --drafter eagle --k 1, AVX-512 EPYC)."""
    low = activations != "float32"
    return ForwardOptions(rows_kernel=32, rows_activations=activations, attention="cpu" if low else "xla")


def _q8_0(w: np.ndarray):
    """A float32 weight [K, N] rounded to Q8_0 as a GGUF stores it (per column and 32 inputs:
    d = amax / 127 in float16, q = x / d to nearest, within +-127): (d [N, G] float16, q [N, G, 32]
    int8, the [K, N] float32 values q * d, which the rows kernel decodes exactly)."""
    K, N = w.shape
    g = np.asarray(w, np.float32).T.reshape(N, K // 32, 32)
    d16 = (np.abs(g).max(axis=2) / np.float32(127)).astype(np.float16)
    d = d16.astype(np.float32)[:, :, None]
    q = np.clip(np.rint(np.divide(g, d, out=np.zeros_like(g), where=d > 0)), -127, 127).astype(np.int8)
    return d16, q, (q.astype(np.float32) * d).reshape(N, K).T.copy()


def for_rows_kernel(dparams, activations: str = "float32") -> dict:
    """Serving params of a head for the CPU rows kernel: its layer's projections and vocabulary
    head rounded to Q8_0 (``_q8_0``), the float32 arrays replaced by the values the kernel decodes,
    so blocks on XLA's dot (over 32 rows: prefill, catch-up) and on the kernel (draft feeds)
    compute the same head. Each feed read the float32 weights, about 35 MB on SmolLM2 (a K = 3
    chain about 3 ms at this CPU's 30-35 GB/s: the log, 2026-12-07 afternoon); Q8_0 reads 9.
    ``activations``: what the kernel multiplies them with (``copies_forward``); bfloat16 and int8
    read packs in their paired layout."""
    from specjax.models.cpu import rows_dot

    upper = dparams.get("upper", {})
    if (any(np.shape(dparams["layer"][n])[0] % 32 for n in llama.PROJECTIONS)
            or any(np.shape(upper[n])[1] % 32 for n in upper if n in llama.PROJECTIONS)
            or np.shape(dparams["lm_head"])[0] % 32 or np.shape(dparams["fc"])[0] % 32):
        return dparams  # (Q8_0 groups 32 inputs)
    pairs = activations != "float32"

    def copies(layers: list[dict]):
        """Layers' arrays -> (their projections as the kernel decodes them, the fused stacks)."""
        packs, values = {}, [dict(lp) for lp in layers]
        for name in llama.PROJECTIONS:
            parts = []
            for lp in values:
                d, q, lp[name] = _q8_0(lp[name])
                parts.append(rows_dot.pack_q8_0(d, q, pairs))
            packs[name] = rows_dot.stack_packs(parts)
        return values, llama.fuse_packs(packs, {n: np.shape(values[0][n])[1] for n in llama.PROJECTIONS})

    out = dict(dparams)
    (layer,), packs = copies([dparams["layer"]])
    if upper:
        n = len(next(iter(upper.values())))
        values, out[UPPER_ROWS] = copies([{k: np.asarray(a[i]) for k, a in upper.items()} for i in range(n)])
        out["upper"] = {k: jnp.asarray(np.stack([lp[k] for lp in values])) for k in upper}
    d, q, lm_head = _q8_0(dparams["lm_head"])
    fd, fq, fc = _q8_0(dparams["fc"])  # (the fused features: 4 MB a step in float32, 1 in Q8_0)
    out.update(layer={k: jnp.asarray(v) for k, v in layer.items()}, lm_head=jnp.asarray(lm_head), fc=jnp.asarray(fc),
               **{LAYER_ROWS: packs, HEAD_ROWS: rows_dot.pack_q8_0(d, q, pairs), FC_ROWS: rows_dot.pack_q8_0(fd, fq, pairs)})
    return out


def head_config(cfg: ModelConfig, mlp_width: int = 0, layers: int = 1) -> ModelConfig:
    """The target's config as the head's model of ``layers`` layers (its own head, not tied; its
    MLP ``mlp_width`` wide, 0: the target's width)."""
    require(mlp_width >= 0 and mlp_width % 32 == 0, f"an EAGLE head's MLP width is a multiple of 32 (0: the "
            f"target's {cfg.intermediate_size}), got {mlp_width}")
    require(1 <= layers <= 8, f"an EAGLE head has 1 to 8 layers, got {layers}")
    return cfg.replace(name=f"{cfg.name}|eagle", num_layers=layers, tie_embeddings=False,
                       intermediate_size=mlp_width or cfg.intermediate_size)


def init_params(cfg: ModelConfig, params, vocab_ids=None, seed: int = 0, shared_head: bool = False,
                mlp_width: int = 0, layers: int = 1) -> tuple[EagleDraft, dict]:
    """A random-initialised head for the target (``cfg``, ``params``): (EagleDraft, its params).
    ``vocab_ids``: the reduced head's target ids (default: ``frequent_tokens`` with no counts, the
    ``DEFAULT_VOCAB`` lowest ids, BPE's earliest merges); its rows start as the target head's
    rows for those ids (copied; with ``shared_head`` they stay those rows, not trained, not
    saved), the rest is drawn with ``seed``; its MLP ``mlp_width`` wide (0: the target's); ``layers``
    decoder layers."""
    D, H, Hkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    F = head_config(cfg, mlp_width, layers).intermediate_size
    if vocab_ids is None:
        vocab_ids = frequent_tokens([], cfg.vocab_size, min(DEFAULT_VOCAB, cfg.vocab_size))
    ids = heads.check_ids(vocab_ids, cfg.vocab_size)
    dtype = params["embed"].dtype
    rng = np.random.default_rng(seed)

    def w(rows, cols):
        return jnp.asarray(rng.standard_normal((rows, cols), dtype=np.float32) / math.sqrt(rows), dtype)

    def layer(inputs: int) -> dict:
        lp = {"attn_norm": jnp.ones((D,), dtype), "wq": w(inputs, H * hd), "wk": w(inputs, Hkv * hd),
              "wv": w(inputs, Hkv * hd), "wo": w(H * hd, D), "mlp_norm": jnp.ones((D,), dtype),
              "w_gate": w(D, F), "w_up": w(D, F), "w_down": w(F, D)}
        if cfg.qkv_bias:
            lp.update(bq=jnp.zeros((H * hd,), dtype), bk=jnp.zeros((Hkv * hd,), dtype), bv=jnp.zeros((Hkv * hd,), dtype))
        return lp

    first = {"embed_norm": jnp.ones((D,), dtype), **layer(2 * D)}  # (drawn before fc: seeds keep their heads)
    trainable = {"fc": w(3 * D, D), "layer": first}
    if layers > 1:
        upper = [layer(D) for _ in range(layers - 1)]
        trainable["upper"] = {k: jnp.stack([lp[k] for lp in upper]) for k in upper[0]}
    if not shared_head:
        trainable["lm_head"] = heads.target_rows(cfg, params, ids)
    draft = _draft(cfg, ids, shared_head, mlp_width, layers)
    return draft, heads.with_target(draft, trainable, ids, cfg, params)


def _draft(cfg: ModelConfig, ids: np.ndarray, shared_head: bool = False, mlp_width: int = 0,
           layers: int = 1) -> EagleDraft:
    return EagleDraft(head_config(cfg, mlp_width, layers), vocab=int(ids.size),
                      features=llama.feature_layers(cfg.num_layers), shared_head=shared_head, mlp_width=mlp_width,
                      layers=layers)


def grow(new: dict, saved: dict) -> dict:
    """A trained head's arrays (``saved``) in a head of a wider MLP and/or more layers (``new``: a
    fresh head's trainable arrays), computing the same function. Wider: the saved MLP in the
    first columns of gate/up and the first rows of down, the new rows of down zero (so the new
    columns add nothing until trained), the new gate/up columns as drawn (so they get gradients).
    Deeper: each new layer as drawn but with ``wo`` and ``w_down`` zero, so it passes its input
    through until trained (its other arrays get gradients once those two move). Every other
    array must match in shape."""
    saved = dict(saved)
    require("upper" in new or "upper" not in saved, "a head cannot shrink to fewer layers")
    if "upper" in new:
        have = len(next(iter(saved["upper"].values()))) if "upper" in saved else 0
        add = {k: np.asarray(a)[have:] * (0 if k in ("wo", "w_down") else 1) for k, a in new["upper"].items()}
        if have:  # (the saved layers widened first, as every other layer)
            add = {k: np.concatenate([put_into(np.asarray(new["upper"][k])[:have], np.asarray(a), k, "upper"), add[k]])
                   for k, a in saved["upper"].items()}
        saved["upper"] = add

    def put(path, a, b):
        return jnp.asarray(put_into(np.asarray(a), np.asarray(b), getattr(path[-1], "key", None),
                                    jax.tree_util.keystr(path)))

    return jax.tree_util.tree_map_with_path(put, new, saved)


def put_into(a: np.ndarray, b: np.ndarray, name, where: str) -> np.ndarray:
    """Saved array ``b`` in the (larger) new array ``a`` of the same MLP matrix (``grow``): its
    last two axes in the first rows and columns; new rows of ``w_down`` zero."""
    if a.shape == b.shape:
        return b.astype(a.dtype)
    require(name in ("w_gate", "w_up", "w_down") and a.ndim == b.ndim >= 2 and a.shape[:-2] == b.shape[:-2]
            and b.shape[-2] <= a.shape[-2] and b.shape[-1] <= a.shape[-1],
            f"a head of shape {b.shape} at {where} cannot grow into {a.shape}")
    out = np.zeros_like(a) if name == "w_down" else a.copy()
    out[..., :b.shape[-2], :b.shape[-1]] = b
    return out


KIND = heads.HeadKind("eagle", "EAGLE", init_params, _draft, settings=("mlp_width", "layers"),
                      options=(("mlp_width", "eagle_mlp_width"), ("layers", "eagle_layers")),
                      train_step="specjax.distill.eagle_train:batch_step", unrolls=True,
                      chain_hits="specjax.distill.eagle_train:chain_hits", attends=True,
                      serving_copies=for_rows_kernel, grow=grow)
HEAD_FILE = KIND.file


def save_head(directory: str, cfg: ModelConfig, dparams, draft: EagleDraft | None = None, dtype=None) -> None:
    """Write the head to ``directory`` (heads.save_head: its own arrays, cast to ``dtype`` if
    given, and ``eagle.json``)."""
    heads.save_head(KIND, directory, cfg, dparams, draft or _draft(cfg, np.asarray(dparams["vocab_ids"])), dtype)


def read_spec(directory: str, cfg: ModelConfig) -> dict:
    """``eagle.json`` of the head in ``directory``, checked to be of this target."""
    return heads.read_spec(KIND, directory, cfg)


def load_head(directory: str, cfg: ModelConfig, params) -> tuple[EagleDraft, dict]:
    """(EagleDraft, params) of the head saved in ``directory`` for this target (heads.load_head)."""
    return heads.load_head(KIND, directory, cfg, params)


def shipped_head(cfg: ModelConfig) -> str | None:
    """The directory of the head shipped for this target, if there is one."""
    return heads.shipped_head(KIND, cfg)


EagleDrafter = FeatureHeadDrafter  # (the engine's drafter of a feature head, drafters.device)


def build(model, head: str | None = None, tree_width: int = 0, tree_depth: int = 4,
          activations: str = "float32") -> FeatureHeadDrafter:
    """The eagle drafter on ``model`` (a LoadedModel): the head saved in ``head`` (a directory,
    ``save_head``), else the one shipped for this target (``heads.SHIPPED``), else a
    random-initialised one (``init_params``' defaults); drafting chains, or with ``tree_width``
    > 0 dynamic trees of that width and ``tree_depth``. ``activations``: the engine's rows kernel
    mode, which the head's serving copies run in too."""
    require(tree_width >= 0 and 1 <= tree_depth <= 16,
            f"EAGLE trees: width >= 0 and depth 1..16, got width {tree_width}, depth {tree_depth}")
    head = head or heads.shipped_head(KIND, model.cfg)
    draft, dparams = load_head(head, model.cfg, model.params) if head else init_params(model.cfg, model.params)
    rows = getattr(model, "auto_rows_kernel", lambda: 0)()  # (the launch scripts' choice for the target)
    if rows and dparams["lm_head"].dtype == jnp.float32:
        dparams = for_rows_kernel(dparams, activations)
        draft = dataclasses.replace(draft, fwd=copies_forward(activations))
    if tree_width:
        return DeviceTreeDrafter(dataclasses.replace(draft, tree_width=tree_width, tree_depth=tree_depth), dparams)
    return FeatureHeadDrafter(draft, dparams)


def copies_activations(fwd: ForwardOptions | None) -> str:
    """The activations a head's serving copies run in within an engine running ``fwd``: its rows
    kernel's mode, float32 without the kernel."""
    return fwd.rows_activations if fwd is not None and fwd.rows_kernel else "float32"


def build_kind(model, spec, draft=None) -> FeatureHeadDrafter:
    """The ``eagle`` kind from its DrafterSpec (drafters.table)."""
    return build(model, spec.eagle_head, spec.eagle_tree_width, spec.eagle_tree_depth, copies_activations(spec.fwd))
