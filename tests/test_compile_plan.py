"""The compile planner (engine.compile_plan): the order a lazy warm-up builds in, what a whole job
may never reach, and lazily compiled serving, which builds what it reaches and the rest in the
background, with the tokens of an eager warm-up."""

from __future__ import annotations

from specjax.drafters.prompt_lookup import PromptLookupDrafter
from specjax.engine.compile_plan import CompilePlanner
from specjax.engine.jax_backend import JaxBackend
from specjax.engine.loop import ServingEngine
from specjax.engine.scheduler import Request
from specjax.goodput import FixedK, GoodputPolicy, LinearCost, StepCostModel

from engine_helpers import (KS, MAX_NEW, PROMPTS, ROWS, SLOTS, OpClock, _batch_of, _cheap_spec, _reqs,  # noqa: F401
                            reference)


def test_lazy_order_builds_the_admitted_draft_mode_first():
    """A device drafter's requests are admitted with its draft prefill: a lazy warm-up's
    background builds that mode's prefills and inserts first and the other mode's (a request
    admitted with the draft disabled) last, after the K steps a single answer would use."""
    from specjax.drafters.protocol import CHAIN, StepJob
    from specjax.engine.compile_plan import lazy_order

    k0, k2 = StepJob(CHAIN, 1, 0, True, 0), StepJob(CHAIN, 1, 2, True, 0)
    plan = [("prefill", (1, 64, True, rd, True)) for rd in (False, True)] + [("step", k2), ("step", k0)]
    plan += [("row", ("insert", 1, 1, rd)) for rd in (False, True)] + [("row", ("clear", 1))]
    got = lazy_order(plan, 1, later_ks=(2,), later_chunks=set(), first_chunks={(64, True)}, draft_mode=True)
    assert got == [("step", k0), ("row", ("insert", 1, 1, True)), ("row", ("clear", 1)),
                   ("prefill", (1, 64, True, True, True)), ("step", k2),
                   ("prefill", (1, 64, True, False, True)), ("row", ("insert", 1, 1, False))]
    # without a draft mode (host drafters: one mode) both are first-admission work
    assert lazy_order(plan, 1, later_ks=(2,), later_chunks=set(), first_chunks={(64, True)})[:5] == [
        ("step", k0), ("row", ("insert", 1, 1, False)), ("row", ("insert", 1, 1, True)), ("row", ("clear", 1)),
        ("prefill", (1, 64, True, False, True))]


def test_reachable_plan_leaves_what_a_whole_job_may_not_reach_on_demand():
    """A JSONL job's plan: the first bucket's work ahead; a smaller bucket's steps, inserts and
    shrinking resizes under (B, 0); SmartSpec's K steps under (B, K); growing resizes and chunk
    sizes no queued prompt runs dropped."""
    from specjax.drafters.protocol import CHAIN, StepJob
    from specjax.engine.compile_plan import reachable_plan

    s = {(B, k): ("step", StepJob(CHAIN, B, k, True, 0)) for B in (1, 4) for k in (0, 2)}
    p16, p64 = ("prefill", (1, 16, True, False, True)), ("prefill", (1, 64, True, False, True))
    take, grow, clear1, seg = ("row", ("take", 4, 1)), ("row", ("take", 1, 4)), ("row", ("clear", 1)), ("row", ("segment", 1, 16, False))
    plan = [p16, p64, *s.values(), take, grow, clear1, seg]
    assert reachable_plan(plan, 4, {(16, True)}, demand_ks=(2,)) == (
        [p16, s[(4, 0)], seg], {(1, 0): [s[(1, 0)], take, clear1], (1, 2): [s[(1, 2)]], (4, 2): [s[(4, 2)]]})
    assert reachable_plan(plan, 4, {(16, True)})[1] == {(1, 0): [s[(1, 0)], s[(1, 2)], take, clear1]}


def test_whole_job_warmup_builds_what_the_job_reaches(tiny, reference, tmp_path):
    """A JSONL job's lazy warm-up (every request there from the start: serve_job): nothing at a
    bucket above the one the job fills; the smaller bucket once the draining batch would compact
    into it; a K > 0 step only once SmartSpec wants it, so with verification priced out of
    reach none is built, and with cheap verification the K it wants is. Tokens are AR's."""
    from specjax.engine import exe_cache

    cfg, params = tiny
    prompts = PROMPTS[:2]
    for cost, wants in ((StepCostModel(target=LinearCost(0.0, 1.0, 1e-2)), False), (_cheap_spec(), True)):
        be = JaxBackend(cfg, params, drafter=PromptLookupDrafter(), k_buckets=KS, batch_buckets=(1, 2, 4),
                        slots=SLOTS, shrink_patience=2)
        (tmp_path / str(wants)).mkdir()
        be.table.disk_cache = exe_cache.ExecutableCache(str(tmp_path / str(wants)))
        be.warmup(prompt_lens=sorted({len(p) for p in prompts}), greedy_modes=(True,), lazy=True,
                  queue=[len(p) for p in prompts], later_ks=(2,), whole_job=True, demand_ks=True)
        assert set(be.planner._on_demand) == {(1, 0), (1, 2), (2, 2)}
        # the second request stops early: one row runs on, and the batch would compact into bucket 1
        reqs = [Request("a", prompts[0], MAX_NEW), Request("b", prompts[1], 3)]
        outs = ServingEngine(be, GoodputPolicy(cost)).run(reqs)
        be.stop_later()
        assert [o.tokens for o in outs] == [reference[0], reference[1][:3]]
        assert max(_batch_of(k) for k in be.table._exe) == 2 and (1, 0) not in be.planner._on_demand
        built_k = {k.k for k in be.table._exe if getattr(k, "op", "") == "step"}
        assert ((2, 2) not in be.planner._on_demand) == wants and (2 in built_k) <= wants


def test_lazy_warmup_compiles_what_serving_reaches(tiny, reference, tmp_path, monkeypatch):
    """A lazy warm-up compiles nothing up front: serving compiles each executable when it first
    reaches it (one request, with nothing built ahead: nothing of the 4-row bucket), K > 0 steps
    join the policy's options only once built, the background thread builds exactly the rest of
    what an eager warm-up compiles, and the tokens are AR's throughout. From a warm disk cache
    nothing is built ahead: K steps on disk are options at once and load when first run. (The
    programs are the fixture's, so jax's in-memory cache makes the compilations cheap.)"""
    from specjax.engine import exe_cache

    cfg, params = tiny
    disk = exe_cache.ExecutableCache(str(tmp_path))

    def make(lazy=True, be=None, cache=None):
        be = be or JaxBackend(cfg, params, drafter=PromptLookupDrafter(), k_buckets=KS, batch_buckets=ROWS,
                              slots=SLOTS, shrink_patience=2)
        be.table.disk_cache = cache or disk
        be.warmup(prompt_lens=[16], greedy_modes=(True,), lazy=lazy, queue=[16], later_ks=KS if lazy else ())
        return be

    # A batch draining with nothing built ahead stays in its bucket rather than wait for a
    # smaller one's steps (LiveBucket usable); prefills run one request per call on a CPU.
    (tmp_path / "drain").mkdir()
    with monkeypatch.context() as m:
        m.setattr(CompilePlanner, "_compile_later", lambda *a: None)
        drain = make(cache=exe_cache.ExecutableCache(str(tmp_path / "drain")))
        outs = ServingEngine(drain, FixedK(0)).run(_reqs(0.0, PROMPTS[:3]))
    assert [o.tokens for o in outs] == reference[:3] and drain.resizes == 0
    assert {(k.op, k.batch) for k in drain.table._exe if hasattr(k, "batch")} == {("prefill", 1), ("decode", 4)}

    with monkeypatch.context() as m:
        m.setattr(CompilePlanner, "_compile_later", lambda *a: None)  # nothing built ahead, no K joins
        be = make()
    assert len(be.table) == 0 and be.k_options(1) == (0,) and be.k_options(4) == (0,)
    outs = ServingEngine(be, GoodputPolicy(_cheap_spec())).run([Request("a", PROMPTS[0], MAX_NEW)])
    assert outs[0].tokens == reference[0]
    reached = set(be.table._exe)
    assert reached and {_batch_of(k) for k in reached} == {1} and be.table.late == len(reached)
    make(be=be).planner._later.join()  # again, with the background building the rest
    assert be.k_options(1) == KS and be.k_options(4) == KS and be.stop_later() == []
    eager = make(lazy=False)
    assert set(be.table._exe) == set(eager.table._exe) and be.table.ahead == len(eager.table) - len(reached)
    be.reset()
    outs = ServingEngine(be, FixedK(2), clock=OpClock()).run(_reqs(arrival_gap=0.004))
    assert [o.tokens for o in outs] == reference
    warm = make()  # everything is on disk now: only the first bucket's K = 0 step loads ahead
    assert warm.planner.later_planned == 1
    warm.planner._later.join()  # (K steps on disk join the options once the thread passes its gate)
    assert warm.k_options(4) == KS and {(k.op, k.batch) for k in warm.table._exe} == {("decode", 1)}
    outs = ServingEngine(warm, FixedK(2)).run([Request("a", PROMPTS[0], MAX_NEW)])
    assert outs[0].tokens == reference[0] and 0 < len(warm.table) < len(eager.table)
    (tmp_path / "partial").mkdir()
    disk = exe_cache.ExecutableCache(str(tmp_path / "partial"))  # holds what one request reached
    with monkeypatch.context() as m:
        m.setattr(CompilePlanner, "_compile_later", lambda *a: None)
        ServingEngine(make(), FixedK(0)).run([Request("a", PROMPTS[0], MAX_NEW)])
    # a warm cache: only the K steps and the prefix store's row operation (its capture and restore:
    # never reached by a job without a shared chunk, and not built on disk) are built ahead, the
    # rest when first reached
    partial = make()
    assert partial.planner.later_planned == 1 + 2 + 1 and partial.k_options(1) == partial.k_options(4) == (0,)
    partial.planner._later.join()
    assert partial.k_options(1) == partial.k_options(4) == KS


def test_background_compile_threads_yield_to_serving():
    """A thread that compiles ahead lowers its own CPU priority (Linux: per thread), so serving's
    threads keep their cores; the serving thread's own priority is untouched."""
    import os
    import threading

    from specjax.engine.table import yield_to_serving

    seen = {}

    def background():
        yield_to_serving(nice=19)
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=background)
    t.start()
    t.join()
    assert seen["nice"] == 19 and os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
