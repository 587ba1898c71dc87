"""SpecGenerator end to end: greedy losslessness against the autoregressive Generator for
every drafter kind, sampled reproducibility, no compilation after warm-up, user errors,
and the real SmolLM2-135M model."""

from __future__ import annotations

import contextlib
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafters.base import NoDrafter
from specjax.drafters.prompt_lookup import PromptLookupDrafter
from specjax.drafters.device import ModelDraft, layer_skip
from specjax.errors import SpecjaxError
from specjax.reference_ar import reference_generate
from specjax.models import llama
from specjax.sampling import SamplingParams
from specjax.spec_generate import SpecGenerator, SpecStats


def _ls(cfg, params, n):
    """Layer-skip self-drafting with the first n layers, as SpecGenerator / JaxBackend kwargs."""
    d, dparams = layer_skip(cfg, params, n)
    return {"draft": d, "draft_params": dparams}

BATCH_BUCKETS = (1, 4, 8)  # batch 3 runs padded to 4: padding rows are exercised too
K_BUCKETS = (0, 1, 4)
SLOTS = (256,)
MAX_NEW = 24


class RecordingLookup(PromptLookupDrafter):
    """Prompt lookup that records the history it drafts from at every propose()."""

    def __init__(self):
        super().__init__()
        self.seen: dict[int, list[list[int]]] = {}

    def propose(self, row, k):
        self.seen.setdefault(row, []).append(list(self._get(row).history))
        return super().propose(row, k)


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def draft_model(tiny):
    """An independent draft model: same vocabulary, fewer layers, other weights."""
    cfg, _ = tiny
    dcfg = cfg.replace(name="tiny-draft", num_layers=2)
    return dcfg, llama.init_random_params(dcfg, seed=1)


def _rep(seq, n):
    return (list(seq) * n)[: len(seq) * n]


# Prompts of mixed lengths (all <= 16 tokens: one prompt bucket), some repetitive. The random
# tiny model's greedy continuations of several of them fall into loops, so prompt lookup has
# something to accept.
PROMPTS = {
    1: [[30] * 8],
    3: [[30] * 8, [42, 7, 99], _rep([11, 12], 6)],
    8: [_rep([5, 6, 7, 8, 9], 3), [42, 7, 99], _rep([11, 12], 6), [200], _rep([3, 1, 4, 1, 5], 3),
        list(range(100, 116)), [17, 17, 17, 17, 17, 17, 17, 17], [30] * 8],
}


@pytest.fixture(scope="module")
def ar_greedy(tiny):
    cfg, params = tiny
    out = {B: [r.tokens for r in reference_generate(cfg, params, PROMPTS[B], max_new_tokens=MAX_NEW,
                                                    batch_buckets=BATCH_BUCKETS)] for B in PROMPTS}
    for B in PROMPTS:
        assert all(len(t) == MAX_NEW for t in out[B])
    return out


@pytest.fixture(scope="module")
def spec_gens(tiny, draft_model):
    cfg, params = tiny
    dcfg, dparams = draft_model
    kw = dict(batch_buckets=BATCH_BUCKETS, k_buckets=K_BUCKETS, slot_buckets=SLOTS)
    gens = {
        "none": SpecGenerator(cfg, params, drafter=NoDrafter(), **kw),
        "prompt_lookup": SpecGenerator(cfg, params, drafter=RecordingLookup(), **kw),
        "draft_model": SpecGenerator(cfg, params, draft=ModelDraft(dcfg), draft_params=dparams, **kw),
        "layer_skip": SpecGenerator(cfg, params, **_ls(cfg, params, 2), **kw),
    }
    # The two host drafters compile the same code (share_compiled): prompt lookup's K = 0 steps
    # and prefills are the ones the no-draft generator compiled.
    gens["prompt_lookup"].share_compiled(gens["none"])
    return gens


# ---------------------------------------------------------------- greedy losslessness (tiny model)

# Prompt lookup on the full (B, K) grid; the model drafters on three corners of it (batch 1,
# padded batch 3, batch 8 with both K) to keep the default suite's compile time down; their full
# grid runs on the real model in the slow suite.
GRID = [("none", B, 0) for B in PROMPTS] + [("prompt_lookup", B, K) for B in PROMPTS for K in (1, 4)] + [
    (d, B, K) for d in ("draft_model", "layer_skip") for B, K in ((1, 4), (3, 1), (8, 4))]


@pytest.mark.parametrize("drafter,B,K", GRID, ids=[f"{d}-B{B}-K{K}" for d, B, K in GRID])
def test_greedy_equals_autoregressive(spec_gens, ar_greedy, drafter, B, K):
    gen = spec_gens[drafter]
    host = getattr(gen.drafter, "host", None)  # (a host drafter, as the engine wraps it)
    if isinstance(host, RecordingLookup):
        host.seen.clear()
    stats = SpecStats()
    res = gen.generate(PROMPTS[B], max_new_tokens=MAX_NEW, num_spec_tokens=K, stats=stats)
    assert len(res) == B
    for b, r in enumerate(res):
        assert r.tokens == ar_greedy[B][b], f"row {b} (prompt len {len(PROMPTS[B][b])}) diverged from AR greedy"
        assert r.finish_reason == "length" and r.prompt_len == len(PROMPTS[B][b])
    # Stats bookkeeping: every generated token after the prefill's first came out of a verify step.
    assert stats.emitted == sum(len(r.tokens) for r in res) - B
    assert stats.accepted <= stats.drafted
    if drafter == "none":
        assert stats.drafted == 0 and stats.mean_accepted_tokens == 1.0
    elif drafter in ("draft_model", "layer_skip"):
        assert stats.drafted == K * stats.steps
    if drafter == "prompt_lookup":
        assert stats.mean_accepted_tokens > 1.0, stats.summary()
        # The drafter always drafts from the full history: prompt, then every generated token,
        # including the pending one sampled by the previous step (or the prefill).
        seen = host.seen
        assert set(seen) == set(range(B))
        for b in range(B):
            full = list(PROMPTS[B][b]) + res[b].tokens
            for h in seen[b]:
                assert len(h) > len(PROMPTS[B][b]), "drafting before the pending token is in the history"
                assert h == full[: len(h)], "the drafter's history is not prompt + generated tokens"
            assert [len(h) for h in seen[b]] == sorted(len(h) for h in seen[b])


class ScriptedDrafter(NoDrafter):
    """Proposes 0, 1, 3, 0, 1, 3, ... arbitrary tokens (mostly rejected: exercises rollback)."""

    def __init__(self):
        self.calls = 0

    def propose(self, row, k):
        n = (0, 1, 3)[self.calls % 3]
        self.calls += 1
        return np.full(min(n, k), 77, np.int32)


def test_host_step_shrinks_to_the_proposal(tiny, ar_greedy):
    """A host drafter's K is a ceiling: each step runs the smallest compiled bucket holding the
    proposal (0 drafts -> the K=0 step, 3 drafts -> K=4), and the output stays lossless."""
    cfg, params = tiny
    gen = SpecGenerator(cfg, params, drafter=ScriptedDrafter(), batch_buckets=BATCH_BUCKETS, k_buckets=K_BUCKETS,
                        slot_buckets=SLOTS)
    used = []
    table = gen.backend(gen.slots_for([len(PROMPTS[1][0])], MAX_NEW)).table
    real = table.step

    def spy(B, K, *rest):
        used.append(K)
        return real(B, K, *rest)

    table.step = spy
    table.decode = lambda B, *rest, _d=table.decode, **kw: used.append(0) or _d(B, *rest, **kw)  # (K = 0: a decode call)
    res = gen.generate(PROMPTS[1], max_new_tokens=MAX_NEW, num_spec_tokens=4)
    assert res[0].tokens == ar_greedy[1][0]
    assert used[:6] == [0, 1, 4, 0, 1, 4]
    gen.shrink_to_proposal = False
    used.clear()
    assert gen.generate(PROMPTS[1], max_new_tokens=MAX_NEW, num_spec_tokens=4)[0].tokens == ar_greedy[1][0]
    assert set(used) == {4}


def test_full_depth_self_draft_is_always_accepted(tiny):
    """A layer-skip 'draft' with all layers is the target itself, so with sampling q == p (up to
    rounding: the draft runs one token at a time, the target a block) and practically every draft
    is accepted. This fails if the draft's warping, its random stream or its cache bookkeeping
    (re-feeding [prev, pending], rollback) disagreed with the target's."""
    cfg, params = tiny
    gen = SpecGenerator(cfg, params, **_ls(cfg, params, cfg.num_layers),
                        batch_buckets=(4,), k_buckets=(0, 4), slot_buckets=SLOTS)
    st = SpecStats()
    sp = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=2),
          SamplingParams(temperature=1.3, seed=3)]
    res = gen.generate(PROMPTS[3], sampling=sp, max_new_tokens=MAX_NEW, num_spec_tokens=4, stats=st)
    assert [len(r.tokens) for r in res] == [MAX_NEW] * 3
    assert st.drafted == 4 * st.steps and st.acceptance_rate > 0.97, st.summary()


def test_goodput_policy_through_the_static_api(spec_gens, ar_greedy):
    """SpecGenerator.generate under SmartSpec's goodput policy (K chosen per step among every
    compiled bucket, acceptance learnt across calls) is still exactly AR greedy."""
    from specjax.goodput import GoodputPolicy, LinearCost, StepCostModel

    cheap = StepCostModel(target=LinearCost(0.0, 1e-6, 1e-2), draft=LinearCost(0.0, 1e-6, 1e-4))
    pol = GoodputPolicy(cheap)
    gen = spec_gens["prompt_lookup"]
    st = SpecStats()
    for B in (1, 3):
        out = gen.generate(PROMPTS[B], max_new_tokens=MAX_NEW, num_spec_tokens=4, stats=st, policy=pol)
        assert [r.tokens for r in out] == ar_greedy[B]
    assert st.drafted > 0


def _dear_draft_policy(draft_s: float = 8e-3):
    """A goodput policy whose cost model makes a draft forward ``draft_s`` seconds against a
    target step's 10 ms. At 8 ms drafting pays only at an acceptance near 1, so at the prior
    (0.5) it never speculates, and its prefill gate learns that drafts do not pay; at 1 s it
    could not pay even with every draft accepted (``could_pay``)."""
    from specjax.goodput import GoodputPolicy, LinearCost, StepCostModel

    return GoodputPolicy(StepCostModel(target=LinearCost(0.0, 1e-6, 1e-2), draft=LinearCost(0.0, 1e-6, draft_s)))


def test_prefill_gate_skips_the_draft_prefill_once_drafts_do_not_pay(spec_gens, ar_greedy):
    """With a device drafter, a GoodputPolicy gets a prefill gate that persists across generate
    calls: once its steps were K = 0, the next prompts are admitted without the draft prefill
    (and never draft). Greedy outputs stay AR's whatever the gate does."""
    from specjax.goodput import DraftPrefillGate, FixedK

    gen = spec_gens["layer_skip"]
    table = gen.backend(gen.slots_for([len(PROMPTS[1][0])], MAX_NEW)).table
    runs = []  # run_draft of every prefill the backend calls
    real = table.prefill

    def spy(B, C, S, greedy_only, run_draft=True, compile_if_missing=False, first=True):
        if first:
            runs.append(bool(run_draft))
        return real(B, C, S, greedy_only, run_draft, compile_if_missing, first)

    table.prefill = spy
    try:
        pol = _dear_draft_policy()
        for _ in range(3):
            st = SpecStats()
            out = gen.generate(PROMPTS[1], max_new_tokens=MAX_NEW, num_spec_tokens=4, stats=st, policy=pol)
            assert out[0].tokens == ar_greedy[1][0] and st.drafted == 0
            assert gen.last_draft_prefill == runs[-1]
        assert runs == [True, False, False]  # the gate closed after the first prompt's K = 0 steps
        runs.clear()  # a draft that could not pay even if always accepted: no draft prefill, not even a first
        out = gen.generate(PROMPTS[1], max_new_tokens=MAX_NEW, num_spec_tokens=4, policy=_dear_draft_policy(1.0))
        assert runs == [False] and gen.last_draft_prefill is False and out[0].tokens == ar_greedy[1][0]
        assert gen.prefill_gate_for(pol) is gen.prefill_gate_for(pol)  # one gate per policy object
        assert gen.prefill_gate_for(_dear_draft_policy()) is not gen.prefill_gate_for(pol)
        assert gen.prefill_gate_for(FixedK(4)) is None  # a fixed K learns nothing
        assert spec_gens["prompt_lookup"].prefill_gate_for(pol) is None  # host drafters have no draft prefill
        # a feature head's prefill is one layer over the prompt: no default gate, a given one is used
        from specjax.drafters import eagle

        cfg, params = gen.cfg, gen.params
        head = SpecGenerator(cfg, params, drafter=eagle.EagleDrafter(*eagle.init_params(cfg, params)),
                             batch_buckets=BATCH_BUCKETS, k_buckets=K_BUCKETS, slot_buckets=SLOTS)
        given = DraftPrefillGate()
        assert head.prefill_gate_for(pol) is None and head.prefill_gate_for(pol, given) is given

        runs.clear()
        gen.generate(PROMPTS[1], max_new_tokens=MAX_NEW, num_spec_tokens=4, policy=pol, prefill_gate=False)
        assert runs == [True] and gen.last_draft_prefill

        # A closed gate given with a fixed K: the step is K = 4, yet the request drafts nothing.
        closed = DraftPrefillGate(threshold=0.5, window=4)
        for _ in range(4):
            closed.record(0)
        runs.clear()
        st = SpecStats()
        out = gen.generate(PROMPTS[1], max_new_tokens=MAX_NEW, num_spec_tokens=4, stats=st, prefill_gate=closed)
        assert runs == [False] and out[0].tokens == ar_greedy[1][0] and st.drafted == 0 and st.steps > 0
    finally:
        del table.prefill


def test_generators_share_compiled_executables(tiny, ar_greedy):
    """Generators that differ only in their host drafter call one set of compiled executables:
    the second compiles nothing, and a device-draft generator cannot join them."""
    cfg, params = tiny
    kw = dict(batch_buckets=(1,), k_buckets=(0, 1, 4), slot_buckets=SLOTS)
    a = SpecGenerator(cfg, params, drafter=PromptLookupDrafter(), **kw)
    b = SpecGenerator(cfg, params, drafter=ScriptedDrafter(), **kw)
    b.share_compiled(a)
    a.warmup(prompt_lens=(16,), greedy_modes=(True,))
    n = len(a.backend(SLOTS[0]).table)
    assert b.warm and b.backend(SLOTS[0]).table is a.backend(SLOTS[0]).table
    # warm: a shape a did not compile would raise instead of compiling
    assert b.generate(PROMPTS[1], max_new_tokens=MAX_NEW, num_spec_tokens=4)[0].tokens == ar_greedy[1][0]
    assert len(a.backend(SLOTS[0]).table) == n
    with pytest.raises(SpecjaxError, match="share_compiled"):
        SpecGenerator(cfg, params, **_ls(cfg, params, 2), **kw).share_compiled(a)


def test_layer_skip_draft_owns_its_params(tiny):
    """A layer-skip draft has a params tree of its own: it shares the target's arrays (no copy)
    until trained, and replacing the draft's arrays (what a distiller does) leaves the target
    untouched; its static description says what it is."""
    cfg, params = tiny
    d, dparams = layer_skip(cfg, params, 2)
    assert d.cfg.num_layers == 2 and d.label == "layer_skip2" and hash(d) == hash(layer_skip(cfg, params, 2)[0])
    assert dparams["layers"][0]["wq"] is params["layers"][0]["wq"] and dparams["embed"] is params["embed"]
    dparams["layers"][0] = {k: v * 0 for k, v in dparams["layers"][0].items()}
    dparams["embed"] = dparams["embed"] + 1
    assert float(abs(params["layers"][0]["wq"]).sum()) > 0 and len(params["layers"]) == cfg.num_layers
    assert dparams["embed"] is not params["embed"]
    with pytest.raises(SpecjaxError, match="layer-skip draft needs 1..4 layers"):
        layer_skip(cfg, params, 0)


# ---------------------------------------------------------------- sampled generation


def test_sampled_with_draft_model_is_reproducible(spec_gens, ar_greedy):
    gen = spec_gens["draft_model"]
    prompts = PROMPTS[3]

    def run(seeds):
        sp = [SamplingParams(),  # a greedy row inside a sampled batch
              SamplingParams(temperature=0.9, seed=seeds[0]),
              SamplingParams(temperature=1.2, top_k=40, top_p=0.9, seed=seeds[1])]
        st = SpecStats()
        out = [r.tokens for r in gen.generate(prompts, sampling=sp, max_new_tokens=MAX_NEW, num_spec_tokens=4,
                                              stats=st)]
        return out, st

    a, st = run((1, 2))
    b, _ = run((1, 2))
    c, _ = run((3, 4))
    assert st.drafted == 4 * st.steps and 0 < st.accepted < st.drafted
    assert a == b, "same seeds gave different samples"
    assert a[0] == ar_greedy[3][0], "a greedy row in a sampled batch must stay greedy"
    assert c[0] == a[0]
    assert a[1] != c[1] and a[2] != c[2], "other seeds gave the same samples"
    assert a[1] != ar_greedy[3][1] or a[2] != ar_greedy[3][2]
    for t in a + c:
        assert len(t) == MAX_NEW and all(0 <= x < 256 for x in t)


# ---------------------------------------------------------------- no compilation after warm-up


class _CompileLog(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.records: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if "compil" in msg.lower():
            self.records.append(msg)


@contextlib.contextmanager
def capture_compiles():
    h = _CompileLog()
    logger = logging.getLogger("jax")
    old_level = logger.level
    prev = jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", True)
    logger.addHandler(h)
    if logger.getEffectiveLevel() > logging.WARNING:
        logger.setLevel(logging.WARNING)
    try:
        yield h.records
    finally:
        logger.removeHandler(h)
        logger.setLevel(old_level)
        jax.config.update("jax_log_compiles", prev)


def test_no_compilation_after_warmup(tiny, draft_model):
    cfg, params = tiny
    dcfg, dparams = draft_model
    # A slot bucket no other test uses, so warm-up really compiles (JAX caches executables in-process).
    gen = SpecGenerator(cfg, params, draft=ModelDraft(dcfg), draft_params=dparams, batch_buckets=(1, 4),
                        k_buckets=(0, 2, 4), slot_buckets=(192,))
    with capture_compiles() as log:
        jax.jit(lambda x: x * 3 + 1)(jnp.ones((11,)))  # the capture must see a deliberate compile
        assert log, "compile capture does not work: it missed a deliberate new jit compile"
        log.clear()
        gen.warmup(prompt_lens=(16,), greedy_modes=(True, False), k_buckets=(0, 2))
        assert len(log) >= 12, f"warm-up compiled only {len(log)} things: {log[:3]}"  # 8 steps + 4 prefills
        log.clear()
        sampled = [SamplingParams(temperature=0.8, seed=5), SamplingParams(temperature=1.1, top_k=30, seed=6),
                   SamplingParams(temperature=0.7, top_p=0.8, seed=7)]
        runs = [(PROMPTS[1], SamplingParams(), 2), (PROMPTS[3], SamplingParams(), 0),
                (PROMPTS[3], sampled, 2), (PROMPTS[1], sampled[:1], 0),
                (PROMPTS[3][:2], [SamplingParams(), sampled[0]], 2), (PROMPTS[8][3:7], SamplingParams(), 2),
                (PROMPTS[1], SamplingParams(), 0)]
        for prompts, sp, K in runs:
            res = gen.generate(prompts, sampling=sp, max_new_tokens=10, num_spec_tokens=K)
            assert [len(r.tokens) for r in res] == [10] * len(prompts)
        assert log == [], f"compiled after warm-up: {log}"
        # Shapes that were not warmed up raise instead of compiling.
        # (a device draft's steps run as decode calls of K)
        with pytest.raises(SpecjaxError, match="no precompiled decode call of up to 16 steps with K 4"):
            gen.generate(PROMPTS[1], max_new_tokens=10, num_spec_tokens=4)  # a K bucket left out of warm-up
        with pytest.raises(SpecjaxError, match="no precompiled prefill"):
            gen.generate([list(range(1, 21))], max_new_tokens=10, num_spec_tokens=2)  # prompt bucket 32
        assert log == [], f"compiled after warm-up: {log}"


# ---------------------------------------------------------------- user errors


def test_bad_inputs_raise_clear_errors(tiny, draft_model):
    cfg, params = tiny
    dcfg, dparams = draft_model
    gen = SpecGenerator(cfg, params, drafter=PromptLookupDrafter(), batch_buckets=(1,), k_buckets=(0, 1, 4),
                        slot_buckets=SLOTS)
    with pytest.raises(SpecjaxError, match=r"num_spec_tokens=8 exceeds the largest K bucket 4"):
        gen.generate([[1, 2, 3]], num_spec_tokens=8)
    with pytest.raises(SpecjaxError, match=r"num_spec_tokens=2 is not a precompiled K bucket \[0, 1, 4\]"):
        gen.generate([[1, 2, 3]], num_spec_tokens=2)
    with pytest.raises(SpecjaxError, match="empty prompt"):
        gen.generate([[]], num_spec_tokens=1)
    with pytest.raises(SpecjaxError, match="empty prompt"):
        gen.generate([[1, 2], []], num_spec_tokens=1)
    other = dcfg.replace(name="other-vocab", vocab_size=300)
    with pytest.raises(SpecjaxError, match=r"draft model vocabulary \(300\) differs from the target's \(256\)"):
        SpecGenerator(cfg, params, draft=ModelDraft(other), draft_params=llama.init_random_params(other, 2))
    with pytest.raises(SpecjaxError, match="needs its params"):
        SpecGenerator(cfg, params, draft=ModelDraft(dcfg))
    with pytest.raises(SpecjaxError, match="k_buckets must include 0"):
        SpecGenerator(cfg, params, k_buckets=(1, 4))
    for bad in (0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(SpecjaxError, match=r"top_p must be in \(0, 1\]"):
            SamplingParams(temperature=1.0, top_p=bad)
    SamplingParams(temperature=1.0, top_p=1.0)  # the boundary itself is fine


# ---------------------------------------------------------------- the real model (SmolLM2-135M)

CHAT = [
    "What is the capital of France?",
    "Repeat this sentence three times: the quick brown fox jumps over the lazy dog. "
    "the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog.",
    "Write a python function that adds two numbers.",
]
CHAT_MORE = CHAT + [
    "Name three colors.",
    "Count from one to ten: one, two, three, four, five, six, seven, eight, nine, ten. Again: one, two, three,",
    "Why is the sky blue?",
    "List the days of the week. Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday.",
    "hi",
]


@pytest.fixture(scope="module")
def smol():
    from specjax.models.loader import load_model

    return load_model("smollm2-135m", dtype="float32")


def _real_check(smol, prompts, drafters, ks, new_tokens, batch_buckets):
    tok = smol.tokenizer
    ids = [tok.encode_chat(p) for p in prompts]
    want = [r.tokens for r in reference_generate(smol.cfg, smol.params, ids, max_new_tokens=new_tokens,
                                                 eos_ids=tok.eos_ids, batch_buckets=batch_buckets)]
    accepted = {}
    for name, kw in drafters.items():
        gen = SpecGenerator(smol.cfg, smol.params, eos_ids=tok.eos_ids, batch_buckets=batch_buckets,
                            k_buckets=(0,) + tuple(ks), slot_buckets=(256,), **kw)
        for K in ks:
            st = SpecStats()
            got = [r.tokens for r in gen.generate(ids, max_new_tokens=new_tokens, num_spec_tokens=K, stats=st)]
            for b in range(len(ids)):
                assert got[b] == want[b], (f"{name} K={K} row {b}: {tok.decode(got[b])!r} != "
                                           f"{tok.decode(want[b])!r}")
            accepted[(name, K)] = st.mean_accepted_tokens
    return want, accepted


# The default suite's spec == AR check on the real weights (prompt lookup, K = 4) is
# test_smollm2_parity.py's test_greedy_spec_on_the_real_weights_equals_autoregressive: it reuses that
# file's model load and its greedy runs, which are checked against transformers' greedy tokens.


@pytest.mark.slow
@pytest.mark.parametrize("B", [1, 3, 8])
def test_smollm2_greedy_spec_grid(smol, B):
    # 8 layers: drafts are almost never accepted (rejection paths); 24 layers: a fair share is.
    drafters = {"prompt_lookup": dict(drafter=PromptLookupDrafter()),
                "layer_skip_8": dict(**_ls(smol.cfg, smol.params, 8)),
                "layer_skip_24": dict(**_ls(smol.cfg, smol.params, 24))}
    _, acc = _real_check(smol, CHAT_MORE[:B], drafters, ks=(2, 4), new_tokens=48, batch_buckets=(1, 4, 8))
    print(f"B={B} mean accepted tokens per step: {acc}")
    assert acc[("layer_skip_24", 4)] > 1.0, acc
    if B > 1:
        assert acc[("prompt_lookup", 4)] > 1.0, acc


# ---------------------------------------------------------------- executables on disk, compiled in the background


def test_executables_on_disk_and_in_the_background(tiny, ar_greedy, tmp_path, monkeypatch):
    """A second generator loads every executable from the on-disk cache (keyed without tracing)
    and generates the same tokens; K buckets compiled in the background join the policy's options
    only once compiled (and start after the step count they were given), and K = 0 runs
    losslessly meanwhile."""
    from specjax.engine import exe_cache

    cfg, params = tiny
    disk = exe_cache.ExecutableCache(str(tmp_path))
    loads = []
    orig_load = exe_cache.ExecutableCache.load
    monkeypatch.setattr(exe_cache.ExecutableCache, "load", lambda self, name: loads.append(
        r := orig_load(self, name)) or r)
    S = 224  # a slot bucket no other test uses

    def make(cache):
        gen = SpecGenerator(cfg, params, drafter=PromptLookupDrafter(), batch_buckets=(1,), k_buckets=(0, 1, 4),
                            slot_buckets=(S,))
        gen.backend(S).table.disk_cache = cache
        return gen

    first = make(disk)
    first.warmup(prompt_lens=(16,), greedy_modes=(True,))
    n_exe = len(first.backend(S).table)
    assert len(list(tmp_path.glob("*.exe"))) == n_exe and not any(loads)  # all compiled, all stored
    loads.clear()
    second = make(disk)
    second.warmup(prompt_lens=(16,), greedy_modes=(True,))
    assert len(loads) == n_exe and all(e is not None for e in loads)  # every one from disk
    res = second.generate(PROMPTS[1], max_new_tokens=MAX_NEW, num_spec_tokens=4)
    assert [r.tokens for r in res] == ar_greedy[1]
    # the key covers the arguments and the code: another shape or another source is another entry
    a = jax.ShapeDtypeStruct((2, 3), jnp.float32)
    name = disk.entry("x", (a,))
    assert name != disk.entry("x", (jax.ShapeDtypeStruct((2, 4), jnp.float32),)) != disk.entry("y", (a,))
    monkeypatch.setattr(exe_cache, "code_digest", lambda: "other source")
    assert disk.entry("x", (a,)) != name

    # the background half waits for the step count it was given (a short answer never starts it)
    bg = make(None)
    bg.warmup(prompt_lens=(16,), greedy_modes=(True,), later_ks=(1, 4), later_after_steps=MAX_NEW + 2)
    be = bg.backend(S)
    assert be.k_options(1) == (0,)
    with pytest.raises(SpecjaxError, match="no precompiled spec step"):
        be.table.step(1, 4, S, True)  # not compiled yet, and nothing compiles it in the foreground
    res = bg.generate(PROMPTS[1], max_new_tokens=MAX_NEW, num_spec_tokens=0)  # < MAX_NEW steps
    assert [r.tokens for r in res] == ar_greedy[1]
    assert not be.planner._later_gate.is_set() and be.k_options(1) == (0,)
    bg.generate(PROMPTS[1], max_new_tokens=MAX_NEW, num_spec_tokens=0)  # past the count: it starts
    assert be.planner._later_gate.is_set()
    be.planner._later.join()
    assert be.k_options(1) == (0, 1, 4) and bg.stop_later() == []
    res = bg.generate(PROMPTS[1], max_new_tokens=MAX_NEW, num_spec_tokens=4)
    assert [r.tokens for r in res] == ar_greedy[1]
