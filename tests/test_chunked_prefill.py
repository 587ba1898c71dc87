"""Chunked prefill: a prompt runs as chunks of at most ``prefill_chunk`` tokens, each attending to
the cached prefix and itself. The state it leaves must match the whole-prompt prefill within float
tolerance, and generation through it must stay lossless (greedy: the reference AR's tokens)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import buckets as bk
from specjax.drafters.device import ModelDraft
from specjax.drafters.prompt_lookup import PromptLookupDrafter
from specjax.engine.table import StepTable
from specjax.models import llama
from specjax.reference_ar import reference_generate
from specjax.sampling import SamplingArrays, SamplingParams
from specjax.spec_generate import SpecGenerator


@pytest.mark.parametrize("max_chunk", [16, 64, 512])
def test_prefill_chunks_cover_the_prompt_in_bucket_sizes(max_chunk):
    sizes = {16 << i for i in range(8) if 16 << i <= max_chunk}
    for n in list(range(1, 300)) + [511, 512, 513, 1330, 2000, 4097, 8000]:
        plan = bk.prefill_chunks(n, max_chunk)
        starts = [s for s, _ in plan]
        assert starts[0] == 0 and all(s + c == t for (s, c), t in zip(plan, starts[1:])), (n, plan)
        assert all(c in sizes for _, c in plan), (n, plan)
        end = plan[-1][0] + plan[-1][1]
        assert plan[-1][0] < n <= end, (n, plan)  # only the last chunk is padded
        assert all(c == max_chunk for _, c in plan if _ + max_chunk <= n - n % max_chunk), (n, plan)
        # padding: under a quarter of the last chunk, or the last chunk is one that is never split
        assert end - n <= max(plan[-1][1] // 4, bk.SPLIT_MIN - 1), (n, plan)
        assert bk.prefill_tokens(n, max_chunk) == end
    with pytest.raises(Exception, match="power of two"):
        bk.prefill_chunks(100, 48)


def _prefill(table, B, S, prompts, max_chunk, run_draft):
    lens = np.array([len(p) for p in prompts] + [1] * (B - len(prompts)), np.int32)
    samp = SamplingArrays.build([SamplingParams()] * B, B)
    state = None
    for start, C in bk.prefill_chunks(int(lens.max()), max_chunk):
        n = np.clip(lens - start, 0, C).astype(np.int32)
        toks = np.zeros((B, C), np.int32)
        for b, p in enumerate(prompts):
            toks[b, :n[b]] = p[start:start + n[b]]
        exe = table.prefill(B, C, S, True, run_draft, first=state is None)
        args = (table.params, table.dparams, jnp.asarray(toks), jnp.asarray(n), samp)
        state = exe(*args) if state is None else exe(*args, state)
    return state, lens


@functools.partial(jax.jit, static_argnames="cfg")
def _next_logits(params, cfg, cache, tok):
    B = tok.shape[0]
    logits, _ = llama.forward(params, tok[:, None], cache.lengths[:, None], cache, llama.causal_mask(B, 1), cfg=cfg)
    return logits[:, 0]


def test_chunked_prefill_state_matches_the_whole_prompt(tiny):
    cfg, params = tiny
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(1, cfg.vocab_size, n)) for n in (45, 7, 33)]  # 3 rows padded to 4
    dcfg = cfg.replace(name="tiny-draft", num_layers=2)
    table = StepTable(cfg, params, llama.init_random_params(dcfg, seed=1), ModelDraft(dcfg))
    S = 256
    whole, lens = _prefill(table, 4, S, prompts, 64, True)  # one 64-token first chunk
    chunked, _ = _prefill(table, 4, S, prompts, 16, True)  # chunks 16, 16, 16
    assert len(bk.prefill_chunks(45, 16)) == 3
    np.testing.assert_array_equal(np.asarray(chunked.cache.lengths), lens)
    np.testing.assert_array_equal(np.asarray(chunked.cache.lengths), np.asarray(whole.cache.lengths))
    np.testing.assert_array_equal(np.asarray(chunked.prev), np.asarray(whole.prev))
    np.testing.assert_array_equal(np.asarray(chunked.pending), np.asarray(whole.pending))
    for c, w in ((chunked.cache, whole.cache), (chunked.dcache, whole.dcache)):
        for b, n in enumerate(lens):
            np.testing.assert_allclose(np.asarray(c.k[:, b, :, :n]), np.asarray(w.k[:, b, :, :n]), atol=2e-5)
            np.testing.assert_allclose(np.asarray(c.v[:, b, :, :n]), np.asarray(w.v[:, b, :, :n]), atol=2e-5)
    tok = jnp.asarray(whole.pending)
    np.testing.assert_allclose(np.asarray(_next_logits(params, cfg, chunked.cache, tok)),
                               np.asarray(_next_logits(params, cfg, whole.cache, tok)),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("drafter", ["draft_model", "eagle"])
def test_layered_prefill_is_the_one_program_bit_for_bit(tiny, drafter):
    """StepTable's layered prefill (embed, each layer, a draft model's layers, finish: 2 + L + L'
    calls) leaves the same state as the one-program prefill, bit for bit: target and draft caches,
    first tokens, and a feature head's carried feature (its layers' inputs taken between the
    calls), over first and later chunks of rows that end in different chunks."""
    from specjax.drafters import eagle

    cfg, params = tiny
    if drafter == "eagle":
        draft, dparams = eagle.init_params(cfg, params)
    else:
        draft = ModelDraft(cfg.replace(name="tiny-draft", num_layers=2))
        dparams = llama.init_random_params(draft.cfg, seed=1)
    rng = np.random.default_rng(5)
    prompts = [list(rng.integers(1, cfg.vocab_size, n)) for n in (45, 7, 33)]
    one, layered = (StepTable(cfg, params, dparams, draft, layered_prefill=lp) for lp in (False, True))
    a, _ = _prefill(one, 4, 128, prompts, 16, True)
    b, _ = _prefill(layered, 4, 128, prompts, 16, True)
    # embed, one layer program (a draft model's: one of its own), finish; first and later chunk
    assert len(layered._exe) == (3 if drafter == "eagle" else 4) * 2
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _rep(seq, n):
    return (list(seq) * n)[:n]


def test_chunked_prefill_generation_is_lossless(tiny):
    """Prompts of 17-64 tokens in chunks of 16 (rows of one batch end in different chunks): greedy
    output is the whole-prompt reference AR's for a host and a device drafter, and sampled output
    is the unchunked generator's for the same seeds. Greedy and sampled rows share each batch
    (verify_chain mixes them), so one set of executables serves every assertion."""
    cfg, params = tiny
    dcfg = cfg.replace(name="tiny-draft", num_layers=2)
    dparams = llama.init_random_params(dcfg, seed=1)
    prompts = [_rep([5, 6, 7, 8, 9], 64), list(range(100, 117)), _rep([11, 12, 13], 40)]
    want = [r.tokens for r in reference_generate(cfg, params, prompts, max_new_tokens=16, batch_buckets=(4,))]
    kw = dict(batch_buckets=(4,), k_buckets=(0, 2), slot_buckets=(256,))
    greedy = SamplingParams()
    sp = [SamplingParams(temperature=0.9, seed=1), greedy, SamplingParams(temperature=1.1, top_k=20, seed=2)]
    sp_other = [greedy, SamplingParams(temperature=1.0, seed=3), greedy]
    for make in (lambda c: SpecGenerator(cfg, params, drafter=PromptLookupDrafter(), prefill_chunk=c, **kw),
                 lambda c: SpecGenerator(cfg, params, draft=ModelDraft(dcfg), draft_params=dparams, prefill_chunk=c,
                                         **kw)):
        chunked, whole = make(16), make(64)  # 4 chunks of 16 / the longest prompt as one chunk
        a = [r.tokens for r in chunked.generate(prompts, sampling=sp, max_new_tokens=16, num_spec_tokens=2)]
        b = [r.tokens for r in whole.generate(prompts, sampling=sp, max_new_tokens=16, num_spec_tokens=2)]
        assert a == b and a[1] == want[1]
        got = [r.tokens for r in chunked.generate(prompts, sampling=sp_other, max_new_tokens=16, num_spec_tokens=2)]
        assert got[0] == want[0] and got[2] == want[2]


def test_engine_interleaves_prefill_chunks_with_decode_steps(tiny):
    """With a prefill budget, long prompts that arrive while others decode are prefilled a chunk
    per iteration between decode steps; outputs stay the reference AR's, and the same requests
    served with whole-prompt prefill give the same tokens. The simulator runs the same rule."""
    from specjax.engine.jax_backend import JaxBackend
    from specjax.engine.loop import EventClock, ServingEngine, summarize
    from specjax.engine.scheduler import Request
    from specjax.goodput import FixedK
    from specjax.goodput.perf_model import LinearCost, StepCostModel
    from specjax.simulate import AcceptanceProfile, simulate

    cfg, params = tiny
    short = [[7, 8, 9, 7, 8, 9, 7], [40, 41, 42], [3, 1, 4, 1, 5, 9, 2, 6]]
    long = [_rep([5, 6, 7, 8, 9], 70), _rep(list(range(60, 73)), 61)]
    prompts = short + long
    want = [r.tokens for r in reference_generate(cfg, params, prompts, max_new_tokens=12, batch_buckets=(8,))]
    be = JaxBackend(cfg, params, drafter=PromptLookupDrafter(), k_buckets=(0, 2), batch_buckets=(1, 4), slots=256,
                    prefill_chunk=16)

    def serve(budget):
        be.reset()
        reqs = [Request(f"s{i}", p, 12, arrival=0.0) for i, p in enumerate(short)]
        reqs += [Request(f"l{i}", p, 12, arrival=1e-6) for i, p in enumerate(long)]
        eng = ServingEngine(be, FixedK(2), clock=EventClock(), prefill_budget=budget)
        return eng.run(reqs), eng

    chunked, eng = serve(16)
    whole, _ = serve(None)
    assert [o.tokens for o in chunked] == want and [o.tokens for o in whole] == want
    assert eng.host_s == 0.0  # (a simulated clock: the loop's host time is real time, not counted)
    for o in chunked[3:]:  # the long prompts' chunks ran between decode steps of the short ones
        assert sum(o.admitted < s.t < o.first_token for s in eng.steps) >= 3, o
    with pytest.raises(Exception, match="prefill_budget"):
        ServingEngine(be, FixedK(2), prefill_budget=0)

    # The simulator: a long prompt's first token waits for its chunks; the short requests'
    # steps go on meanwhile (with whole-prompt prefill they wait for the whole of it).
    cost = StepCostModel(target=LinearCost(0.0, 0.0, 0.01), prefill=LinearCost(0.0, 0.001, 0.0))
    reqs = [Request("s", [1] * 8, 40, ignore_eos=True), Request("l", [1] * 1000, 4, arrival=0.05, ignore_eos=True)]
    gaps, stalls = {}, {}
    for budget in (None, 128):
        outs, sim = simulate(reqs, FixedK(0), cost, AcceptanceProfile((0.0,)), device_draft=False,
                             batch_buckets=(1, 2), slots=2048, prefill_budget=budget, prefill_chunk=128)
        ts = [s.t for s in sim.steps if s.n >= 1]
        gaps[budget] = max(b - a for a, b in zip(ts, ts[1:]))
        assert outs[1].first_token > outs[1].admitted
        stalls[budget] = outs[0].max_gap  # the short request's longest wait between two tokens
        assert summarize(outs)["max_gap_s"] == max(o.max_gap for o in outs)
    assert gaps[128] < gaps[None] / 3, gaps  # no step waits for the whole 1000-token prefill
    assert stalls[None] >= 1.0 > 0.2 > stalls[128], stalls  # (1000 prompt tokens cost 1 s whole)
