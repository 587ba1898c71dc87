"""Decode calls of several K = 0 steps (step.spec_decode, JaxBackend.decode, ServingEngine._decode):
the tokens of single steps and of the reference loop (greedy, with per-request budgets and an EOS
inside a call; sampled, seed for seed), requests joining and leaving a batch that decodes in
calls, switches between speculative steps and decode calls, and the counts the observers see."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from specjax.drafters.prompt_lookup import PromptLookupDrafter
from specjax.engine.jax_backend import JaxBackend
from specjax.engine.loop import EventClock, ServingEngine
from specjax.engine.options import DEFAULT_DECODE_STEPS, BackendOptions
from specjax.engine.scheduler import Request
from specjax.goodput import FixedK, GoodputPolicy, Policy
from specjax.goodput.perf_model import LinearCost, StepCostModel
from specjax.goodput.selector import BatchView
from specjax.reference_ar import reference_generate
from specjax.sampling import SamplingParams

N = 8  # K = 0 steps per decode call
SLOTS = 128


def _prompts(seed=0):
    rng = np.random.default_rng(seed)
    unit = list(rng.integers(1, 255, size=3))  # (prompt lookup has something to draft)
    return [list(rng.integers(1, 255, size=12)), (unit * 5)[:12], list(rng.integers(1, 255, size=12))]


PROMPTS = _prompts()  # of one length: one prefill chunk shape
LONGEST = 30  # new tokens


@pytest.fixture(scope="module")
def reference(tiny):
    """The reference loop's greedy tokens per prompt (a budget of b: the first b of them)."""
    cfg, params = tiny
    return [r.tokens for r in reference_generate(cfg, params, PROMPTS, max_new_tokens=LONGEST, batch_buckets=(1,))]


@pytest.fixture(scope="module")
def be(tiny):
    """One backend of one batch bucket for every test (each tiny executable costs seconds to
    compile): prompt lookup with K = 2 for the test that mixes speculative steps with decode
    calls; under FixedK(0) it decodes as plain AR."""
    cfg, params = tiny
    return JaxBackend(cfg, params, drafter=PromptLookupDrafter(), k_buckets=(0, 2), batch_buckets=(4,), slots=SLOTS,
                      decode_steps=N)


def test_decode_calls_by_default_where_nothing_is_decided():
    assert BackendOptions(k_buckets=(0,)).plain_decode_steps() == DEFAULT_DECODE_STEPS > 1  # Generator: plain AR
    assert BackendOptions(k_buckets=(0, 2)).plain_decode_steps() == DEFAULT_DECODE_STEPS  # SmartSpec's runs of K = 0
    assert BackendOptions(k_buckets=(0,), teacher_topk=4).plain_decode_steps() == 1
    assert FixedK(0).call_steps > N and FixedK(2).call_steps > N  # (K > 0: where the backend can)


class _Calls:
    """Counts a backend's decode calls and single steps."""

    def __init__(self, be):
        self.be, self.decode, self.step = be, [], 0
        dec, stp = be.decode, be.step
        be.decode = lambda rs, n, *a: self.decode.append(n) or dec(rs, n, *a)
        be.step = lambda *a: setattr(self, "step", self.step + 1) or stp(*a)

    def close(self):
        del self.be.decode, self.be.step


def _serve(be, reqs, policy=None, clock=None, eos=()):
    be.reset()
    calls = _Calls(be)
    try:
        eng = ServingEngine(be, policy or FixedK(0), eos_ids=eos, clock=clock)
        outs = eng.run(reqs)
    finally:
        calls.close()
    return outs, eng, calls


@pytest.mark.parametrize("n_prompts", [1, 3])
def test_greedy_budgets_and_eos_inside_a_call_match_the_reference(tiny, be, reference, n_prompts):
    cfg, params = tiny
    prompts, budgets = PROMPTS[:n_prompts], [20, 3, 11][:n_prompts]
    eos = (reference[0][5],)  # the first request ends at its 6th token (or before), inside the first call
    ref = [r.tokens[:b] for r, b in zip(reference_generate(cfg, params, PROMPTS, max_new_tokens=LONGEST, eos_ids=eos,
                                                           batch_buckets=(1,)), budgets)]
    assert len(ref[0]) <= 6
    outs, eng, calls = _serve(be, [Request(str(i), p, b) for i, (p, b) in enumerate(zip(prompts, budgets))], eos=eos)
    assert [o.tokens for o in outs] == ref
    assert outs[0].finish_reason == "eos"
    assert calls.decode and calls.step == 0 and max(calls.decode) <= N
    # Observers see single K = 0 steps: one event per step, each row one token.
    gen = sum(len(o.tokens) - 1 for o in outs)  # (the first token comes from the prefill)
    assert eng.counts.steps == gen == sum(s.n for s in eng.steps) == sum(s.generated for s in eng.steps)
    assert len(eng.steps) == max(len(o.tokens) for o in outs) - 1 and all(s.k_step == 0 for s in eng.steps)
    assert [o.steps for o in outs] == [len(o.tokens) - 1 for o in outs]


def test_sampled_tokens_are_those_of_single_steps(be):
    samp = [SamplingParams(temperature=0.9, top_k=20, seed=s) for s in (3, 4, 5)]
    reqs = [Request(str(i), p, 17, sampling=s) for i, (p, s) in enumerate(zip(PROMPTS, samp))]
    multi, _, calls = _serve(be, reqs)
    one = FixedK(0)
    one.call_steps = 1  # a decision every step: a call per token
    single, _, calls1 = _serve(be, reqs, one)
    assert calls.decode and not calls1.decode and calls1.step
    assert [o.tokens for o in multi] == [o.tokens for o in single]  # (the reference loop draws other keys)


class _OpClock(EventClock):
    """1 ms per engine operation, whatever it measured (test_engine.OpClock)."""

    def advance(self, dt: float) -> None:
        self.t += 0.001


def test_requests_join_and_leave_a_batch_decoding_in_calls(be, reference):
    which, budgets = [0, 1, 2, 0, 1, 1], [30, 6, 12, 9, 25, 14]
    reqs = [Request(f"q{i}", PROMPTS[w], b, arrival=0.0015 * i) for i, (w, b) in enumerate(zip(which, budgets))]
    reqs[-1].arrival = 1.0  # after the others left: alone again
    outs, eng, calls = _serve(be, reqs, clock=_OpClock())
    assert [o.tokens for o in outs] == [reference[w][:b] for w, b in zip(which, budgets)]
    # Calls ran while requests joined (not before their arrival) and after they left.
    assert calls.decode and calls.step
    assert all(o.arrival <= o.admitted for o in outs)
    sizes = [s.n for s in eng.steps]
    assert max(sizes) > 1 and sizes[-1] == 1
    assert eng.counts.steps == sum(len(o.tokens) - 1 for o in outs)


def test_a_batch_job_with_a_queue_decodes_in_calls_that_end_where_a_row_frees(be, reference):
    """More requests than rows, all at t = 0 (a batch job): decode calls run while requests wait
    for a row, each ending with the step at which the first row stops, so every request is
    admitted at the step single steps admit it (the same batch sizes step by step)."""
    which, budgets = [0, 1, 2, 0, 1, 2, 0], [9, 25, 4, 30, 7, 12, 5]
    eos = (reference[2][2],)  # request 2 (and maybe others) ends at an EOS inside a call
    reqs = [Request(f"b{i}", PROMPTS[w], b) for i, (w, b) in enumerate(zip(which, budgets))]
    outs, eng, calls = _serve(be, reqs, eos=eos)
    one = FixedK(0)
    one.call_steps = 1  # a decision every step: a call per token
    single, eng1, calls1 = _serve(be, reqs, one, eos=eos)
    assert [o.tokens for o in outs] == [o.tokens for o in single]
    for o, w, b in zip(outs, which, budgets):
        cut = reference[w][:b]
        stop = next((j + 1 for j, t in enumerate(cut) if t in eos), len(cut))
        assert o.tokens == cut[:stop]
    assert [s.n for s in eng.steps] == [s.n for s in eng1.steps]  # rows freed and refilled at the same steps
    assert calls.decode and max(calls.decode) > 1 and not calls1.decode
    assert len(calls.decode) < len(eng.steps)


class _Alternate(Policy):
    """K = 2 and K = 0 in turn, committing to up to 4 K = 0 steps a time (a SmartSpec that chose K = 0)."""

    name = "alternate"
    call_steps = 4

    def __init__(self):
        self.i = 0

    def choose(self, view):
        self.i += 1
        return 2 if self.i % 2 else 0


def test_speculative_steps_and_decode_calls_share_a_state(be, reference):
    seen: dict = {}
    drafter = be.drafter
    ext, start = drafter.extend, drafter.start
    drafter.start = lambda uid, prompt: seen.__setitem__(uid, list(prompt)) or start(uid, prompt)
    drafter.extend = lambda uid, toks: seen[uid].extend(toks) or ext(uid, toks)
    try:
        reqs = [Request(str(i), p, 24) for i, p in enumerate(PROMPTS)]
        outs, eng, calls = _serve(be, reqs, _Alternate())
    finally:
        del drafter.extend, drafter.start
    assert [o.tokens for o in outs] == [r[:24] for r in reference]
    assert calls.decode and max(calls.decode) <= 4 and calls.step
    # The host drafter saw every token; the counts add up to the tokens generated.
    assert sorted(map(tuple, seen.values())) == sorted(tuple(p + o.tokens) for p, o in zip(PROMPTS, outs))
    assert eng.counts.accepted + eng.counts.steps == sum(len(o.tokens) - 1 for o in outs)


def test_smartspec_commits_to_doubling_runs_of_plain_steps(be, reference):
    """SmartSpec choosing K = 0 again and again runs 1, 2, 4, ... K = 0 steps per call (the
    backend's decode_steps caps it), with the reference's tokens; a K > 0 step that paid ends the
    run, one that did not leaves its length."""
    costly = StepCostModel(target=LinearCost(0.0, 1e-2, 1e-3))  # every verified token costs: K = 0 wins
    reqs = [Request(str(i), p, LONGEST) for i, p in enumerate(PROMPTS)]
    outs, eng, calls = _serve(be, reqs, pol := GoodputPolicy(costly))
    assert [o.tokens for o in outs] == reference
    assert pol._k0_calls == {4}  # the calls' steps reached the policy as such (K = 0's cost: theirs)
    # each full call is one timing of K = 0 (not one per step: a window of them, not the last call)
    k0 = [len(v) for key, v in pol.calibration._ratios.items() if key[:2] == (4, 0)]
    assert k0 == [min(calls.decode.count(N), 16)], (k0, calls.decode)
    assert calls.step == 1 and calls.decode[:3] == [2, 4, N] and max(calls.decode) == N
    assert eng.counts.steps == sum(len(o.tokens) - 1 for o in outs)
    cheap = GoodputPolicy(StepCostModel(target=LinearCost(0.0, 1e-6, 1e-2)))  # verifying is free: speculate
    view = BatchView(ctx_lens=[20], bucket=1, k_options=(0, 2), request_ids=["a"], draft_lens=[2])
    none = dataclasses.replace(view, draft_lens=[0])
    def spec_step(accepted, seconds):  # a K = 2 choice, its verification and its time
        k = cheap.choose(view)
        cheap.observe(k, [2], [accepted], ["a"])
        cheap.observe_time(view, k, 3, seconds)
        return k, cheap.call_steps

    t0 = cheap.step_cost(none, 0)
    assert [(cheap.choose(v), cheap.call_steps) for v in (none, none, none)] == [(0, 1), (0, 2), (0, 4)]
    assert spec_step(2, 1.5 * t0) == (2, 1)  # 3 tokens in 1.5 plain steps' time: it paid
    assert [(cheap.choose(v), cheap.call_steps) for v in (none, none)] == [(0, 1), (0, 2)]  # a new run
    assert spec_step(0, 1.5 * t0) == (2, 1)  # nothing accepted: 1 token in 1.5 plain steps' time
    assert (cheap.choose(none), cheap.call_steps) == (0, 4)  # the run goes on


def test_a_call_costs_smartspec_a_share_of_its_overhead():
    """A K the backend runs in calls (``view.call_ks``) is costed as a step of a full call, the
    profiled single step less (1 - 1/n) of the call's own cost (``call_s``): here that turns
    K = 2 from a loss into the choice. Each of its steps calibrates it against a step of a call
    of its own length (a step alone: the whole call's cost), so a model that is right stays
    right, K = 0's as well."""
    cost = StepCostModel(target=LinearCost(0.0, 1e-3, 4e-3), call_s=2e-3)  # 5 / 7 ms a step alone at K = 0 / 2
    pol = GoodputPolicy(cost, prior_alpha=0.5)
    alone = BatchView(ctx_lens=[20], bucket=1, k_options=(0, 2), request_ids=["a"], call_ks=(0,), call_steps=16)
    fused = dataclasses.replace(alone, call_ks=(0, 2))
    assert pol.step_cost(alone, 0) == pytest.approx(5e-3 - 2e-3 * 15 / 16)
    assert pol.step_cost(alone, 2) == pytest.approx(7e-3) and pol.step_cost(fused, 2) == pytest.approx(7e-3 - 1.875e-3)
    assert pol.choose(alone) == 0 and pol.choose(fused) == 2  # 1.75 tokens: 1.75 / 1.63 > 1.1 x a plain step
    pol.observe_time(fused, 2, 3, 7e-3)  # a step alone, as predicted
    pol.observe_time(fused, 2, 3, 7e-3 - 2e-3 * 3 / 4, call_len=4)  # a step of a call of 4, as predicted
    pol.observe_time(fused, 2, 3, 7e-3 - 1.875e-3, full_call=True, call_len=16)
    assert pol.calibration.factors() == {(1, 2, 3): pytest.approx(1.0)}
    pol.observe_time(fused, 0, 1, 5e-3)  # K = 0 alone between verify steps, as predicted
    assert pol.calibration.factors()[(1, 0, 1)] == pytest.approx(1.0)
    pol.observe_time(alone, 2, 3, 14e-3)  # a step of K = 2 where it runs alone (a host drafter's): 2x
    assert pol.calibration.factors()[(1, 2, 3)] == pytest.approx(1.0)  # (the median of 1, 1, 1, 2)


def test_the_call_overhead_profile_leaves_the_backend_as_it_was(be, monkeypatch):
    from specjax.engine.profiling import profile_call_overhead

    assert profile_call_overhead(be, context=12, reps=1) >= 0.0  # (its size is a benchmark's business)
    assert not be.row_of
    monkeypatch.setattr(be, "decode_steps", 1)
    assert profile_call_overhead(be) == 0.0
