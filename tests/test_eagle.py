"""The EAGLE-style feature head (drafters.eagle, issue 30 parts 1-2): target features cost nothing
when off, the head's cache and carried feature after any mix of steps equal a prefill of what was
committed (the catch-up uses the target's real features), greedy serving is token-identical to
the autoregressive reference with requests joining and leaving, sampling is reproducible and
verifies with the head's real draft distributions, and a head saves and loads."""

from __future__ import annotations

import dataclasses

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import registry
from specjax.drafters import eagle, heads
from specjax.engine.jax_backend import JaxBackend
from specjax.engine.loop import EventClock, ServingEngine
from specjax.engine.scheduler import Request
from specjax.engine.spec import DrafterSpec, EngineSpec, PolicySpec
from specjax.engine.table import StepTable
from specjax.errors import SpecjaxError
from specjax.goodput import FixedK
from specjax.models import llama
from specjax.reference_ar import reference_generate
from specjax.sampling import SamplingArrays, SamplingParams

SLOTS = 64
MAX_NEW = 12
VOCAB_IDS = np.arange(0, 256, 2)  # a reduced head: half the tiny model's tokens


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1, 255, size=int(rng.integers(3, 15)))] for _ in range(n)]


PROMPTS = _prompts(5)


class OpClock(EventClock):
    """1 ms per engine operation, so arrivals interleave with steps the same way on any machine."""

    def advance(self, dt: float) -> None:
        self.t += 0.001


@pytest.fixture(scope="module")
def head(tiny):
    cfg, params = tiny
    return eagle.init_params(cfg, params, VOCAB_IDS, seed=1)


B = 4  # the one batch bucket: every test shares its few executables (compiling them is the file's cost)


@pytest.fixture(scope="module")
def backend(tiny, head):
    """One eagle backend for the module; its executables compile on first use (no warm-up)."""
    cfg, params = tiny
    draft, dparams = head  # a window of 2 deferred positions: plain steps fill it within a test
    return JaxBackend(cfg, params, drafter=eagle.EagleDrafter(dataclasses.replace(draft, lag_window=2), dparams),
                      k_buckets=(0, 2), batch_buckets=(B,), slots=SLOTS)


def test_features_off_adds_nothing(tiny, backend):
    """With no feature head the forward and the steps lower to the programs without features (the
    off path asks for none and returns none); with one, the step carries the [B, K+1, 3D]
    features (byte-identity of the off path with main's was checked when this was built)."""
    cfg, params = tiny
    T = 3
    toks, pos = jnp.zeros((B, T), jnp.int32), jnp.zeros((B, T), jnp.int32)
    cache = llama.init_cache_for(cfg, B, 16)

    def lowered(**kw):
        return jax.jit(lambda p, c: llama.forward(p, toks, pos, c, llama.causal_mask(B, T), cfg=cfg, **kw)
                       ).lower(params, cache)

    assert lowered().as_text() == lowered(features=()).as_text()
    on = lowered(features=llama.feature_layers(cfg.num_layers))
    assert len(on.out_info) == 3 and on.out_info[2].shape == (B, T, 3 * cfg.hidden_size)

    feat = f"tensor<{B}x{T}x{3 * cfg.hidden_size}xf32>"  # the step's block features
    off_table = StepTable(cfg, params, params)
    assert off_table.key("step", B, SLOTS, True, k=2).features == ()
    assert feat not in _step_text(off_table)
    assert backend.table.key("step", B, SLOTS, True, k=2).features == llama.feature_layers(cfg.num_layers)
    assert feat in _step_text(backend.table)


def prefill_row0(be, tokens, greedy, samp, width=16):
    """The state a B-row prefill of ``tokens`` into row 0 (the other rows empty) leaves."""
    toks = np.zeros((B, width), np.int32)
    toks[0, :len(tokens)] = tokens
    n = np.zeros(B, np.int32)
    n[0] = len(tokens)
    return be.table.prefill(B, width, SLOTS, greedy, True)(be.params, be.dparams, jax.device_put(toks),
                                                           jax.device_put(n), samp)


def _step_text(table):
    from specjax.engine.step import spec_step_jit

    key = table.key("step", B, SLOTS, True, k=2)
    return spec_step_jit.lower(table.params, table.dparams, table.state_info(B, SLOTS), table._sds((B, 2), jnp.int32),
                               table._sds((B,), jnp.int32), table._sds((B,), jnp.bool_), table._abstract_samp(B),
                               None, None, key=key).as_text()


@pytest.mark.parametrize("greedy,steps", [(False, (2, 2, 2)), (True, (2, 0, 2)), (True, (0, 0, 0, 2, 0, 0, 0))])
def test_head_state_equals_a_prefill_of_what_was_committed(backend, greedy, steps):
    """After a prefill and chain steps (K = 2 with drafts accepted and rejected; K = 0), row 0's
    committed head cache entries and carried feature are those a prefill of its committed tokens
    gives: every committed position is caught up with the target's real features, none keeps the
    head's own. Plain steps defer the head's entries (a window of 2: the third plain step in a
    row catches up first; a K = 2 step catches up before drafting), so the state is compared
    once caught up (``settle``). Sampled at a high temperature, drafts of a random head get
    accepted."""
    t = backend.table
    prompt = [5, 17, 42, 9, 100]
    samp = SamplingArrays.build([SamplingParams(temperature=0.0 if greedy else 20.0, seed=3)], B)
    put = jax.device_put
    active = put(np.arange(B) == 0)

    def prefill(tokens):
        return prefill_row0(backend, tokens, greedy, samp)

    state = prefill(prompt)
    out, accepted = [int(state.pending[0])], 0
    for K in steps:
        exe = t.step(B, K, SLOTS, greedy)
        state, o = exe(backend.params, backend.dparams, state, put(np.zeros((B, max(K, 1)), np.int32)),
                       put(np.full(B, K, np.int32)), active, samp, None, None)
        n = int(o.n_accepted[0])
        accepted += n
        out += [int(x) for x in o.tokens[0, :n + 1]]
    L = int(state.cache.lengths[0])
    assert L == len(prompt) + len(out) - 1 and (greedy or accepted > 0)
    plain = tuple(reversed(steps)).index(2) if 2 in steps else len(steps)  # plain steps since the last K = 2
    assert int(state.dcache.lag[0]) == (0 if plain == 0 else (plain - 1) % 2 + 1)  # (a window of 2)
    assert not np.asarray(state.dcache.lag[1:]).any()  # (inactive rows defer nothing)
    ref = prefill((prompt + out)[:L])
    got, want = jax.jit(t.draft.settle)(backend.dparams, state.dcache), ref.dcache
    assert int(got.lengths[0]) == int(want.lengths[0]) == L
    np.testing.assert_allclose(got.k[:, 0, :, :L], want.k[:, 0, :, :L], atol=1e-5)
    np.testing.assert_allclose(got.v[:, 0, :, :L], want.v[:, 0, :, :L], atol=1e-5)
    np.testing.assert_allclose(got.feat[0], want.feat[0], atol=1e-5)


def test_row_operations_carry_the_feature(backend):
    """Resizing and inserting rows move a feature head's carried feature with its row."""
    from specjax.engine.table import insert_rows, take_rows

    info = backend.table.state_info(B, SLOTS)
    state = jax.tree_util.tree_map(lambda s: jnp.asarray(np.random.default_rng(0).standard_normal(s.shape), s.dtype),
                                   info)
    feat = np.asarray(state.dcache.feat)
    taken = take_rows(state, jnp.array([2, -1, 0, 1], jnp.int32))
    np.testing.assert_array_equal(taken.dcache.feat[jnp.array([0, 2, 3])], feat[[2, 0, 1]])
    np.testing.assert_array_equal(taken.dcache.k[:, 0], state.dcache.k[:, 2])
    new = jax.tree_util.tree_map(lambda a: a + 1, state)
    ins = insert_rows(state, new, jnp.array([3, B, B, B], jnp.int32))  # new row 0 -> row 3, the rest dropped
    np.testing.assert_array_equal(ins.dcache.feat[3], np.asarray(new.dcache.feat[0]))
    np.testing.assert_array_equal(ins.dcache.feat[:3], feat[:3])


def serves_as_ar(tiny, be, policies, k_max=2, prompts=PROMPTS, together=3):
    """Greedy serving on ``be`` under each policy equals the AR reference with requests joining a
    running batch and leaving it at different steps (``together`` at once first, the others
    joining one by one), a late one alone (batch 1), drafts verified; then sampled serving
    (K = ``k_max``) reproduces itself. Returns the last policy's step records."""
    cfg, params = tiny
    ref = [r.tokens for r in reference_generate(cfg, params, prompts, max_new_tokens=MAX_NEW, batch_buckets=(1,))]
    for policy in policies:
        be.reset()
        eng = ServingEngine(be, policy, clock=OpClock())
        reqs = [Request(f"q{i}", p, MAX_NEW, arrival=(0.0 if i < together else 0.004 * i))
                for i, p in enumerate(prompts)]
        outs = eng.run(reqs + [Request("late", prompts[1], MAX_NEW, arrival=100.0)])
        for o, r in zip(outs, ref + [ref[1]]):
            assert o.tokens == r, f"{o.id} diverged from autoregressive greedy ({type(policy).__name__})"
        assert eng.counts.drafted > 0
        sizes = [s.n for s in eng.steps]
        assert max(sizes) >= together and sizes[-1] == 1

    def sampled():
        be.reset()
        return [o.tokens for o in ServingEngine(be, FixedK(k_max)).run(
            [Request(f"s{i}", p, MAX_NEW, sampling=SamplingParams(temperature=2.0, seed=10 + i))
             for i, p in enumerate(PROMPTS[:3])])]

    assert sampled() == sampled()
    return eng.steps


def test_greedy_token_identical_to_ar_with_joins_and_leaves(tiny, backend):
    serves_as_ar(tiny, backend, [FixedK(2)])


def serves_at_batch_1_and_8(tiny, drafter, k_max):
    """``serves_as_ar`` on a state with batch buckets 1 and 8: 8 requests at once, a ninth
    joining, then the rows (with the head's cache and carried feature) moved down to the
    1-row state as they leave."""
    cfg, params = tiny
    be = JaxBackend(cfg, params, drafter=drafter, k_buckets=(0, k_max), batch_buckets=(1, 8), slots=SLOTS,
                    shrink_patience=1)
    steps = serves_as_ar(tiny, be, [FixedK(k_max)], k_max, prompts=_prompts(9, seed=3), together=8)
    assert {s.bucket for s in steps if s.k_step} == {1, 8}  # verify steps at both


def test_chains_and_dynamic_trees_at_batch_1_and_8(tiny, head):
    """The 4-row tests above run batches of 1 to 3 in one state; this runs 8 at once and 1 alone
    in their own buckets, chains then EAGLE-2 trees."""
    draft, dparams = head
    serves_at_batch_1_and_8(tiny, eagle.EagleDrafter(draft, dparams), 2)
    from specjax.drafters.device import DeviceTreeDrafter
    serves_at_batch_1_and_8(tiny, DeviceTreeDrafter(dataclasses.replace(draft, tree_width=2, tree_depth=2),
                                                    dparams), 4)


@pytest.mark.parametrize("activations", ["float32", "bfloat16"])
def test_a_served_head_reads_q8_0_copies_through_the_rows_kernel(tiny, head, activations):
    """eagle.for_rows_kernel (what eagle.build serves where the target runs the rows kernel): the
    layer's projections, the vocabulary head and fc rounded to Q8_0, the float32 arrays replaced
    by the values the kernel decodes, so a feed on the kernel and a block on XLA's dot compute the
    same head (float32: to summation order; bfloat16 activations, the engine's mode on an
    AVX512_BF16 CPU: to their rounding), online refinement makes the copies again in the draft's
    layout, and speculation with it, chains (and float32 trees) at batch 1 and 8, gives plain
    decoding's tokens."""
    from specjax.drafters.device import DeviceTreeDrafter

    draft, dparams = head
    draft = dataclasses.replace(draft, fwd=eagle.copies_forward(activations))
    served = eagle.for_rows_kernel(dparams, activations)
    for name, w, wq in [(n, dparams["layer"][n], served["layer"][n]) for n in ("wq", "w_down")] + [
            ("fc", dparams["fc"], served["fc"])]:
        w, wq = np.asarray(w), np.asarray(wq)
        step = np.abs(w).reshape(-1, 32, w.shape[1]).max(axis=1, keepdims=True) / 127  # per 32 inputs and column
        assert 0 < np.abs(wq - w).max() and (np.abs(wq - w).reshape(step.shape[0], 32, -1) <= 0.51 * step + 1e-7).all()
    rng = np.random.default_rng(2)
    h = jnp.asarray(rng.standard_normal((3, tiny[0].hidden_size)), jnp.float32)
    feats = jnp.asarray(rng.standard_normal((1, 3, np.shape(dparams["fc"])[0])), jnp.float32)
    xla_only = {k: v for k, v in served.items() if not k.endswith(llama.ROWS_SUFFIX)}
    tol = 1e-5 if activations == "float32" else 2e-2
    for f, x in ((draft._reduced, h), (draft._fuse, feats)):
        assert "specjax_rows_q8_0" in str(jax.make_jaxpr(f)(served, x))  # (the kernel runs it)
        ref = np.asarray(f(xla_only, x))
        np.testing.assert_allclose(np.asarray(f(served, x)), ref, rtol=tol, atol=tol * np.abs(ref).max())
    # training and saving see the head's own arrays only (online refinement makes the copies again)
    assert heads.trainable_of(draft, served).keys() == heads.trainable_of(draft, dparams).keys()
    from specjax.distill.head_online import HeadRefiner
    from specjax.models.cpu import rows_dot

    own = heads.trainable_of(draft, served)
    moved = {**own, "layer": {**own["layer"], "wq": own["layer"]["wq"] * 2}}  # (as if trained)
    refined = HeadRefiner.serving_params(types.SimpleNamespace(
        trainable=moved, dtype=jnp.float32, rows_copies=True, trainer=types.SimpleNamespace(kind=eagle.KIND),
        draft=draft, frozen={k: v for k, v in served.items() if k not in own and not k.endswith(llama.ROWS_SUFFIX)}))
    wq = np.asarray(refined["layer"]["wq"])
    qkv = rows_dot.layer_of(refined[eagle.LAYER_ROWS]["wqkv"], 0)  # (q, k, v one pack: llama.FUSED)
    assert rows_dot.paired(qkv) == (activations != "float32")
    np.testing.assert_array_equal(rows_dot.dequantize_packed(qkv, wq.shape[1]), wq)  # the copies follow the weights
    serves_at_batch_1_and_8(tiny, eagle.EagleDrafter(draft, served), 2)
    if activations == "float32":
        serves_at_batch_1_and_8(tiny, DeviceTreeDrafter(dataclasses.replace(draft, tree_width=2, tree_depth=2),
                                                        served), 4)


class Alternating(FixedK):
    """K = 2, then a decode call of up to 4 plain steps, and so on."""

    def __init__(self):
        super().__init__(2)
        self.call_steps, self._n = 4, 0

    def choose(self, view):
        self._n += 1
        return 2 if self._n % 2 else 0


class FirstOnly:
    """A draft prefill gate that admits the first ``first`` admissions with the draft and
    disables it for the rest."""

    def __init__(self, first: int):
        self.n, self.first = 0, first

    def record(self, k, could_draft=True):
        pass

    def speculate(self):
        self.n += 1
        return self.n <= self.first


@pytest.mark.parametrize("first", [0, 1])
def test_decode_calls_without_any_drafting_row_skip_the_heads_upkeep(tiny, backend, monkeypatch, first):
    """A decode call in which no row can draft (all admitted with the draft disabled) runs plain
    decoding's program, without the head's upkeep; one with a drafting row keeps it. Greedy
    tokens stay AR's either way, with requests joining and leaving."""
    cfg, params = tiny
    ref = [r.tokens for r in reference_generate(cfg, params, PROMPTS, max_new_tokens=MAX_NEW, batch_buckets=(1,))]
    upkeep = []
    decode = backend.table.decode

    def spy(*a, **kw):
        if not kw.get("k"):  # (plain decoding's calls; the K = 2 steps are calls of K too)
            upkeep.append(kw.get("upkeep", True))
        return decode(*a, **kw)

    monkeypatch.setattr(backend.table, "decode", spy)
    backend.reset()
    eng = ServingEngine(backend, Alternating(), clock=OpClock(), prefill_gate=FirstOnly(first))
    reqs = [Request(f"q{i}", p, MAX_NEW, arrival=0.0 if i < 2 else 0.004 * i) for i, p in enumerate(PROMPTS)]
    outs = eng.run(reqs)
    assert [o.tokens for o in outs] == ref
    assert False in upkeep and (True in upkeep) == bool(first), upkeep
    assert any(getattr(k, "op", "") == "decode" and k.draft is None and not k.features for k in backend.table._exe)


@pytest.mark.parametrize("temperature", [0.0, 20.0])
def test_calls_of_verify_steps_are_single_steps(backend, monkeypatch, temperature):
    """The head drafts inside its steps, so the engine runs runs of them as one device call
    (``fused_steps``, spec_decode at K > 0): the tokens (seed for seed when sampled), each
    request's steps, drafts and acceptances, and the steps the observers see are those of one
    call per step, with requests joining, leaving and stopping at an EOS inside a call (when they
    join, the batch's steps differ: a call is one of the clock's operations)."""
    assert backend.fused_steps
    sizes = []
    decode = backend.decode
    monkeypatch.setattr(backend, "decode", lambda rs, n, *a: (lambda out: sizes.append((a[-1], max(map(len, out[0]))))
                                                              or out)(decode(rs, n, *a)))
    samp = SamplingParams(temperature=temperature)

    def run(policy, eos=()):
        backend.reset()
        eng = ServingEngine(backend, policy, clock=OpClock(), eos_ids=eos)
        reqs = [Request(f"q{i}", p, MAX_NEW if i != 1 else 5, arrival=0.0 if i < 3 else 0.004 * i,
                        sampling=dataclasses.replace(samp, seed=10 + i)) for i, p in enumerate(PROMPTS)]
        outs = eng.run(reqs)
        # (the steps the observers saw add up to the requests' own counts)
        assert [sum(x) for x in zip(*[(s.n, s.drafted, s.accepted) for s in eng.steps])] == [
            sum(o.steps for o in outs), sum(o.drafted for o in outs), sum(o.accepted for o in outs)]
        return [(o.tokens, o.steps, o.drafted, o.accepted, o.finish_reason) for o in outs]

    one = FixedK(2)
    one.call_steps = 1
    eos = (run(one)[0][0][6],)  # (request 0 stops at its 7th token or before, inside a call)
    single = run(one, eos)
    assert not sizes
    assert run(FixedK(2), eos) == single
    assert max(n for k, n in sizes if k == 2) > 2, sizes  # (calls of several verify steps ran)
    assert "eos" in {o[4] for o in single}
    assert sum(o[3] for o in single) > 0 or not temperature  # (the random head's greedy drafts may all miss)


def test_sampled_reproducible_and_verified_with_the_heads_q(backend):
    """At T > 0 the same seeds give the same tokens, and drafts are accepted at the rate exact
    speculative sampling gives with the head's distribution q (sum of min(p, q), about a half at a
    high temperature with half the vocabulary); verifying as if q were one-hot at the draft would
    accept about p(draft) ~ 1/256."""
    def run():
        backend.reset()
        eng = ServingEngine(backend, FixedK(2))
        outs = eng.run([Request(f"s{i}", p, MAX_NEW, sampling=SamplingParams(temperature=20.0, seed=10 + i))
                        for i, p in enumerate(PROMPTS[:3])])
        return [o.tokens for o in outs], eng.counts

    a, counts = run()
    b, _ = run()
    assert a == b
    assert counts.drafted > 20 and counts.accepted / counts.drafted > 0.2, (counts.accepted, counts.drafted)


def test_reduced_head_drafts_only_its_tokens(tiny, head):
    """The head's q is a distribution over the target's vocabulary with zeros outside its N ids;
    a greedy draft, picked from the N logits alone, is the full vocabulary's argmax and its
    confidence the full distribution's top probability."""
    cfg, _ = tiny
    draft, dparams = head
    samp = SamplingArrays.build([SamplingParams(temperature=1.0, seed=1)] * 2, 2)
    h = jnp.asarray(np.random.default_rng(0).standard_normal((2, cfg.hidden_size)), jnp.float32)
    lengths = jnp.zeros((2,), jnp.int32)
    q = np.asarray(jax.jit(lambda dp, h: draft._pick(dp, draft._reduced(dp, h), 0, lengths, samp, False)[1]
                           )(dparams, h))
    np.testing.assert_allclose(q.sum(-1), 1.0, rtol=1e-5)
    outside = np.setdiff1d(np.arange(cfg.vocab_size), VOCAB_IDS)
    assert (q[..., outside] == 0).all() and (q[..., VOCAB_IDS] > 0).all()
    d, _, conf = jax.jit(lambda dp, h: draft._pick(dp, draft._reduced(dp, h), 0, lengths, samp, True))(dparams, h)
    full = np.asarray(draft._full(dparams, draft._reduced(dparams, h)))
    np.testing.assert_array_equal(np.asarray(d), full.argmax(-1))
    np.testing.assert_allclose(np.asarray(conf), np.asarray(jax.nn.softmax(full, -1)).max(-1), rtol=1e-6)


def test_save_load_and_registry(tiny, head, tmp_path, monkeypatch):
    """A saved head loads back exactly (through ``--eagle_head`` too; restored once, then mapped
    from models.prepared's store), the target's shared arrays are not in it, and a head of another
    target is refused; the eagle drafter does not draft ahead."""
    from specjax.models import prepared

    cfg, params = tiny
    draft, dparams = head
    eagle.save_head(str(tmp_path / "head"), cfg, dparams)
    monkeypatch.setattr(prepared, "_DIRECTORY", str(tmp_path / "store"))
    model = types.SimpleNamespace(cfg=cfg, params=params)
    for restored in (True, False):
        if not restored:  # the second load maps the store's copy: no checkpoint is read
            monkeypatch.setattr(heads, "_checkpoints", lambda *a: pytest.fail("restored again"))
        d = registry.drafter_parts(model, "eagle", k=2, eagle_head=str(tmp_path / "head"))["drafter"]
        prepared.wait()
        assert isinstance(d, eagle.EagleDrafter) and d.draft == draft
        for k in ("fc", "lm_head", "vocab_ids"):
            np.testing.assert_array_equal(d.params[k], dparams[k])
        jax.tree_util.tree_map(np.testing.assert_array_equal, d.params["layer"], dparams["layer"])
        assert d.params["embed"] is params["embed"]  # shared, not copied
    tmp_path = tmp_path / "head"
    with pytest.raises(SpecjaxError, match="not of other"):
        eagle.load_head(str(tmp_path), cfg.replace(name="other"), params)
    with pytest.raises(SpecjaxError, match="holds no EAGLE head"):
        eagle.load_head(str(tmp_path / "none"), cfg, params)
    with pytest.raises(SpecjaxError, match="drafts ahead"):
        EngineSpec(model="tiny-random", drafter=DrafterSpec("eagle", k=2), policy=PolicySpec("smartspec-conf"))


@pytest.fixture(scope="module")
def hybrid_backend(tiny, head):
    """hybrid_eagle on the tiny model: suffix trees holding two earlier requests' outputs."""
    from specjax.drafters.head_hybrid import SuffixHeadDrafter
    from specjax.drafters import suffix
    from specjax.drafters.suffix import SuffixDrafter

    cfg, params = tiny
    ref = [r.tokens for r in reference_generate(cfg, params, PROMPTS[:2], max_new_tokens=MAX_NEW, batch_buckets=(1,))]
    history = [list(p) + r for p, r in zip(PROMPTS[:2], ref)]  # what earlier requests wrote
    sd = SuffixDrafter(suffix.config(2, tree=False), history=history)
    return JaxBackend(cfg, params, drafter=SuffixHeadDrafter(sd, head[0], head[1], tau=0.5), k_buckets=(0, 2),
                      batch_buckets=(B,), slots=SLOTS)


def test_suffix_with_the_head_as_fallback(tiny, hybrid_backend):
    """``hybrid_eagle``: rows whose suffix match scores above tau verify the suffix chain, the
    others the head's drafts, in the same steps; greedy outputs equal AR's (with requests joining
    and leaving), both sources drafted and the suffix drafts (from earlier outputs) were accepted,
    including in steps where no row needed the head (which then skipped its drafting) and by a
    request admitted without the head's cache. (Host drafts at T > 0 are verified with a one-hot
    q: verify_chain's host path.)"""
    cfg, params = tiny
    ref = [r.tokens for r in reference_generate(cfg, params, PROMPTS, max_new_tokens=MAX_NEW, batch_buckets=(1,))]
    be = hybrid_backend
    # (the first 3 admissions get the head's cache; "again", admitted without it, repeats an
    # earlier request's prompt: it takes suffix chains all the same)
    eng = ServingEngine(be, FixedK(2), clock=OpClock(), prefill_gate=FirstOnly(3))
    props, propose = [], be.drafter.propose
    be.drafter.propose = lambda *a, **k: props.append(propose(*a, **k)) or props[-1]
    try:
        outs = eng.run([Request(f"q{i}", p, MAX_NEW, arrival=(0.0 if i < 3 else 0.004 * i))
                        for i, p in enumerate(PROMPTS)] + [Request("again", PROMPTS[1], MAX_NEW, arrival=0.05)])
    finally:
        del be.drafter.propose
    assert [o.tokens for o in outs] == ref + [ref[1]]
    assert outs[-1].accepted > 0  # no head cache, suffix drafts accepted
    # each row's draft class names its source, so that SmartSpec learns their acceptance apart
    assert {c for p in props for c in p.draft_classes} == {"suffix", "head"}
    # and a suffix chain is scored by its node probabilities (the head's drafts by their class)
    scored = [(sc, n, c) for p in props if p.draft_scores is not None
              for sc, n, c in zip(p.draft_scores, p.draft_lens, p.draft_classes)]
    assert scored and all((sc is not None) == (c == "suffix") for sc, _, c in scored)
    for sc, n, _ in (x for x in scored if x[0] is not None):
        assert len(sc) == n and np.all(sc > 0) and np.all(sc <= 1) and np.all(np.diff(sc) <= 1e-12)
    assert be.drafter.used["suffix"] > 0 and be.drafter.used["head"] > 0, be.drafter.used
    assert be.drafter.head_skipped > 0  # steps with suffix chains only: the head did not draft (lax.cond)
    assert outs[0].accepted + outs[1].accepted > 0


def test_hybrid_steps_without_the_head_defer_its_catch_up(tiny, hybrid_backend):
    """A hybrid step whose rows all verify host chains runs neither the head's drafting nor its
    catch-up: the committed block goes to the head's lag window (as plain steps' tokens do), which
    fills and is caught up, and is caught up before the head next drafts. After host-only and
    head steps (chains accepted whole, in part, not at all) the tokens are AR's and the head's
    cache and feature, once settled, are a prefill's of the committed tokens."""
    cfg, params = tiny
    be, put = hybrid_backend, jax.device_put
    t = be.table
    prompt = [5, 17, 42, 9, 100]
    ref = reference_generate(cfg, params, [prompt], max_new_tokens=40, batch_buckets=(1,))[0].tokens
    samp = SamplingArrays.build([SamplingParams()], B)
    active = put(np.arange(B) == 0)
    state = prefill_row0(be, prompt, True, samp)
    out, lags = [int(state.pending[0])], []
    for kind in ("host", "host", "miss", "host", "host", "host", "host", "head", "host", "half"):
        j = len(out)  # ref[j], ref[j + 1] follow the pending token ref[j - 1]
        toks = np.full((B, 2), -1, np.int32)  # (-1: the head's rows)
        if kind != "head":
            toks[0] = {"host": [ref[j], ref[j + 1]], "half": [ref[j], (ref[j + 1] + 1) % cfg.vocab_size],
                       "miss": [(ref[j] + 1) % cfg.vocab_size, ref[j + 1]]}[kind]
        state, o = t.step(B, 2, SLOTS, True)(be.params, be.dparams, state, put(toks), put(np.full(B, 2, np.int32)),
                                             active, samp, None, None)
        out += [int(x) for x in o.tokens[0, :int(o.n_accepted[0]) + 1]]
        lags.append(int(state.dcache.lag[0]))
    assert out == ref[:len(out)]
    assert lags[7] == 0 and lags[-1] > 0 and max(lags) > 3  # (deferred, caught up by the head's step, again)
    assert len([x for x, y in zip(lags, lags[1:]) if y < x]) >= 2  # a full window was caught up, then the head's
    L = int(state.cache.lengths[0])
    got, want = jax.jit(t.draft.settle)(be.dparams, state.dcache), prefill_row0(be, (prompt + out)[:L], True,
                                                                                 samp, 32).dcache
    assert int(got.lengths[0]) == int(want.lengths[0]) == L
    np.testing.assert_allclose(got.k[:, 0, :, :L], want.k[:, 0, :, :L], atol=1e-5)
    np.testing.assert_allclose(got.feat[0], want.feat[0], atol=1e-5)


TREE = (2, 2)  # dynamic trees: 2 nodes kept per depth, 2 depths (4 drafted nodes)


@pytest.fixture(scope="module")
def tree_backend(tiny, head):
    from specjax.drafters.device import DeviceTreeDrafter

    cfg, params = tiny
    draft = dataclasses.replace(head[0], lag_window=2, tree_width=TREE[0], tree_depth=TREE[1])
    return JaxBackend(cfg, params, drafter=DeviceTreeDrafter(draft, head[1]), k_buckets=(0, 2, 4),
                      batch_buckets=(B,), slots=SLOTS)


def test_dynamic_tree_nodes_are_the_heads_best_children(tiny, head):
    """EAGLE-2's tree: parents come first and every node's token is among its parent's top-width
    choices of the head drafting along the node's path (the chain feed: pending token, then the
    path, each with the head's own last output as feature); siblings differ; the most likely
    node is node 1 and the nodes come best first."""
    cfg, params = tiny
    draft, dparams = head
    draft = dataclasses.replace(draft, tree_width=3, tree_depth=3)
    B1, L = 2, 7
    dc = draft.init_cache(B1, SLOTS, jnp.float32)
    rng = np.random.default_rng(4)
    dc = dataclasses.replace(dc, feat=jnp.asarray(rng.standard_normal((B1, cfg.hidden_size)), jnp.float32))
    pending, lengths = jnp.asarray([7, 99], jnp.int32), jnp.full((B1,), L, jnp.int32)
    toks, parents = jax.jit(draft.draft_tree, static_argnums=4)(dparams, dc, pending, lengths, 6)
    toks, parents = np.asarray(toks), np.asarray(parents)
    def feed(dp, c, tok, feat):  # (the head's N logits on the target's vocabulary)
        lg, c = draft._feed(dp, c, tok, feat)
        return draft._full(dp, lg), c

    feed = jax.jit(feed)
    for b in range(B1):
        assert parents[b, 0] == -1 and all(0 <= parents[b, i] < i for i in range(1, 7))
        logp = {}
        for i in range(1, 7):
            path = []
            j = i
            while j > 0:
                path.append(int(toks[b, j]))
                j = int(parents[b, j])
            path = path[::-1]
            lg, c = feed(dparams, kv_set(dc, lengths), pending, dc.feat)
            total = 0.0
            for t in path[:-1]:
                total += float(jax.nn.log_softmax(lg[b])[t])
                lg, c = feed(dparams, c, jnp.full((B1,), t, jnp.int32), c.feat)
            top = np.argsort(-np.asarray(lg[b]))[:3]
            assert path[-1] in top, (b, i, path, top)
            logp[i] = total + float(jax.nn.log_softmax(lg[b])[path[-1]])
        kids = {}
        for i in range(1, 7):
            kids.setdefault(int(parents[b, i]), []).append(int(toks[b, i]))
        assert all(len(set(v)) == len(v) for v in kids.values())
        # best first: node m's path is at most as likely as node m - 1's, so the first m nodes
        # are the m-node tree (what SmartSpec's node budget and TreeNodeRates rely on)
        assert all(logp[i] <= logp[i - 1] + 1e-5 for i in range(2, 7)), logp


def kv_set(dc, lengths):
    from specjax import cache as kv

    return kv.set_lengths(dc, lengths)


def test_dynamic_trees_lossless_with_joins_leaves_and_plain_calls(tree_backend, tiny):
    """The head's dynamic trees (node budget 2, plain decode calls between: the tree step settles
    the deferred window first; Medusa's test runs budget 4 on the same step). The drafter learnt
    its nodes' acceptance from the steps' accepted paths (SmartSpec's node-budget scores)."""
    drafter, got = tree_backend.drafter, []
    drafter.rates.clear()
    drafter.tree_verified = lambda rows: (got.extend(rows), type(drafter).tree_verified(drafter, rows))
    try:
        serves_as_ar(tiny, tree_backend, [Alternating()], 4)
    finally:
        del drafter.tree_verified
    # each verified row: its node count, and the accepted nodes' numbers, increasing along the path
    assert got and all(1 <= d <= 4 and all(a < b <= d for a, b in zip([0, *p], p)) for d, p in got)
    assert len(drafter.rates._rates) == 4 and all(len(r) for r in drafter.rates._rates)
    # the simulator's head trees: those paths, and the tree's draft forwards (its depth, any budget)
    from specjax.simulate.backend import tree_paths_of
    prof = tree_paths_of([drafter])
    assert prof["tree_nodes"] == 4 and prof["tree_forwards"] == TREE[1] and prof["tree_paths"]


@dataclasses.dataclass(frozen=True)
class OracleTree(eagle.EagleDraft):
    """A head whose tree tokens are given (params "oracle" [B, 5], tree 1 <- 0, 2 <- 0, 3 <- 2,
    4 <- 3): a tree step's accepted path is then known."""

    def draft_tree(self, dparams, dcache, pending, lengths, n):
        return dparams["oracle"][:, :n + 1], jnp.asarray([-1, 0, 0, 2, 3][:n + 1], jnp.int32)


def test_tree_step_catches_the_head_up_along_the_accepted_path(tiny, head):
    """Greedy tree steps whose accepted path runs through second siblings (nodes 2, 3; node 4
    wrong), between plain steps: the tokens are AR's, and the head's committed entries and
    carried feature are a prefill's of the committed tokens (its catch-up reads the target's
    features along the path, not the block's order)."""
    from specjax.drafters.device import DeviceTreeDrafter

    cfg, params = tiny
    prompt = [5, 17, 42, 9, 100]
    ref = reference_generate(cfg, params, [prompt], max_new_tokens=20, batch_buckets=(1,))[0].tokens
    base = dataclasses.replace(head[0], lag_window=2, tree_width=2, tree_depth=2)
    draft = OracleTree(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})
    oracle = np.zeros((B, 5), np.int32)
    be = JaxBackend(cfg, params, drafter=DeviceTreeDrafter(draft, {**head[1], "oracle": oracle}),
                    k_buckets=(0, 4), batch_buckets=(B,), slots=SLOTS)
    t, put = be.table, jax.device_put
    samp = SamplingArrays.build([SamplingParams()], B)

    def prefill(tokens):
        return prefill_row0(be, tokens, True, samp, 32)

    state = prefill(prompt)
    out = [int(state.pending[0])]
    parents, valid = (put(a) for a in (np.zeros((B, 5), np.int32), np.broadcast_to(np.arange(5) > 0, (B, 5))))
    active = put(np.arange(B) == 0)
    for kind in ("tree", "plain", "tree", "plain", "plain", "plain", "tree"):
        if kind == "plain":
            state, o = t.step(B, 0, SLOTS, True)(be.params, be.dparams, state, put(np.zeros((B, 1), np.int32)),
                                                 put(np.zeros(B, np.int32)), active, samp, None, None)
            out.append(int(o.tokens[0, 0]))
            continue
        j = len(out)  # ref[j], ref[j + 1] follow the pending token ref[j - 1]
        oracle[0] = [0, (ref[j] + 1) % cfg.vocab_size, ref[j], ref[j + 1], (ref[j + 2] + 1) % cfg.vocab_size]
        state, o = t.tree_step(B, 4, SLOTS, True)(be.params, {**be.dparams, "oracle": put(oracle)}, state,
                                                  put(np.zeros((B, 5), np.int32)), parents, valid, active, samp, None)
        assert int(o.n_accepted[0]) == 2 and list(np.asarray(o.path[0])) == [2, 3, 0, 0]  # the accepted nodes
        assert list(np.asarray(o.host)[0, 5:]) == [2, 3, 0, 0, 2, 4]  # what the host reads: path | n | drafted
        out += [int(x) for x in o.tokens[0, :3]]
    assert out == ref[:len(out)]
    L = int(state.cache.lengths[0])
    got, want = jax.jit(t.draft.settle)(be.dparams, state.dcache), prefill((prompt + out)[:L]).dcache
    assert int(got.lengths[0]) == int(want.lengths[0]) == L
    np.testing.assert_allclose(got.k[:, 0, :, :L], want.k[:, 0, :, :L], atol=1e-5)
    np.testing.assert_allclose(got.feat[0], want.feat[0], atol=1e-5)


def test_sampled_dynamic_tree_emits_the_targets_distribution(tiny):
    """At T = 0.6 the first token a dynamic-tree step emits after a fixed context (an accepted
    first-depth node or the correction drawn from the residual) follows the target's own
    distribution there: a chi-square test over 1,200 draws (distinct deterministic siblings,
    verified with a one-hot q). The head's vocabulary is the target's 3 likeliest tokens there,
    so its first-depth nodes are often accepted and often rejected."""
    from scipy.stats import chisquare

    from specjax.drafters.device import DeviceTreeDrafter

    cfg, params = tiny
    put = jax.device_put
    prompt, fixed, T, R = [5, 17, 42, 9, 100], 33, 0.6, 300
    ctx = jnp.asarray([prompt + [fixed]], jnp.int32)
    lg = llama.forward(params, ctx, jnp.arange(6, dtype=jnp.int32)[None], llama.init_cache_for(cfg, 1, 8),
                       llama.causal_mask(1, 6), cfg=cfg, use_prefix=False)[0][0, -1]
    p = np.asarray(jax.nn.softmax(lg.astype(jnp.float32) / T), np.float64)
    draft, dparams = eagle.init_params(cfg, params, np.sort(np.argsort(-p)[:3]), seed=2)
    tree_backend = JaxBackend(cfg, params, drafter=DeviceTreeDrafter(dataclasses.replace(
        draft, tree_width=2, tree_depth=2), dparams), k_buckets=(0, 4), batch_buckets=(B,), slots=SLOTS)
    t = tree_backend.table
    toks = np.zeros((B, 16), np.int32)
    toks[:, :5] = prompt
    n_valid = put(np.full(B, 5, np.int32))
    parents, valid = put(np.zeros((B, 5), np.int32)), put(np.broadcast_to(np.arange(5) > 0, (B, 5)))
    counts, accepted = np.zeros(cfg.vocab_size), 0
    for it in range(R):
        samp = SamplingArrays.build([SamplingParams(temperature=T, seed=1000 + it * B + b) for b in range(B)], B)
        state = t.prefill(B, 16, SLOTS, False, True)(tree_backend.params, tree_backend.dparams, put(toks), n_valid,
                                                     samp)
        state = dataclasses.replace(state, pending=jnp.full((B,), fixed, jnp.int32))
        state, o = t.tree_step(B, 4, SLOTS, False)(tree_backend.params, tree_backend.dparams, state,
                                                   put(np.zeros((B, 5), np.int32)), parents, valid,
                                                   put(np.ones(B, bool)), samp, None)
        counts += np.bincount(np.asarray(o.tokens[:, 0]), minlength=cfg.vocab_size)
        accepted += int(np.asarray(o.n_accepted).sum())
    assert 0.2 * R * B < accepted  # (the head's first-depth nodes were accepted at times, and not always)
    exp = p / p.sum() * counts.sum()  # (float32 sums to 1 within 1e-7; scipy wants the totals equal)
    big = exp >= 5
    obs_cells = np.append(counts[big], counts[~big].sum())
    exp_cells = np.append(exp[big], exp[~big].sum())
    assert chisquare(obs_cells, exp_cells).pvalue > 0.01


def _shipped_tree(kind, model):
    """The shipped head of ``kind`` drafting its tree: EAGLE-2 dynamic trees of width 3 and depth
    3, or the Medusa heads' saved static tree."""
    from specjax.drafters import medusa
    from specjax.drafters.device import DeviceTreeDrafter

    if kind == "medusa":
        return medusa.build(model)
    draft, dparams = eagle.load_head(eagle.shipped_head(model.cfg), model.cfg, model.params)
    return DeviceTreeDrafter(dataclasses.replace(draft, tree_width=3, tree_depth=3), dparams)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_trained_heads_sampled_tree_emits_the_targets_distribution(kind):
    """The shipped, trained heads on the embedded SmolLM2 (real weights), drafting 6-node trees
    at T = 1: the first token a tree step emits after a chat prompt and one greedy step follows
    the target's own distribution there (chi-square over 1,600 draws), with the heads'
    first-depth nodes accepted in a good share of the draws."""
    from scipy.stats import chisquare

    from specjax.models.loader import load_model

    model = load_model("smollm2-135m", dtype="float32")
    cfg, params = model.cfg, model.params
    be = JaxBackend(cfg, params, drafter=_shipped_tree(kind, model), k_buckets=(0, 6), batch_buckets=(B,),
                    slots=SLOTS)
    put, t, T, R = jax.device_put, be.table, 1.0, 400
    prompt = model.tokenizer.encode_chat("Write one sentence about the sea.")
    C = -(-len(prompt) // 16) * 16
    toks = np.zeros((B, C), np.int32)
    toks[:, :len(prompt)] = prompt
    greedy = SamplingArrays.build([SamplingParams()] * B, B)
    state = t.prefill(B, C, SLOTS, True, True)(be.params, be.dparams, put(toks), put(np.full(B, len(prompt), np.int32)),
                                               greedy)
    parents, valid = put(np.zeros((B, 7), np.int32)), put(np.broadcast_to(np.arange(7) > 0, (B, 7)))
    # greedy tree steps until one accepts a node: the sampled steps start from the state before it,
    # a context whose next token the heads draft well
    seq, step_greedy = prompt + [int(state.pending[0])], t.tree_step(B, 6, SLOTS, True)
    for _ in range(8):
        before = jax.tree_util.tree_map(jnp.copy, state)  # (the step donates its state)
        state, o = step_greedy(be.params, be.dparams, state, put(np.zeros((B, 7), np.int32)), parents, valid,
                               put(np.ones(B, bool)), greedy, None)
        n = int(o.n_accepted[0])
        if n:
            break
        seq += [int(x) for x in o.tokens[0, :n + 1]]
    assert n, "no greedy step of the first 8 accepted a node"
    state, ctx = before, jnp.asarray([seq], jnp.int32)
    L = ctx.shape[1]
    lg = llama.forward(params, ctx, jnp.arange(L, dtype=jnp.int32)[None], llama.init_cache_for(cfg, 1, L),
                       llama.causal_mask(1, L), cfg=cfg, use_prefix=False)[0][0, -1]
    p = np.asarray(jax.nn.softmax(lg.astype(jnp.float32) / T), np.float64)
    p /= p.sum()  # (float32 sums to 1 within 1e-7; the test's expected counts must sum to the draws)
    step = t.tree_step(B, 6, SLOTS, False)
    counts, accepted = np.zeros(cfg.vocab_size), 0
    for it in range(R):  # the same state each time (a copy: the step donates it), other seeds
        samp = SamplingArrays.build([SamplingParams(temperature=T, seed=7000 + it * B + b) for b in range(B)], B)
        _, o = step(be.params, be.dparams, jax.tree_util.tree_map(jnp.copy, state), put(np.zeros((B, 7), np.int32)),
                    parents, valid, put(np.ones(B, bool)), samp, None)
        counts += np.bincount(np.asarray(o.tokens[:, 0]), minlength=cfg.vocab_size)
        accepted += int((np.asarray(o.n_accepted) > 0).sum())
    assert 0.1 * R * B < accepted < R * B  # a first-depth node of the trained head accepted often, not always
    exp = p * counts.sum()
    big = exp >= 5
    obs_cells, exp_cells = np.append(counts[big], counts[~big].sum()), np.append(exp[big], exp[~big].sum())
    res = chisquare(obs_cells, exp_cells)
    print(f"trained {kind} head, T = {T}: a first-depth node accepted in {accepted}/{R * B} draws; chi-square over "
          f"{len(obs_cells)} cells p = {res.pvalue:.3f}")
    assert res.pvalue > 0.01


def _block_logits(cfg, draft, dparams, n: int = 6):
    """A head's reduced logits on a fixed block of ``n`` random tokens and features (an empty cache)."""
    toks = jnp.asarray(np.random.default_rng(0).integers(1, 255, (1, n)), jnp.int32)
    feat = jnp.asarray(np.random.default_rng(1).standard_normal((1, n, cfg.hidden_size)), jnp.float32)
    h, _ = draft._forward(dparams, draft.init_cache(1, 16, jnp.float32), toks, feat,
                          jnp.arange(n, dtype=jnp.int32)[None], llama.causal_mask(1, n))
    return np.asarray(draft._reduced(dparams, h))


# how a trained head grows: (the new head's setting, the grown head's new arrays that must be zero
# (name, index), the arrays it keeps whole or in part (name, index), the one-line errors of growing
# back and of a bad setting)
GROWTHS = {
    "a wider MLP": (dict(mlp_width=256), [("layer", "w_down", np.s_[128:])], [("layer", "w_gate", np.s_[:, :128])],
                    "cannot grow", dict(mlp_width=100), "multiple of 32"),
    "a second layer": (dict(layers=2), [("upper", "wo", np.s_[:]), ("upper", "w_down", np.s_[:])],
                       [("layer", "wq", np.s_[:])], "fewer layers", dict(layers=0), "1 to 8 layers"),
}


@pytest.mark.parametrize("growth", list(GROWTHS))
def test_a_grown_head_computes_the_trained_function_saves_and_serves_losslessly(tiny, head, tmp_path, growth):
    """``--eagle_mlp_width`` / ``--eagle_layers``: ``eagle.grow`` puts a trained head in a head of
    a wider MLP (the new down rows zero) or with a layer on top that passes its input through
    (its ``wo`` and ``w_down`` zero), computing the same function; growing back and a bad setting
    are one-line errors; the grown head saves and loads with its settings (a file of before the
    settings is a head of the target's width and one layer); its serving copies (bfloat16, the
    engine's mode on an AVX512_BF16 CPU) compute its XLA function; and a head whose new arrays
    are trained (here: drawn) drafts chains and trees whose output is plain decoding's."""
    from specjax.drafters.device import DeviceTreeDrafter

    cfg, params = tiny
    draft, dparams = head
    settings, zero, kept, shrink, bad, bad_message = GROWTHS[growth]
    big, fresh = eagle.init_params(cfg, params, VOCAB_IDS, seed=4, **settings)
    assert big.cfg.num_layers == big.layers and big.init_cache(1, 16, jnp.float32).k.shape[0] == big.layers
    grown = {**fresh, **eagle.grow(heads.trainable_of(big, fresh), heads.trainable_of(draft, dparams))}
    for part, name, at in zero:
        assert not np.any(np.asarray(grown[part][name])[at]) and np.any(np.asarray(fresh[part][name])[at])
    for part, name, at in kept:
        np.testing.assert_array_equal(np.asarray(grown[part][name])[at], dparams[part][name])
    np.testing.assert_allclose(_block_logits(cfg, big, grown), _block_logits(cfg, draft, dparams),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(SpecjaxError, match=shrink):
        eagle.grow(heads.trainable_of(draft, dparams), heads.trainable_of(big, fresh))
    with pytest.raises(SpecjaxError, match=bad_message):
        eagle.init_params(cfg, params, VOCAB_IDS, **bad)

    eagle.save_head(str(tmp_path / "big"), cfg, fresh, big)
    d, p = eagle.load_head(str(tmp_path / "big"), cfg, params)
    assert d == big and all(eagle.read_spec(str(tmp_path / "big"), cfg)[k] == v for k, v in settings.items())
    for a, b in zip(jax.tree_util.tree_leaves(heads.trainable_of(d, p)), jax.tree_util.tree_leaves(
            heads.trainable_of(big, fresh))):
        np.testing.assert_array_equal(a, b)
    assert heads.settings_of(eagle.KIND, {}, cfg) == {"mlp_width": 0, "layers": 1}

    served_draft = dataclasses.replace(d, fwd=eagle.copies_forward("bfloat16"))
    served = eagle.for_rows_kernel(p, "bfloat16")
    assert (eagle.UPPER_ROWS in served) == (d.layers > 1)
    ref = _block_logits(cfg, d, {k: v for k, v in served.items() if not k.endswith(llama.ROWS_SUFFIX)})
    np.testing.assert_allclose(_block_logits(cfg, served_draft, served), ref, rtol=3e-2,
                               atol=3e-2 * np.abs(ref).max())
    serves_at_batch_1_and_8(tiny, eagle.EagleDrafter(served_draft, served), 2)
    serves_at_batch_1_and_8(tiny, DeviceTreeDrafter(dataclasses.replace(d, tree_width=2, tree_depth=2), p), 4)
