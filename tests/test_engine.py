"""The continuous-batching serving engine (specjax/engine/) and its simulator: greedy
losslessness under joins/leaves/resizes for host and device drafters, FCFS admission within KV
rows, a burst of 4x the KV capacity, per-request sampling, prefill disabling, user errors,
and the event clock."""

from __future__ import annotations

import dataclasses
from unittest.mock import ANY

import numpy as np
import pytest

from specjax.drafters.prompt_lookup import PromptLookupDrafter
from specjax.drafters.protocol import TREE
from specjax.engine.jax_backend import JaxBackend
from specjax.engine.loop import EventClock, ServingEngine, summarize
from specjax.engine.scheduler import Request, Scheduler
from specjax.drafters.device import layer_skip
from specjax.errors import SpecjaxError
from specjax.reference_ar import reference_generate
from specjax.goodput import FixedK, GoodputPolicy, LinearCost, Policy, StepCostModel
from specjax.goodput.selector import DraftPrefillGate
from specjax.sampling import SamplingParams
from specjax.simulate import AcceptanceProfile, simulate
from specjax.spec_generate import SpecGenerator

from engine_helpers import (KS, MAX_NEW, PROMPTS, ROWS, SLOTS, OpClock, _batch_of, _cheap_spec,  # noqa: F401
                            _reqs, reference)


def _ls(cfg, params, n):
    """Layer-skip self-drafting with the first n layers, as SpecGenerator / JaxBackend kwargs."""
    d, dparams = layer_skip(cfg, params, n)
    return {"draft": d, "draft_params": dparams}

@pytest.fixture(scope="module")
def backends(tiny):
    """One backend per drafter for the module; each compiles what a test reaches, on first use
    (warming both sampling modes of every bucket up front compiled much the tests never ran)."""
    cfg, params = tiny
    pld = JaxBackend(cfg, params, drafter=PromptLookupDrafter(), k_buckets=KS, batch_buckets=ROWS, slots=SLOTS,
                     shrink_patience=2)
    ls = JaxBackend(cfg, params, **_ls(cfg, params, 2), k_buckets=KS, batch_buckets=ROWS,
                    slots=SLOTS, shrink_patience=2, draft_first=True)
    return {"prompt_lookup": pld, "layer_skip": ls}


class _DraftAhead(FixedK):
    """Fixed K with the draft made ahead of the choice (the confidence path's draft call)."""

    def __init__(self, k, threshold):
        super().__init__(k)
        self.draft_threshold = threshold


@pytest.mark.parametrize("drafter,policy", [(d, p) for d in ("prompt_lookup", "layer_skip") for p in ("K=2", "smartspec")]
                         + [("layer_skip", "confidence")])
def test_greedy_lossless_with_joins_and_leaves(backends, reference, drafter, policy):
    be = backends[drafter]
    be.reset()
    pol = {"K=2": lambda: FixedK(2), "smartspec": lambda: GoodputPolicy(_cheap_spec()),
           "confidence": lambda: GoodputPolicy(_cheap_spec(), "confidence", threshold=0.05)}[policy]()
    # Arrivals interleave with steps (OpClock) so that requests join a running batch, and leave
    # it, at different steps. A late request, after the others left, runs alone in the 4-row
    # state until it is compacted.
    eng = ServingEngine(be, pol, clock=OpClock())
    calls = []  # draft calls made ahead of the choice (the confidence path)
    be.table.draft_call = lambda *a, _f=be.table.draft_call: calls.append(1) or _f(*a)
    try:
        outs = eng.run(_reqs(arrival_gap=0.004) + [Request("late", PROMPTS[1], MAX_NEW, arrival=100.0)])
    finally:
        del be.table.draft_call
    assert [o.id for o in outs] == [f"q{i}" for i in range(len(PROMPTS))] + ["late"]
    for o, ref in zip(outs, reference + [reference[1]]):
        assert o.tokens == ref, f"{o.id} diverged from autoregressive greedy"
        assert o.finish_reason == "length" and o.error is None
        assert o.arrival <= o.admitted <= o.first_token <= o.finished
    sizes = [s.n for s in eng.steps]
    assert max(sizes) > 1 and min(sizes) == 1, sizes  # batches formed and drained
    assert be.resizes >= 2, " ".join(f"{s.n},{s.bucket},{s.k}" for s in eng.steps)  # grew to 4 and compacted back
    # Step records carry the bucket the live state really ran at (a lone request runs at 4
    # until compaction) and the cache operations each step ran besides the forward pass.
    assert any(s.n == 1 and s.bucket == 4 for s in eng.steps) and any(s.n == 1 and s.bucket == 1 for s in eng.steps)
    assert all(s.bucket >= be.bucket(s.n) for s in eng.steps)
    ops = [op for s in eng.steps for op in s.row_ops]
    assert ("take", 4, 1) in ops and ("clear", 4, 4) in ops
    shrink = next(i for i, s in enumerate(eng.steps) if ("take", 4, 1) in s.row_ops)
    assert eng.steps[shrink].bucket == 1 and eng.steps[shrink - 1].bucket == 4
    assert sum(o.drafted for o in outs) > 0
    if policy == "K=2":  # SmartSpec may stop early: the tiny random model's drafts rarely match
        assert sum(o.accepted for o in outs) > 0
    if drafter == "layer_skip":
        assert all(o.drafted == 2 * o.steps for o in outs if eng.steps and all(s.k == 2 for s in eng.steps))
    if policy == "confidence":  # steps drafted ahead, and the policy verified some of their drafts
        assert calls and any(s.k > 0 for s in eng.steps)
    else:
        assert not calls
    if (drafter, policy) == ("prompt_lookup", "smartspec"):  # acceptance learnt per n-gram length
        assert pol.acc._cls and set(pol.acc._cls) <= {1, 2, 3}


def test_confidence_draft_call_matches_the_fused_step(tiny, backends):
    """The draft call + verify step (Algorithm 3's path) draws the same drafts from the same
    random streams as the fused step: with a threshold no draft misses, mixed greedy / sampled
    requests get identical tokens, so the fused step's lossless sampling carries over. With a
    threshold every draft misses, each row drafts exactly one token per step (the loop exits
    after one draft forward), still the target's greedy tokens."""
    be = backends["layer_skip"]
    samp = [SamplingParams(temperature=0.0) if i % 2 else SamplingParams(temperature=0.9, top_p=0.9, seed=i)
            for i in range(len(PROMPTS))]
    reqs = lambda: [Request(f"q{i}", p, MAX_NEW, s, arrival=i * 0.004) for i, (p, s) in enumerate(zip(PROMPTS, samp))]
    runs = {}
    for name, pol in (("fused", FixedK(2)), ("ahead", _DraftAhead(2, -1.0))):
        be.reset()
        runs[name] = ServingEngine(be, pol, clock=EventClock()).run(reqs())
    assert [o.tokens for o in runs["ahead"]] == [o.tokens for o in runs["fused"]]
    assert [o.drafted for o in runs["ahead"]] == [o.drafted for o in runs["fused"]]
    be.reset()
    greedy = [Request(f"q{i}", p, MAX_NEW, arrival=0.0) for i, p in enumerate(PROMPTS[:4])]
    eng = ServingEngine(be, _DraftAhead(2, 1.0), clock=EventClock())
    outs = eng.run(greedy)
    cfg, params = tiny
    ref = reference_generate(cfg, params, PROMPTS[:4], max_new_tokens=MAX_NEW, batch_buckets=(1,))
    assert [o.tokens for o in outs] == [r.tokens for r in ref]
    assert all(o.drafted == o.steps for o in outs)


def test_burst_of_four_times_capacity(backends, reference):
    """4 rows, 40 requests at t=0 plus one that can never fit: everything is served exactly
    once, in FCFS admission order, never more than 4 at a time, none truncated."""
    be = backends["prompt_lookup"]
    be.reset()
    prompts = PROMPTS * 4
    reqs = _reqs(0.0, prompts) + [Request("too-long", [7] * (SLOTS - 3), MAX_NEW)]
    eng = ServingEngine(be, FixedK(2), clock=EventClock())
    outs = eng.run(reqs)
    assert len(outs) == len(reqs) and len({o.id for o in outs}) == len(reqs)
    for o, p in zip(outs[:-1], prompts):
        assert o.tokens == reference[PROMPTS.index(p)]
    bad = outs[-1]
    assert bad.finish_reason == "error" and "KV slots" in bad.error and bad.tokens == []
    assert max(s.n for s in eng.steps) == be.num_rows
    admitted = [o.admitted for o in outs[:-1]]
    assert admitted == sorted(admitted)  # FCFS
    assert summarize(outs, eng.steps)["errors"] == 1


def test_sampled_requests_keep_their_own_parameters(tiny, backends):
    """Sampled requests sharing batches with greedy ones get exactly the tokens they get alone
    (K = 0 through the spec step, one request at a time): per-request temperature/top-k/seed
    follow each request through joins, leaves and row moves."""
    cfg, params = tiny
    be = backends["prompt_lookup"]
    be.reset()
    samp = [SamplingParams(temperature=0.9, top_k=20, seed=s) if s % 2 else SamplingParams() for s in range(6)]
    gen = SpecGenerator(cfg, params, batch_buckets=(1,), k_buckets=(0,), slot_buckets=(SLOTS,))
    ref = [gen.generate([p], s, max_new_tokens=MAX_NEW, num_spec_tokens=0)[0].tokens
           for p, s in zip(PROMPTS[:6], samp)]
    reqs = [Request(f"s{i}", p, MAX_NEW, sampling=s, arrival=0.002 * i) for i, (p, s) in enumerate(zip(PROMPTS, samp))]
    outs = ServingEngine(be, FixedK(0), clock=EventClock()).run(reqs)
    assert [o.tokens for o in outs] == ref


class _Script(Policy):
    """K from a script (K = 0 first, to trip the prefill gate), then 2."""

    name = "script"

    def __init__(self, ks):
        self.ks = list(ks)

    def choose(self, view):
        return self.ks.pop(0) if self.ks else 2


def test_prefill_disabling_serves_without_speculation(backends, reference):
    be = backends["layer_skip"]
    be.reset()
    gate = DraftPrefillGate(threshold=0.5, window=4)
    # Step 1 (request 0 alone) proposes nothing; the others arrive during it, so at their
    # admission 100% of recent steps were K = 0 > 0.5: they skip the draft prefill.
    eng = ServingEngine(be, _Script([0]), clock=EventClock(), prefill_gate=gate)
    reqs = _reqs(0.0, PROMPTS[:1]) + [Request(f"late{i}", p, MAX_NEW, arrival=1e-7)
                                       for i, p in enumerate(PROMPTS[1:4])]
    outs = eng.run(reqs)
    for o, ref in zip(outs, reference[:4]):
        assert o.tokens == ref
    assert outs[0].drafted > 0  # admitted before the gate closed: speculates once K = 2
    assert all(o.drafted == 0 for o in outs[1:]), [o.drafted for o in outs]  # draft prefill skipped


def test_scheduler_admission_and_errors():
    s = Scheduler(num_rows=2, slots=64, block_headroom=5)
    with pytest.raises(SpecjaxError, match="exceeds"):
        s.submit(Request("long", [1] * 50, 10))
    with pytest.raises(SpecjaxError, match="empty prompt"):
        s.submit(Request("empty", [], 10))
    with pytest.raises(SpecjaxError, match="max_new_tokens"):
        s.submit(Request("zero", [1], 0))
    for i in range(3):
        s.submit(Request(f"r{i}", [1] * 10, 10))
    first = s.admit(0.0)
    assert [r.req.id for r in first] == ["r0", "r1"] and s.admit(0.0) == []  # HasSlot: two rows only
    s.release(first[0])
    assert [r.req.id for r in s.admit(1.0)] == ["r2"]


def test_only_rejected_requests():
    cost = StepCostModel(target=LinearCost(0.0, 0.0, 0.01))
    outs, eng = simulate([Request("a", [1] * 600, 4)], FixedK(0), cost, AcceptanceProfile(), device_draft=True,
                         slots=512)
    assert outs[0].finish_reason == "error" and "--slots" in outs[0].error and not eng.steps


def test_event_clock_latency_is_modelled_time():
    """One request, constant step and prefill cost: latency = prefill + steps x step time."""
    cost = StepCostModel(target=LinearCost(0.0, 0.0, 0.01), prefill=LinearCost(0.0, 0.0, 0.05))
    reqs = [Request("a", [1] * 10, 9, ignore_eos=True)]
    outs, eng = simulate(reqs, FixedK(0), cost, AcceptanceProfile((0.0,)), device_draft=True)
    assert len(eng.steps) == 8  # first token from the prefill, then one per step
    assert outs[0].latency == pytest.approx(0.05 + 8 * 0.01)


def test_simulator_smartspec_tracks_load():
    """Light load: SmartSpec speculates and beats no-SD; heavy load with expensive verify
    tokens: it stops speculating and beats fixed K = 5 (the paper's qualitative result)."""
    cost = StepCostModel(target=LinearCost(0.0, 2e-4, 5e-3), draft=LinearCost(0.0, 1e-5, 5e-4))
    acc = AcceptanceProfile((0.7,))
    geom = dict(device_draft=True, k_buckets=(0, 1, 3, 5), batch_buckets=(1, 2, 4, 8, 16, 32, 64), slots=1024)

    def run(rate, pol):
        rng = np.random.default_rng(0)
        t = np.cumsum(rng.exponential(1 / rate, 150))
        reqs = [Request(f"r{i}", [1] * 64, 64, arrival=float(x - t[0]), ignore_eos=True) for i, x in enumerate(t)]
        outs, eng = simulate(reqs, pol, cost, acc, **geom)
        return summarize(outs, eng.steps)

    light = {n: run(1.0, p) for n, p in [("none", FixedK(0)), ("smart", GoodputPolicy(cost)), ("k5", FixedK(5))]}
    assert light["smart"]["mean_latency_s"] < 0.8 * light["none"]["mean_latency_s"]
    assert light["smart"]["mean_k"] > 1.5
    heavy = {n: run(40.0, p) for n, p in [("none", FixedK(0)), ("smart", GoodputPolicy(cost)), ("k5", FixedK(5))]}
    assert heavy["smart"]["mean_latency_s"] < heavy["k5"]["mean_latency_s"]
    assert heavy["smart"]["mean_k"] < light["smart"]["mean_k"]
    oracle = run(1.0, GoodputPolicy(cost, "oracle"))
    assert oracle["mean_latency_s"] <= light["smart"]["mean_latency_s"] * 1.02


def test_simulator_head_trees():
    """A device tree drafter in the simulator: each request draws one of a real run's accepted
    paths per step, a budget of m nodes accepts its nodes <= m, and SmartSpec sizes the trees
    from the node rates it learns there: more nodes where verify tokens are cheap, none where
    they are dear."""
    acc = AcceptanceProfile((0.0,), tree_paths=((1, 2), (1,), (), (1, 2, 4), (1, 3)), tree_nodes=6)
    geom = dict(device_draft=True, k_buckets=(0, 1, 3, 6), batch_buckets=(1, 2, 4), slots=512)
    reqs = [Request(f"r{i}", [1] * 16, 200, arrival=0.0, ignore_eos=True) for i in range(4)]
    cost = StepCostModel(target=LinearCost(0.0, 1e-4, 1e-2), draft=LinearCost(0.0, 0.0, 1e-4))
    _, eng = simulate(reqs, FixedK(3), cost, acc, **geom)
    c = eng.counts  # nodes <= 3 of the paths: 2, 1, 0, 2, 2 accepted
    assert c.drafted == 3 * c.steps and c.accepted / c.steps == pytest.approx(7 / 5, rel=0.1)
    _, cheap = simulate(reqs, GoodputPolicy(cost), cost, acc, **geom)
    dear = StepCostModel(target=LinearCost(0.0, 2e-2, 1e-2), draft=LinearCost(0.0, 0.0, 1e-4))
    _, costly = simulate(reqs, GoodputPolicy(dear), dear, acc, **geom)
    ks = [s.k for s in cheap.steps]
    assert np.mean(ks) > 2.5 and cheap.counts.accepted > 0
    assert np.mean([s.k for s in costly.steps]) < 0.5
    # A dynamic tree of depth 2 costs 2 draft forwards whatever its node budget (a chain: one per draft)
    tree = dataclasses.replace(cost, draft_forwards=2)
    assert [tree.draft_time(1, k, [16]) for k in (0, 1, 6)] == pytest.approx([0.0, 1e-4, 2e-4])
    assert cost.draft_time(1, 6, [16]) == pytest.approx(6e-4)
    assert StepCostModel.from_dict(tree.to_dict()) == tree


def test_engine_counts_are_the_requests_summed():
    """The engine's acceptance counts (its step observer's) equal the sum of its requests'
    own counts, and every step reached the step log, the counts and a subscribed observer: its
    event before the step's finished requests left, between_steps after."""
    from specjax.engine.observers import Observer
    from specjax.simulate import SimBackend

    class Seen(Observer):
        def __init__(self):
            self.log = []

        def on_step(self, ev):
            self.log.append(("step", ev.k, sum(ev.accepted), sum(r.done for r in ev.rows)))

        def between_steps(self, engine):
            self.log.append(("between", all(not r.done for r in engine.sched.running)))

    cost = StepCostModel(target=LinearCost(0.0, 0.0, 0.01), draft=LinearCost(0.0, 0.0, 0.001))
    reqs = [Request(f"r{i}", [1] * 8, 5 + 3 * i, arrival=0.01 * i, ignore_eos=True) for i in range(5)]
    be = SimBackend(cost, AcceptanceProfile((0.8, 0.5)), device_draft=True, k_buckets=(0, 3), batch_buckets=(1, 2, 4))
    seen = Seen()
    eng = ServingEngine(be, FixedK(3), clock=EventClock(), observers=[seen])
    outs = eng.run(reqs)
    assert seen.log[0::2] == [("step", 3, s.accepted, ANY) for s in eng.steps]
    assert seen.log[1::2] == [("between", True)] * len(eng.steps)
    assert sum(done for _, _, _, done in seen.log[0::2]) == len(reqs)  # each left after its last step
    c = eng.counts
    assert c.steps == sum(o.steps for o in outs) == sum(s.n for s in eng.steps)
    assert c.drafted == sum(o.drafted for o in outs) == sum(s.drafted for s in eng.steps) == 3 * c.steps
    assert c.accepted == sum(o.accepted for o in outs) == sum(s.accepted for s in eng.steps) > 0
    assert c.emitted == sum(len(o.tokens) - 1 for o in outs) == sum(s.generated for s in eng.steps)
    assert c.pos_drafted.sum() == c.drafted and c.pos_accepted.sum() == c.accepted
    assert c.offered == c.proposed == c.steps and c.propose_rate == 1.0


def test_live_bucket_rule():
    """Grow at once; shrink to the batch's bucket only after `patience` consecutive small
    steps; peek predicts the bucket of the next step without changing anything."""
    from specjax.engine.live_bucket import LiveBucket

    lb = LiveBucket((1, 2, 4, 8), patience=3)
    assert lb.peek(3) == 4 and lb.B == 0
    assert lb.grow(3) == (0, 4) and lb.grow(4) is None and lb.grow(5) == (4, 8)
    seen = []
    for _ in range(4):
        seen.append((lb.peek(1), lb.before_step(1), lb.B))
    assert seen == [(8, None, 8), (8, None, 8), (1, (8, 1), 1), (1, None, 1)]
    lb.grow(2)
    assert lb.before_step(2) is None and lb.before_step(1) is None and lb.before_step(2) is None
    assert [lb.before_step(1) for _ in range(3)] == [None, None, (2, 1)]  # a big step reset the count
    lb.reset()
    assert lb.B == 0 and lb.peek(8) == 8
    built = {8}  # only bucket 8's steps built (a lazy warm-up): 1 row shrinks into 2 once that is
    lb = LiveBucket((1, 2, 4, 8), patience=2, usable=built.__contains__)
    lb.grow(8)
    assert [lb.before_step(1) for _ in range(3)] == [None, None, None] and lb.steps_left(1) is None
    built.add(2)
    assert [lb.before_step(1) for _ in range(2)] == [None, (8, 2)] and lb.peek(1) == 2


def test_simulator_mirrors_live_bucket_and_charges_row_ops():
    """The simulator runs steps at the live state's bucket (not the batch's) and charges the
    allocation, resize copies and clears the real backend would run, at profiled cost."""
    from specjax.goodput.perf_model import ProfiledCost

    lin = StepCostModel(target=LinearCost(0.0, 0.0, 0.01), prefill=LinearCost(0.0, 0.0, 0.05))
    cells = tuple((b, 0, 1, 0.01 * b) for b in (1, 2, 4))
    ops = (("alloc", 0, 4, 0.3), ("take", 4, 1, 0.2), ("clear", 4, 4, 0.1), ("clear", 1, 1, 0.1))
    # Three requests at once (state of 4), two end after 2 tokens, one runs on alone.
    reqs = [Request("a", [1] * 10, 20, ignore_eos=True)] + [Request(f"b{i}", [1] * 10, 2, ignore_eos=True)
                                                          for i in range(2)]
    outs, eng = simulate(reqs, FixedK(0), ProfiledCost(lin, cells, ops), AcceptanceProfile((0.0,)),
                         device_draft=True, batch_buckets=(1, 2, 4))
    b = [s.bucket for s in eng.steps]
    assert b[:8] == [4] * 8 and set(b[8:]) == {1}, b  # 1 step with 3 rows, 7 small; compacted on the 8th
    assert [s.row_ops for s in eng.steps[:3]] == [(), (("clear", 4, 4),), ()]
    assert eng.steps[8].row_ops == (("take", 4, 1),)
    n_small = len(b) - 8
    expect = 0.3 + 0.05 + 8 * 0.04 + 0.1 + 0.2 + n_small * 0.01  # alloc, prefill, steps at 4, clear, take, steps at 1
    assert outs[0].finished == pytest.approx(expect)


def test_simulated_no_sd_prefills_without_the_draft():
    """A device drafter's no-SD run admits requests without the draft prefill (the real engine
    does): the simulator charges the target-only prefill when the profile timed it."""
    from specjax.goodput.perf_model import ProfiledCost

    lin = StepCostModel(target=LinearCost(0.0, 0.0, 0.01), draft=LinearCost(0.0, 0.0, 0.001),
                        prefill=LinearCost(0.0, 0.0, 0.08))
    pc = ProfiledCost(lin, prefill_plain=LinearCost(0.0, 0.0, 0.05))
    reqs = [Request("a", [1] * 10, 5, ignore_eos=True)]
    outs, _ = simulate(reqs, FixedK(0), pc, AcceptanceProfile((0.0,)), device_draft=True)
    assert outs[0].latency == pytest.approx(0.05 + 4 * 0.01)
    outs, _ = simulate(reqs, FixedK(1), pc, AcceptanceProfile((0.0,)), device_draft=True)
    assert outs[0].latency == pytest.approx(0.08 + 4 * (0.01 + 0.001))


def test_speed_probe_compares_live_steps_with_the_profile(backends):
    """probe_speed times K = 0 steps per batch bucket against a profiled table and leaves the
    backend empty; a table claiming twice the measured time reads as a factor 2 lower (exact
    ratios, not timings, are asserted)."""
    from specjax.engine.profiling import probe_speed, profile_steps
    from specjax.goodput.perf_model import ProfiledCost, table_cells

    be = backends["prompt_lookup"]
    recs = profile_steps(be, be.batch_buckets, [16], [0], reps=2)
    pc = ProfiledCost(_cheap_spec(), table_cells(recs))
    f = probe_speed(be, pc, context=16, reps=2)
    assert sorted(f) == list(be.batch_buckets) and all(x > 0 for x in f.values())
    assert be.state is None and not be.row_of
    slow = ProfiledCost(pc.linear, tuple((b, k, c, 2 * t) for b, k, c, t in pc.cells))
    f2 = probe_speed(be, slow, context=16, reps=2)
    assert all(0 < x for x in f2.values())
    assert slow.with_speed(f2).device_time(1, 0, [16]) == pytest.approx(2 * pc.cells[0][3] * f2[1])


class _Recorder(Policy):
    name = "record"

    def __init__(self):
        self.seen, self.scores = [], []

    def choose(self, view):
        return 0

    def observe(self, k, drafted, accepted, request_ids=(), classes=None, scores=None):
        self.seen.append((k, list(drafted), list(accepted)))
        self.scores.append(scores)


def _shadow_observations(be, reference, scored=False):
    """Serve 4 requests at K = 0 and return the policy's shadow observations (k, drafted,
    accepted), checked: output is AR greedy, drafts were offered, each observation verified the
    whole offered draft and accepted no more of it, and carries that draft's own node scores
    (a scoring drafter's; the request has proposed again since)."""
    be.reset()
    pol = _Recorder()
    outs = ServingEngine(be, pol, clock=EventClock()).run(_reqs(0.0, PROMPTS[:4]))
    assert [o.tokens for o in outs] == reference[:4]
    shadow = [(s, sc) for s, sc in zip(pol.seen, pol.scores) if s[0] > 0]
    assert shadow, "no shadow observation although the drafter proposed"
    for (k, d, a), sc in shadow:
        assert d == [k] and 0 <= a[0] <= k
        assert sc is not None and len(sc) == 1 and (sc[0] is None or len(sc[0]) == k)
    assert not scored or all(sc[0] is not None for _, sc in shadow)
    return [s for s, _ in shadow]


def test_host_drafts_are_shadow_verified_at_k0(backends, reference):
    """Steps that verify nothing still teach the policy the drafts' acceptance: a host draft is
    compared with the tokens the following steps generate (greedy: exactly what a verify would
    have accepted), so a moving average that fell to 0 can recover."""
    shadow = _shadow_observations(backends["prompt_lookup"], reference)
    assert any(a[0] > 0 for _, _, a in shadow)  # the repetitive prompts' drafts do match


def test_warmup_can_execute_every_executable(backends, reference):
    """warmup(execute=True) runs each prefill and step once on empty rows (so first-execution
    costs do not land on the first requests served), compiles nothing new, and leaves the
    backend empty: serving afterwards is still exactly greedy decoding."""
    be = backends["prompt_lookup"]
    be.warmup(prompt_lens=[16], greedy_modes=(True, False))
    n = len(be.table)
    be.warmup(prompt_lens=[16], greedy_modes=(True, False), execute=True)
    assert len(be.table) == n and be.state is None and not be.row_of
    outs = ServingEngine(be, FixedK(2), clock=EventClock()).run(_reqs(0.0, PROMPTS[:3]))
    assert [o.tokens for o in outs] == reference[:3]


def test_measured_acceptance_profile_is_conditional():
    """The simulator chains per-position rates (position j survives given j - 1 did), so the
    profile measured on real runs must be accepted / examined, not accepted / drafted; host
    proposal lengths are measured and drawn with their frequencies."""
    cost = StepCostModel(target=LinearCost(0.0, 0.0, 0.01))
    _, eng = simulate([Request("a", [1, 2], 2)], FixedK(0), cost, AcceptanceProfile(), device_draft=False)
    eng.counts.add([3, 3, 2], [0, 3, 1], 3, draft_lens=[0, 0, 2, 5])
    assert eng.counts.per_position_acceptance == pytest.approx([2 / 3, 1 / 3, 1 / 2])
    assert eng.counts.conditional_acceptance == pytest.approx([2 / 3, 1 / 2, 1.0])
    prof = AcceptanceProfile.measured([eng, eng])
    assert prof.per_position == pytest.approx((2 / 3, 1 / 2, 1.0))
    assert prof.draft_len_dist == pytest.approx((0.5, 0.0, 0.25, 0.0, 0.0, 0.25))

    from specjax.engine.scheduler import Scheduler
    from specjax.simulate import SimBackend

    be = SimBackend(cost, prof, device_draft=False, k_buckets=(0, 3), seed=1)
    rs = [Scheduler(8, 512, 4).start(Request(f"r{i}", [1], 4), True, 0.0) for i in range(4)]
    lens = np.concatenate([be.propose(rs, 3).draft_lens for _ in range(2000)])
    assert set(lens) == {0, 2, 3}  # 5 is cut to the largest K asked for
    assert np.mean(lens == 0) == pytest.approx(0.5, abs=0.03) and np.mean(lens == 3) == pytest.approx(0.25, abs=0.03)
    # Chained draws reproduce the conditional rates: P(accept >= 2) = 2/3 * 1/2.
    would = [be._draw_would_accept(3) for _ in range(20000)]
    assert np.mean(np.array(would) >= 2) == pytest.approx(1 / 3, abs=0.015)


def test_no_sd_admits_without_the_draft_model():
    """A policy that never speculates (no-SD) serves with no draft model at all: its requests are
    admitted without the draft prefill, so the backend offers them no drafts; fixed K > 0 does."""
    class Seen(FixedK):
        def choose(self, view):
            self.lens = getattr(self, "lens", []) + list(view.draft_lens)
            return super().choose(view)

    cost = StepCostModel(target=LinearCost(0.0, 0.0, 0.01))
    for k, expect in ((0, {0}), (2, {2})):
        pol = Seen(k)
        assert pol.may_speculate == (k > 0)
        simulate([Request(f"r{i}", [1] * 8, 6, ignore_eos=True) for i in range(3)], pol, cost, AcceptanceProfile(),
                 device_draft=True, k_buckets=(0, 2))
        assert set(pol.lens) == expect


# ---------------------------------------------------------------- token trees in the engine


@pytest.fixture(scope="module")
def tree_backend(tiny):
    """A suffix-tree drafter (tree mode) in the serving engine: rows 1 -> 4 -> 8."""
    from specjax.drafters.suffix import SuffixConfig, SuffixDrafter

    cfg, params = tiny
    be = JaxBackend(cfg, params, drafter=SuffixDrafter(SuffixConfig(max_depth=16, alpha=2.0, min_prob=0.05)),
                    k_buckets=(0, 4), batch_buckets=(1, 4, 8), slots=SLOTS, shrink_patience=2)
    assert be.drafter.step is TREE
    be.warmup(prompt_lens=[16])
    return be


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_token_trees_greedy_lossless_with_joins_and_leaves(tree_backend, reference, rows):
    """SuffixDecoding's token trees through the continuous-batching engine: requests join and
    leave a running batch of up to ``rows`` while each step verifies a tree per row (the tree
    step at the live bucket); every request's tokens equal autoregressive greedy, trees were
    drafted and some of their nodes accepted (the repetitive prompts and the outputs the
    global suffix tree has seen)."""
    be = tree_backend
    be.reset()
    # 1: each request arrives after the previous one left; 3: staggered joins; 8: a burst of 10
    # into 8 rows (two join as the first leave)
    n, gap = {1: (3, 50.0), 3: (3, 0.003), 8: (len(PROMPTS), 0.0)}[rows]
    reqs = [Request(f"t{i}", p, MAX_NEW, arrival=gap * i) for i, p in enumerate(PROMPTS[:n])]
    eng = ServingEngine(be, FixedK(4), clock=OpClock())
    outs = eng.run(reqs)
    for o, ref in zip(outs, reference):
        assert o.tokens == ref, f"{o.id} diverged from autoregressive greedy"
    sizes = [s.n for s in eng.steps]
    assert max(sizes) <= rows and (rows == 1 or max(sizes) > 1) and min(sizes) == 1, sizes
    assert sum(o.drafted for o in outs) > 0 and sum(o.accepted for o in outs) > 0
    assert {s.k_step for s in eng.steps} <= {0, 4}


def test_token_trees_are_shadow_verified_at_k0(tree_backend, reference):
    """At K = 0 a tree drafter's proposals are still learnt from: the path the generated tokens
    walk down each tree is its greedy acceptance; each is calibrated with its own node scores."""
    _shadow_observations(tree_backend, reference, scored=True)


def test_token_trees_under_goodput_policy(tree_backend, reference):
    """SmartSpec over token trees: the suffix drafter's node probabilities are the predictor
    (calibrated online), the node budget is chosen among the compiled buckets every step, and
    the output is still exactly AR greedy."""
    be = tree_backend
    be.reset()
    pol = GoodputPolicy(_cheap_spec())
    outs = ServingEngine(be, pol, clock=EventClock()).run(_reqs(0.002, PROMPTS[:6]))
    for o, ref in zip(outs, reference):
        assert o.tokens == ref, f"{o.id} diverged from autoregressive greedy"
    assert len(pol.score_calibration) > 0  # verified (or shadow-verified) trees calibrated the scores


def test_steps_run_cold_are_no_cost_observation(tiny, reference, tmp_path, monkeypatch):
    """A lazily compiled job's first steps wait for their compilation (or run beside a background
    one): their seconds are not what the step costs, so SmartSpec's cost calibration never takes
    them (a first K = 0 step timed with its compilation made K = 0 look dear for the window), while
    their tokens and acceptance count as any step's. Steps run once everything is built are
    observed as before. Tokens are AR's."""
    from specjax.engine import exe_cache
    from specjax.engine.compile_plan import CompilePlanner

    cfg, params = tiny
    seen = []  # (cold, calibrated) per observe_time

    class Spy(GoodputPolicy):
        def observe_time(self, view, k_step, tokens, seconds, full_call=False, cold=False, call_len=1):
            n = sum(map(len, self.calibration._ratios.values()))
            super().observe_time(view, k_step, tokens, seconds, full_call, cold=cold, call_len=call_len)
            seen.append((cold, sum(map(len, self.calibration._ratios.values())) > n))

    be = JaxBackend(cfg, params, drafter=PromptLookupDrafter(), k_buckets=KS, batch_buckets=ROWS, slots=SLOTS)
    be.table.disk_cache = exe_cache.ExecutableCache(str(tmp_path))
    with monkeypatch.context() as m:
        m.setattr(CompilePlanner, "_compile_later", lambda *a: None)  # nothing ahead: serving compiles each step
        be.warmup(prompt_lens=[16], greedy_modes=(True,), lazy=True, queue=[16], later_ks=())
    engine = ServingEngine(be, Spy(_cheap_spec()))
    outs = engine.run([Request("a", PROMPTS[0], MAX_NEW)])
    assert outs[0].tokens == reference[0]
    cold = [s.cold for s in engine.steps]
    assert cold[0] and not cold[-1], cold  # the first step compiled; the last ran what was built
    assert any(c for c, _ in seen) and not any(calibrated for c, calibrated in seen if c)
    assert any(calibrated for c, calibrated in seen if not c)
    assert engine.counts.steps == len(engine.steps)  # cold steps' tokens count as any step's
    # the serving thread's compilations are CPU that serve_job takes out of the serving CPU figure
    assert be.table.late_cpu_s > 0 and be.table.ahead_cpu_s == 0
