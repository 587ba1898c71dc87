"""Prefix caching (engine.prefix_store): prompts that repeat prefilled chunks reuse them, and
outputs are token-identical to serving without the store, for every drafter kind, greedy and
sampled, with requests joining and leaving, after evictions; the store keeps to its budget."""

from __future__ import annotations

import numpy as np
import pytest

from specjax.engine.prefix_store import PrefixStore


def test_store_keeps_to_its_budget_and_evicts_least_recently_used_leaves():
    rng = np.random.default_rng(0)
    store = PrefixStore(budget_bytes=1000)
    prompts = [list(rng.integers(0, 5, 64)) for _ in range(40)]
    plan = [(0, 16), (16, 16), (32, 16), (48, 16)]
    for p in prompts:
        parent = None
        for start, size in plan:
            node = store.insert(parent, p, start, size, False, segment=("seg", start), nbytes=150)
            assert store.nbytes <= store.budget
            assert store.nbytes == sum(n.nbytes for n in store._nodes())
            if node is None:
                break
            parent = node
        path = store.match(p + [1], plan, False)
        assert [n.end for n in path] == [16, 32, 48, 64][:len(path)]
    # every stored node's parent is stored (paths are whole)
    nodes = list(store._nodes())
    assert all(n.parent in store.roots.values() or n.parent in nodes for n in nodes)
    # a prompt's last chunk always runs: a stored prompt matched exactly reuses all but its last chunk
    p = prompts[-1]
    assert [n.end for n in store.match(p, plan, False)] == [16, 32, 48]
    assert store.match(p + [9], plan, True) == []  # entries with the draft's cache are apart
    # the least recently used leaf goes first; a matched and used path is kept
    store = PrefixStore(budget_bytes=300)
    a, b = [1] * 32, [2] * 32
    store.insert(None, a, 0, 16, False, "a", 100)
    store.insert(None, b, 0, 16, False, "b", 100)
    store.use(store.match(a + [0] * 20, plan, False))
    store.insert(None, [3] * 32, 0, 16, False, "c", 100)
    store.insert(None, [4] * 32, 0, 16, False, "d", 100)  # evicts b (a was used since)
    assert store.match(a + [0], plan, False) and not store.match(b + [0], plan, False)
    assert store.stats.evicted == 1 and not store.wants(301) and store.insert(None, [5] * 32, 0, 16, False, "e", 301) is None
    # a chunk whose parent was evicted since its job read it is not stored (it would be unreachable)
    c = store.match([3] * 32 + [0], plan, False)[0]
    store.clear()
    assert store.nbytes == 0 and len(store) == 0
    assert store.insert(c, [3] * 32, 16, 16, False, "g", 50) is None and store.nbytes == 0


def _serve(be, prompts, sampling, max_new, arrivals):
    from specjax.engine.loop import EventClock, ServingEngine
    from specjax.engine.scheduler import Request
    from specjax.goodput import FixedK

    be.reset()
    reqs = [Request(f"r{i}", p, m, s, a) for i, (p, s, m, a) in enumerate(zip(prompts, sampling, max_new, arrivals))]
    # (drafts and acceptances too: a host drafter's history and a head's restored feature are
    # those of a full prefill, so the same drafts are offered and accepted)
    return [(o.tokens, o.drafted, o.accepted) for o in ServingEngine(be, FixedK(2), clock=EventClock()).run(reqs)]


# (the default run: a host drafter, whose K = 0 steps are AR's, and the feature head, whose draft
# cache carries a feature; a draft model's KV cache: tests/sharded_engine_run.py; both: slow)
@pytest.mark.parametrize("drafter", ["prompt_lookup", "eagle", pytest.param("none", marks=pytest.mark.slow),
                                     pytest.param("draft_model", marks=pytest.mark.slow)])
def test_prefix_cache_outputs_are_the_uncached_ones(tiny, drafter):
    """Prompts sharing 16-64 tokens (chunk boundaries at 16, 32, 48: hits at a boundary and in
    the middle of a chunk), admitted at different times into a batch of 4 rows while others
    decode, greedy and sampled: the same tokens with the store as without it, and again after
    the store evicted (a budget of two segments)."""
    from specjax.drafters import eagle
    from specjax.drafters.device import ModelDraft
    from specjax.drafters.prompt_lookup import PromptLookupDrafter
    from specjax.engine.jax_backend import JaxBackend
    from specjax.models import llama
    from specjax.sampling import SamplingParams

    cfg, params = tiny
    kw = {}
    if drafter == "prompt_lookup":
        kw = dict(drafter=PromptLookupDrafter())
    elif drafter == "draft_model":
        dcfg = cfg.replace(name="tiny-draft", num_layers=2)
        kw = dict(draft=ModelDraft(dcfg), draft_params=llama.init_random_params(dcfg, seed=1))
    elif drafter == "eagle":
        d, dp = eagle.init_params(cfg, params)
        kw = dict(draft=d, draft_params=dp)
    rng = np.random.default_rng(7)
    shared, other = (list(rng.integers(1, cfg.vocab_size, 64)) for _ in range(2))
    prompts = [pre[:n] + list(rng.integers(1, cfg.vocab_size, m)) for pre, n, m in
               ((shared, 64, 9), (shared, 48, 20), (other, 40, 3), (shared, 64, 30), (shared, 16, 1),
                (other, 33, 14), (shared, 64, 9), (shared, 5, 4), (other, 48, 2))]
    sampling = [SamplingParams(temperature=0.8 if i % 3 == 1 else 0.0, seed=i) for i in range(len(prompts))]
    max_new = [6, 9, 4, 7, 5, 8, 6, 3, 5]
    arrivals = [0.0, 0.0, 1e-6, 2e-6, 2e-6, 3e-6, 4e-6, 4e-6, 5e-6]
    common = dict(k_buckets=(0, 2), batch_buckets=(4,), slots=256, prefill_chunk=16, **kw)
    want = _serve(JaxBackend(cfg, params, prefix_cache_mb=0, **common), prompts, sampling, max_new, arrivals)
    be = JaxBackend(cfg, params, **common)
    seg = be.table.segment_bytes(1, 256, 16, False)
    stats = []
    for budget in (None, 2 * seg + 1):
        if budget is not None:
            be.prefix = PrefixStore(budget)
        for _ in range(2):
            assert _serve(be, prompts, sampling, max_new, arrivals) == want
            assert be.prefix.nbytes <= be.prefix.budget
        stats.append(be.prefix.stats)
    assert stats[0].hits >= 8 and stats[0].tokens_saved >= 8 * 32 and stats[1].evicted > 0, stats


def test_a_generators_slot_buckets_share_one_store(tiny):
    """SpecGenerator's backends of different cache-slot buckets serve from one store: a prompt in
    the 128-slot bucket reuses the chunks a shorter one stored from the 64-slot bucket, with the
    tokens the generator gives without the store."""
    from specjax.spec_generate import SpecGenerator

    cfg, params = tiny
    rng = np.random.default_rng(3)
    short = [int(t) for t in rng.integers(1, cfg.vocab_size, 40)]
    long = short[:32] + [int(t) for t in rng.integers(1, cfg.vocab_size, 60)]
    common = dict(k_buckets=(0,), batch_buckets=(1,), slot_buckets=(64, 128), prefill_chunk=16)
    off = SpecGenerator(cfg, params, prefix_cache_mb=0, **common)
    on = SpecGenerator(cfg, params, **common)
    for p in (short, long):
        assert (on.generate([p], max_new_tokens=4, num_spec_tokens=0)[0].tokens
                == off.generate([p], max_new_tokens=4, num_spec_tokens=0)[0].tokens)
    assert on.backend(64).prefix is on.backend(128).prefix and off.prefix_stats is None
    assert (on.prefix_stats.hits, on.prefix_stats.tokens_saved) == (1, 32), on.prefix_stats


def test_finished_outputs_serve_a_conversations_next_turn(tiny):
    """prefix_cache_outputs: a finished request's prompt + output chunks are stored from its row,
    so the next turn (prompt, output, a new message) prefills only what follows them, with the
    tokens of a generator without the store; the stored chunks are what a prefill of the same
    tokens stores (KV to rounding; length, last and next token exactly)."""
    from specjax.drafters.prompt_lookup import PromptLookupDrafter
    from specjax.engine.jax_backend import JaxBackend
    from specjax.errors import SpecjaxError
    from specjax.spec_generate import SpecGenerator

    cfg, params = tiny
    rng = np.random.default_rng(5)
    first, message, other = ([int(t) for t in rng.integers(1, cfg.vocab_size, n)] for n in (40, 10, 20))
    common = dict(k_buckets=(0, 2), batch_buckets=(1, 2), slot_buckets=(128,), prefill_chunk=16,
                  drafter=PromptLookupDrafter())
    gens = {name: SpecGenerator(cfg, params, **common, **kw) for name, kw in
            (("off", dict(prefix_cache_mb=0)), ("prompts", {}), ("outputs", dict(prefix_cache_outputs=True)))}
    turns, saved = {}, {}
    for name, g in gens.items():  # turn 1 beside another request, then turn 2
        one = g.generate([first, other], max_new_tokens=30, num_spec_tokens=2)[0].tokens
        before = g.prefix_stats.tokens_saved if g.prefix_stats else 0
        turns[name] = (one, g.generate([first + one + message], max_new_tokens=8, num_spec_tokens=2)[0].tokens)
        saved[name] = g.prefix_stats.tokens_saved - before if g.prefix_stats else 0
    assert turns["outputs"] == turns["off"] == turns["prompts"]
    # turn 2 (40 + 30 + 10 tokens) reuses the prompt's two whole chunks, or with the outputs
    # stored the four within the 69 tokens turn 1's row holds
    assert (saved["prompts"], saved["outputs"]) == (32, 64), saved
    assert gens["outputs"].prefix_stats.from_outputs >= 2 and gens["prompts"].prefix_stats.from_outputs == 0
    # the chunks stored from the row against those a prefill of the same tokens stores
    second = first + turns["off"][0] + message
    gens["prompts"].generate([second + [1] * 16], max_new_tokens=1, num_spec_tokens=2)
    a, b = (gens[n].backend(128).prefix for n in ("outputs", "prompts"))
    na = nb = None
    for start in range(0, 64, 16):
        na, nb = a.child(na, second, start, 16, False), b.child(nb, second, start, 16, False)
        got, want = na.segment, nb.segment
        for f in ("k", "v"):
            np.testing.assert_allclose(np.asarray(got["cache"][f]), np.asarray(want["cache"][f]), rtol=1e-4, atol=1e-5)
        assert [int(got[f]) for f in ("prev", "pending")] == [int(want[f]) for f in ("prev", "pending")], start
        assert int(got["cache"]["lengths"]) == int(want["cache"]["lengths"]) == start + 16
    with pytest.raises(SpecjaxError, match="host drafters"):
        from specjax.drafters import eagle

        d, dp = eagle.init_params(cfg, params)
        JaxBackend(cfg, params, draft=d, draft_params=dp, prefix_cache_outputs=True)


def test_a_job_serves_records_sharing_a_prefix_together():
    """serve_job's order: records whose prompts share a prefix are next to each other (a job
    whose templates are interleaved keeps each template stored while its records run); equal
    prompts keep their job order."""
    from types import SimpleNamespace

    from specjax.serve_job import prefix_order

    a, b = [5, 300, 7, 9], [5, 300, 8]
    prompts = [a + [1], b + [2], a + [3], [70000], b + [1], a + [1], b]
    order = prefix_order([SimpleNamespace(prompt=p) for p in prompts], range(len(prompts)))
    assert sorted(order) == list(range(len(prompts)))
    runs = [tuple(prompts[i][:3]) for i in order]
    assert runs.count(tuple(a[:3])) == 3 and runs.count(tuple(b[:3])) == 3
    assert all(runs[j] == runs[j + 1] or runs[j] not in runs[j + 1:] for j in range(len(runs) - 1)), order  # grouped
    assert order.index(0) < order.index(5)  # (equal prompts: job order)


def test_the_simulator_charges_only_the_chunks_it_prefills():
    """SimBackend runs the engine's store rule: of ten requests sharing a 1,100-token prefix
    (the default chunks), the first prefills everything, the rest start after its first 1,024
    tokens' stored chunks, and the event clock charges only what ran."""
    from specjax import buckets as bk
    from specjax.goodput import FixedK
    from specjax.goodput.perf_model import LinearCost, StepCostModel
    from specjax.engine.scheduler import Request
    from specjax.simulate import AcceptanceProfile, simulate

    cost = StepCostModel(target=LinearCost(0.0, 0.0, 0.01), prefill=LinearCost(0.0, 0.001, 0.0))
    shared = [7] * 1100
    reqs = [Request(f"r{i}", shared + [i + 1] * 20, 4, ignore_eos=True) for i in range(10)]
    ends = {}
    for mb in (0, 64):
        outs, eng = simulate(reqs, FixedK(0), cost, AcceptanceProfile((0.0,)), device_draft=False,
                             batch_buckets=(1,), slots=2048, prefix_cache_mb=mb, kv_bytes_per_token=1000)
        ends[mb] = max(o.finished for o in outs)
        if mb:
            st = eng.backend.prefix.stats
            assert (st.hits, st.tokens_saved) == (9, 9 * 1024) and st.inserted == 1024 // bk.DEFAULT_PREFILL_CHUNK, st
    # 10 x 1,120 prompt tokens padded to 1,152 each, against one of those and 9 x 128
    assert ends[64] < ends[0] * 0.25, ends


def test_a_batch_job_under_the_default_flags_reuses_a_shared_prefix(tmp_path):
    """launch/batch.py as the README runs it (lazy compilation, the store on; only the tiny
    model named): records sharing a prefix of more than two prefill chunks reuse it, counted in the
    summary, with the outputs of the job served without the store. Run after a job without the
    store left its executables on disk (a warm cache without the store's captures, which once
    made every later job store nothing) and again on a cold cache."""
    import json
    import os
    import re
    import subprocess
    import sys

    from specjax import buckets as bk

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    block = "".join(f"Rule {i}: answer in one short line and cite the rule you used.\n" for i in range(9))
    assert len(block) > 2 * bk.DEFAULT_PREFILL_CHUNK  # (the tiny model's tokens are bytes)
    rows = [{"id": f"q{i}", "prompt": block + f"Question {i}: what is {i} plus {i + 1}?"} for i in range(6)]
    job = tmp_path / "in.jsonl"
    job.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def serve(name, cache, *flags):
        out = tmp_path / f"{name}.jsonl"
        p = subprocess.run([sys.executable, os.path.join(root, "launch", "batch.py"), "--model", "tiny-random",
                            "--input_jsonl", str(job), "--output_jsonl", str(out), "--max_new_tokens", "8", *flags],
                           capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, JAX_PLATFORMS="cpu", SPECJAX_CACHE_DIR=str(tmp_path / cache)))
        assert p.returncode == 0, p.stderr[-2000:]
        with open(out) as f:
            return {o["id"]: o["output_ids"] for o in map(json.loads, f)}, p.stdout + p.stderr

    want, _ = serve("off", "warm", "--prefix_cache_mb", "0")
    shared = 2 * bk.DEFAULT_PREFILL_CHUNK  # the whole chunks of the shared block
    for name, cache in (("warm", "warm"), ("cold", "cold")):
        got, log = serve(name, cache)
        m = re.search(r"prefix cache: (\d+)/(\d+) prompts hit .*?, (\d+) of \d+ prompt tokens reused", log)
        assert m, log[-2000:]
        # (one prompt per prefill job on a CPU: the first stores the block, the other five reuse it)
        assert (int(m.group(1)), int(m.group(2)), int(m.group(3))) == (5, 6, 5 * shared), (name, m.group(0))
        assert got == want, name
