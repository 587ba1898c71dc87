"""Per-request draft counts (SmartSpec's request-level K) and packed verify blocks: the packed
forward equals the [B, T] block where it matters, every drafter stays token-identical to
autoregressive greedy when rows verify different draft counts in packed steps, and the goodput
selector gives drafts to the requests whose drafts pay."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import buckets as bk
from specjax.drafters.device import layer_skip
from specjax.drafters.prompt_lookup import PromptLookupDrafter
from specjax.engine.jax_backend import JaxBackend
from specjax.engine.loop import EventClock, ServingEngine
from specjax.engine.scheduler import Request
from specjax.goodput import FixedK, GoodputPolicy, LinearCost, StepCostModel
from specjax.goodput.selector import BatchView, _allocate
from specjax.models import llama
from specjax.reference_ar import reference_generate

KS = (0, 1, 2)
ROWS = (1, 4)
MAX_NEW = 14


def _prompts():
    rng = np.random.default_rng(3)
    out = []
    for i in range(7):
        unit = list(rng.integers(1, 255, size=int(rng.integers(2, 4))))
        out.append((unit * 6)[:12] if i % 2 == 0 else list(rng.integers(1, 255, size=int(rng.integers(4, 12)))))
    return out


PROMPTS = _prompts()


class RowK(FixedK):
    """Fixed K with per-request draft counts 0..K cycling over the batch (every step mixes rows
    that verify nothing, some and all of their drafts)."""

    def __init__(self, k, draft_threshold=None):
        super().__init__(k)
        self.draft_threshold = draft_threshold
        self.turn = 0

    def row_drafts(self, view, k):
        self.turn += 1
        return [(i + self.turn) % (k + 1) for i in range(view.n)]


@pytest.fixture(scope="module")
def reference(tiny):
    cfg, params = tiny
    return [r.tokens for r in reference_generate(cfg, params, PROMPTS, max_new_tokens=MAX_NEW, batch_buckets=(1,))]


def test_token_buckets_rule():
    assert bk.token_buckets(1, 8, (0, 2, 4, 8)) == ()  # one row: its tokens are its K
    assert bk.token_buckets(4, 8, (0, 2, 4, 8)) == (4, 12, 20)
    assert bk.token_buckets(4, 0, (0, 2, 4, 8)) == ()
    assert bk.token_bucket(4, 8, (0, 2, 4, 8), 13) == 20
    assert bk.token_bucket(4, 8, (0, 2, 4, 8), 21) == 0  # only the full block (36 rows) holds it


def test_packed_forward_matches_the_block(tiny):
    """Projections and MLP on the packed rows, attention on the block: logits at the packed
    positions and the cache entries they write equal the unpacked forward's."""
    cfg, params = tiny
    B, T, S = 3, 4, 32
    rng = np.random.default_rng(0)
    cache = llama.init_cache_for(cfg, B, S)
    prompt = jnp.asarray(rng.integers(1, 255, (B, 6)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(6), (B, 6))
    _, cache = llama.forward(params, prompt, pos, cache, llama.causal_mask(B, 6), cfg=cfg)
    cache = cache.__class__(k=cache.k, v=cache.v, lengths=jnp.asarray([6, 4, 5], jnp.int32))
    toks = jnp.asarray(rng.integers(1, 255, (B, T)), jnp.int32)
    pos = cache.lengths[:, None] + jnp.arange(T)[None, :]
    real = np.array([4, 1, 2])  # tokens per row that matter
    idx = np.concatenate([b * T + np.arange(real[b]) for b in range(B)])
    pack = jnp.asarray(np.concatenate([idx, [B * T] * 2]), jnp.int32)  # two padding entries
    full, c_full = llama.forward(params, toks, pos, cache, llama.causal_mask(B, T), cfg=cfg)
    packed, c_pack = llama.forward(params, toks, pos, cache, llama.causal_mask(B, T), cfg=cfg, pack=pack)
    for b in range(B):
        np.testing.assert_allclose(packed[b, :real[b]], full[b, :real[b]], rtol=1e-5, atol=1e-5)
        assert not np.any(np.asarray(packed[b, real[b]:]))  # positions not packed: zero logits
        for j in range(real[b]):
            slot = int(cache.lengths[b]) + j
            np.testing.assert_allclose(c_pack.k[:, b, :, slot], c_full.k[:, b, :, slot], rtol=1e-5, atol=1e-5)


def _backend(tiny, kind):
    cfg, params = tiny
    if kind == "prompt_lookup":
        kw = {"drafter": PromptLookupDrafter()}
    elif kind == "suffix_tree":
        from specjax.drafters.suffix import SuffixConfig, SuffixDrafter

        kw = {"drafter": SuffixDrafter(SuffixConfig(max_depth=16, alpha=2.0, min_prob=0.05))}
    else:
        d, dparams = layer_skip(cfg, params, 2)
        kw = {"draft": d, "draft_params": dparams, "draft_first": kind == "layer_skip_ahead"}
    be = JaxBackend(cfg, params, k_buckets=KS, batch_buckets=ROWS, slots=256, shrink_patience=2, packed=True, **kw)
    be.warmup(prompt_lens=[16])
    return be


@pytest.mark.parametrize("kind", ["prompt_lookup", "suffix_tree", "layer_skip", "layer_skip_ahead"])
def test_per_request_drafts_in_packed_steps_are_lossless(tiny, reference, kind):
    """Requests join and leave while every step gives rows different draft counts (0..K) and runs
    packed blocks: chains from the host, token trees, a device draft fused in the step and drafted
    ahead (confidence path); every output is the target's greedy one."""
    be = _backend(tiny, kind)
    eng = ServingEngine(be, RowK(2, draft_threshold=0.0 if kind == "layer_skip_ahead" else None),
                        clock=EventClock())
    packed_steps = []
    step = be.step

    def spy(rs, k, row_k=None):
        out = step(rs, k, row_k)
        packed_steps.append(be.last_tokens < be.B * (be.last_k_step + 1))
        return out

    be.step = spy
    outs = eng.run([Request(f"q{i}", p, MAX_NEW, arrival=i * 0.003) for i, p in enumerate(PROMPTS)])
    assert [o.tokens for o in outs] == reference
    assert any(packed_steps), "no step ran a packed block"
    assert sum(o.drafted for o in outs) > 0


def test_selector_gives_drafts_to_the_requests_that_pay():
    """Two requests whose drafts are almost always accepted and two whose drafts never are: with
    packed sizes on offer, the request-level choice drafts for the first two only and beats the
    best batch-level K on the same cost model."""
    cost = StepCostModel(target=LinearCost(0.0, 1e-3, 1e-2))  # 10 ms a step + 1 ms a verified token
    pol = GoodputPolicy(cost, per_request=True, per_request_k=True)
    for _ in range(8):
        pol.observe(4, [4, 4, 4, 4], [4, 4, 0, 0], ["a", "b", "c", "d"])
    view = BatchView(ctx_lens=[50] * 4, bucket=4, k_options=(0, 2, 4), request_ids=["a", "b", "c", "d"],
                     draft_lens=[4, 4, 4, 4], token_options={4: bk.token_buckets(4, 4, (0, 2, 4)), 2: ()})
    k = pol.choose(view)
    batch_best = max(pol.last_goodputs.values())
    rows = pol.row_drafts(view, k)
    assert k == 4 and rows[0] == rows[1] == 4 and rows[2] == rows[3] == 0
    m = rows
    got = sum(float(e[j]) for e, j in zip(pol.row_expected(view, 4), m)) / pol.step_cost(view, 4, 4 + sum(m))
    assert got > batch_best
    # Without packed sizes a step costs its whole block: nothing to gain per request.
    pol2 = GoodputPolicy(cost, per_request=True, per_request_k=True)
    pol2.acc = pol.acc
    pol2.choose(BatchView(ctx_lens=[50] * 4, bucket=4, k_options=(0, 2, 4), request_ids=["a", "b", "c", "d"],
                          draft_lens=[4, 4, 4, 4]))
    assert pol2.row_drafts(view, 4) is None


def test_allocate_takes_the_largest_marginal_gains_in_order():
    rows = [np.array([1.0, 1.9, 2.7]), np.array([1.0, 1.2, 1.3]), np.array([1.0])]
    assert _allocate(rows, 2) == [2, 0, 0]
    assert _allocate(rows, 3) == [2, 1, 0]
    assert _allocate(rows, 10) == [2, 2, 0]
    assert _allocate(rows, 0) == [0, 0, 0]


def test_goodput_policy_per_request_on_the_engine_is_lossless(tiny, reference):
    """SmartSpec-req end to end on a packed prompt-lookup backend: lossless, with the policy asked
    for per-request counts every step."""
    be = _backend(tiny, "prompt_lookup")
    cost = StepCostModel(target=LinearCost(0.0, 4e-3, 1e-2))  # verified tokens dear: drafts must earn their place
    pol = GoodputPolicy(cost, per_request=True, per_request_k=True)
    seen = []
    rd = pol.row_drafts
    pol.row_drafts = lambda view, k: seen.append(rd(view, k)) or seen[-1]
    calls = []  # single steps (a run of K = 0 steps in one decode call asks nothing between them)
    be.step = lambda *a, _s=be.step: calls.append(1) or _s(*a)
    eng = ServingEngine(be, pol, clock=EventClock())
    try:
        outs = eng.run([Request(f"q{i}", p, MAX_NEW, arrival=i * 0.003) for i, p in enumerate(PROMPTS)])
    finally:
        del be.step
    assert [o.tokens for o in outs] == reference
    assert pol.name == "SmartSpec-req" and len(seen) == len(calls) > 0
