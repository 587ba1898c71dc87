"""Distillation (specjax.distill): the divergences and their gradients against direct float64
numpy computations (so a swapped KL direction or a forgotten temperature fails here), the
top-k teacher's stated truncation, and the optax train step on a layer-skip self-draft."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from specjax.distill import divergences as dv
from specjax.distill import train as _train
from specjax.errors import SpecjaxError

T = 1.7  # a temperature != 1: forgetting it changes every value below


# train.sequence_logits jitted: one compilation per shape instead of op-by-op dispatch
seq_logits = jax.jit(_train.sequence_logits, static_argnums=0)


def _np_probs(z, t):
    z = np.asarray(z, np.float64) / t
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _np_kl(a, b):
    return np.sum(np.where(a > 0, a * (np.log(np.where(a > 0, a, 1)) - np.log(b)), 0), -1)


def _np_divergence(name, p_logits, q_logits, t, beta=0.3):
    p, q = _np_probs(p_logits, t), _np_probs(q_logits, t)
    if name == "fkl":
        return _np_kl(p, q)
    if name == "rkl":
        return _np_kl(q, p)
    if name == "jsd":
        m = beta * p + (1 - beta) * q
        return beta * _np_kl(p, m) + (1 - beta) * _np_kl(q, m)
    return 0.5 * np.abs(p - q).sum(-1)


@pytest.fixture(scope="module")
def logits():
    rng = np.random.default_rng(0)
    return rng.standard_normal((3, 5, 11)) * 2, rng.standard_normal((3, 5, 11)) * 2


@pytest.mark.parametrize("name", dv.DIVERGENCES)
def test_divergences_and_gradients_equal_numpy(logits, name):
    p_logits, q_logits = logits
    got = np.asarray(dv.divergence(name, jnp.asarray(p_logits, jnp.float32), jnp.asarray(q_logits, jnp.float32),
                                   temperature=T, beta=0.3))
    np.testing.assert_allclose(got, _np_divergence(name, p_logits, q_logits, T), rtol=2e-5, atol=2e-6)
    # d/d(draft logits) of the summed divergence, against float64 central differences
    f = jax.grad(lambda q: jnp.sum(dv.divergence(name, jnp.asarray(p_logits, jnp.float32), q, temperature=T,
                                                 beta=0.3)))
    g = np.asarray(f(jnp.asarray(q_logits, jnp.float32)))
    eps, num = 1e-5, np.zeros_like(q_logits)
    for idx in np.ndindex(q_logits.shape):
        hi, lo = q_logits.copy(), q_logits.copy()
        hi[idx] += eps
        lo[idx] -= eps
        num[idx] = (_np_divergence(name, p_logits, hi, T).sum() - _np_divergence(name, p_logits, lo, T).sum()) / (2 * eps)
    np.testing.assert_allclose(g, num, rtol=1e-3, atol=2e-5)


def test_direction_and_temperature_are_not_interchangeable(logits):
    """The reference test above would catch either mistake; this states why: on these inputs
    KL(p || q) and KL(q || p) differ, and so do the values at temperature 1 and at T."""
    p, q = (jnp.asarray(a, jnp.float32) for a in logits)
    assert not np.allclose(dv.forward_kl(p, q, T), dv.reverse_kl(p, q, T), rtol=1e-2)
    assert not np.allclose(dv.forward_kl(p, q, T), dv.forward_kl(p, q, 1.0), rtol=1e-2)
    # forward KL's gradient in the draft's logits is (q - p) / T
    g = jax.grad(lambda z: jnp.sum(dv.forward_kl(p, z, T)))(q)
    np.testing.assert_allclose(g, (_np_probs(logits[1], T) - _np_probs(logits[0], T)) / T, atol=1e-6)
    # 1 - TV is the acceptance probability of speculative sampling: sum over tokens of min(p, q)
    pp, qq = _np_probs(logits[0], T), _np_probs(logits[1], T)
    np.testing.assert_allclose(1 - np.asarray(dv.tvd(p, q, T)), np.minimum(pp, qq).sum(-1), atol=1e-6)
    for b in (0.0, 1.0):  # the mixture is one of the two: nothing to diverge from
        np.testing.assert_allclose(dv.jsd(p, q, b, T), 0.0, atol=1e-7)


def test_topk_teacher_states_its_truncation(logits):
    p_logits, q_logits = (jnp.asarray(a, jnp.float32) for a in logits)
    full = dv.TopK.of(p_logits, p_logits.shape[-1])  # every token kept: the full divergences
    np.testing.assert_allclose(dv.divergence("fkl", full, q_logits, temperature=T),
                               dv.forward_kl(p_logits, q_logits, T), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dv.divergence("tvd", full, q_logits, temperature=T),
                               dv.tvd(p_logits, q_logits, T), rtol=1e-5, atol=1e-6)
    k = 3
    top = dv.TopK.of(p_logits, k)
    ids = np.argsort(-np.asarray(logits[0]), -1)[..., :k]
    pk = _np_probs(np.take_along_axis(logits[0], ids, -1), T)  # renormalised over the k kept
    qf = _np_probs(logits[1], T)
    qk = np.take_along_axis(qf, ids, -1)
    np.testing.assert_allclose(dv.divergence("fkl", top, q_logits, temperature=T), _np_kl(pk, qk), rtol=2e-5)
    np.testing.assert_allclose(dv.divergence("tvd", top, q_logits, temperature=T),
                               0.5 * (np.abs(pk - qk).sum(-1) + 1 - qk.sum(-1)), rtol=2e-5, atol=1e-6)
    for name in ("rkl", "jsd"):
        with pytest.raises(SpecjaxError, match="whole distribution"):
            dv.divergence(name, top, q_logits)
    with pytest.raises(SpecjaxError, match="unknown divergence"):
        dv.divergence("kl", p_logits, q_logits)
    with pytest.raises(SpecjaxError, match="temperature"):
        dv.forward_kl(p_logits, q_logits, 0.0)


def test_self_draft_distillation_raises_acceptance_and_stays_lossless(tiny):
    """A 1-layer self-draft of the tiny model, trained with forward KL on sequences the target
    wrote (teacher sampling): the loss falls, the draft's greedy acceptance on those prompts rises,
    and speculation with the trained draft still gives exactly the target's greedy tokens. A
    NaN batch is dropped whole: params and optimizer state unchanged, ``ok`` false."""
    from specjax.distill import train as tr
    from specjax.generate import Generator
    from specjax.spec_generate import SpecGenerator, SpecStats

    cfg, params = tiny
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 250, 6)] for _ in range(8)]
    gen = Generator(cfg, params, batch_buckets=(8,))
    outs = [r.tokens for r in gen.generate(prompts, max_new_tokens=24, ignore_eos=True)]
    tokens = jnp.asarray([p + o for p, o in zip(prompts, outs)], jnp.int32)  # [8, 30]
    teacher = seq_logits(cfg, params, tokens)
    mask = jnp.broadcast_to(jnp.arange(tokens.shape[1]) >= len(prompts[0]) - 1, tokens.shape)  # predict the outputs

    sd = tr.TrainableDraft.of(cfg, params, 1)
    tc = tr.TrainConfig(lr=3e-3, warmup_steps=5, total_steps=80)
    opt = tr.make_optimizer(tc)
    trainable, state = sd.trainable, opt.init(sd.trainable)

    spec = SpecGenerator(cfg, params, draft=sd.draft, draft_params=sd.params(trainable), k_buckets=(0, 4),
                         batch_buckets=(8,), slot_buckets=(64,))

    def acceptance():
        stats = SpecStats()
        res = spec.generate(prompts, max_new_tokens=24, num_spec_tokens=4, ignore_eos=True, stats=stats)
        assert [r.tokens for r in res] == outs  # lossless with any draft params
        return stats.acceptance_rate

    before = acceptance()
    n_exe = len(spec.backend(64).table)
    losses = []
    for _ in range(60):
        trainable, state, loss, ok = tr.train_step(trainable, state, sd.frozen, tokens, teacher, mask, cfg=sd.draft.cfg,
                                                   tc=tc, optimizer=opt)
        assert bool(ok)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0], losses[::10]
    # the trained params swap into the running generator: same shapes, nothing recompiles
    spec.swap_draft_params(sd.params(trainable))
    after = acceptance()
    assert after >= before + 0.15, (before, after)
    assert len(spec.backend(64).table) == n_exe
    wrong = sd.params(trainable) | {"final_norm": jnp.ones(cfg.hidden_size + 1)}
    with pytest.raises(SpecjaxError, match=r"do not match the compiled ones at \['final_norm'\]"):
        spec.swap_draft_params(wrong)
    with pytest.raises(SpecjaxError, match="no device draft"):
        gen.swap_draft_params(sd.params(trainable))
    # the target's own arrays were never written
    np.testing.assert_array_equal(params["layers"][0]["wq"], tiny[1]["layers"][0]["wq"])

    bad = teacher.at[0, 10, 5].set(jnp.nan)  # one NaN logit at a trained position
    t2, s2, loss, ok = tr.train_step(trainable, state, sd.frozen, tokens, bad, mask, cfg=sd.draft.cfg, tc=tc, optimizer=opt)
    assert not bool(ok) and not np.isfinite(float(loss))
    for a, b in zip(jax.tree_util.tree_leaves((t2, s2)), jax.tree_util.tree_leaves((trainable, state))):
        np.testing.assert_array_equal(a, b)


def test_a_draft_swap_makes_the_policy_forget_the_old_acceptance():
    from specjax.goodput.acceptance import AcceptanceEstimator

    acc = AcceptanceEstimator(window=8, prior_alpha=0.5, per_request=True)
    for _ in range(6):
        acc.observe([4, 4], [0, 0], 4, request_ids=["a", "b"])  # an old draft nobody accepts
    assert acc.alpha.value < 0.1 and acc._req
    acc.clear()
    assert acc.alpha.value == 0.5 and not acc._req and len(acc.alpha) == 0


def test_checkpoints_restore_exactly_and_refuse_other_drafts_and_damage(tiny, tmp_path, caplog):
    import logging
    import shutil

    from specjax.distill import train as tr
    from specjax.distill.checkpoint import DistillCheckpoints, fingerprint

    cfg, params = tiny
    sd = tr.TrainableDraft.of(cfg, params, 1)
    tc = tr.TrainConfig(total_steps=20)
    opt = tr.make_optimizer(tc)
    trainable, state = sd.trainable, opt.init(sd.trainable)
    tokens = jnp.asarray(np.random.default_rng(1).integers(3, 250, (2, 12)), jnp.int32)
    teacher = seq_logits(cfg, params, tokens)
    mask = jnp.ones(tokens.shape, bool)
    fp = fingerprint(cfg, sd.draft.cfg, trainable)
    ck = DistillCheckpoints(str(tmp_path / "ck"), fp, max_to_keep=2)
    assert ck.restore(trainable, state) is None  # nothing yet
    saved = {}
    for i in range(1, 4):
        trainable, state, _, _ = tr.train_step(trainable, state, sd.frozen, tokens, teacher, mask, cfg=sd.draft.cfg,
                                               tc=tc, optimizer=opt)
        ck.save(i, trainable, state, {"requests_seen": 10 * i, "buffer": {"records": i}})
        saved[i] = (trainable, state)
    assert ck.latest_step() == 3 and sorted(ck.mgr.all_steps()) == [2, 3]  # the last two kept
    assert ck.latest_recorded() == 3
    # restore into fresh templates (a new process after a kill starts from the initial draft)
    fresh = tr.TrainableDraft.of(cfg, params, 1)
    step, t2, s2, record = DistillCheckpoints(str(tmp_path / "ck"), fp).restore(fresh.trainable,
                                                                               opt.init(fresh.trainable))
    assert step == 3 and record == {"requests_seen": 30, "buffer": {"records": 3}}
    for a, b in zip(jax.tree_util.tree_leaves((t2, s2)), jax.tree_util.tree_leaves((trainable, state))):
        np.testing.assert_array_equal(a, b)
    # another draft's checkpoint: a one-line error before any state is read
    other = tr.TrainableDraft.of(cfg, params, 2)
    ck2 = DistillCheckpoints(str(tmp_path / "ck"), fingerprint(cfg, other.draft.cfg, other.trainable))
    with pytest.raises(SpecjaxError, match="belongs to another draft"):
        ck2.restore(other.trainable, opt.init(other.trainable))
    # a damaged newest checkpoint (one flipped byte of its largest file): logged once, never
    # loaded; the one before it is restored exactly
    big = max((p for p in (tmp_path / "ck" / "3").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(big.read_bytes())
    data[len(data) // 2] ^= 0x40
    big.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        step, t2, s2, record = ck.restore(fresh.trainable, opt.init(fresh.trainable))
    assert step == 2 and record == {"requests_seen": 20, "buffer": {"records": 2}}
    for a, b in zip(jax.tree_util.tree_leaves((t2, s2)), jax.tree_util.tree_leaves(saved[2])):
        np.testing.assert_array_equal(a, b)
    assert [r.getMessage() for r in caplog.records if "ck/3" in r.getMessage()] == [
        f"ignoring {tmp_path / 'ck' / '3'}: it does not match the size and hash recorded when it was written "
        "(damaged or incomplete)"]
    with pytest.raises(SpecjaxError, match="damaged or incomplete") as e:  # asked for by number: an error
        ck.restore(trainable, state, step=3)
    assert "\n" not in str(e.value)
    # every checkpoint damaged: a fresh start, said once
    shutil.rmtree(tmp_path / "ck" / "2" / "state")
    assert ck.restore(trainable, state) is None
    assert "no intact checkpoint" in caplog.text
    # a save in the background is recorded by the first poll after it has finished (the online
    # distiller polls per request), and only then restored
    ck.save(4, trainable, state, {"requests_seen": 40, "buffer": {"records": 4}}, wait=False)
    ck.mgr.wait_until_finished()
    assert (tmp_path / "ck" / "4").is_dir() and not (tmp_path / "ck" / "4.sha256").exists()
    ck.poll()
    assert (tmp_path / "ck" / "4.sha256").exists()
    assert ck.restore(fresh.trainable, opt.init(fresh.trainable))[0] == 4




def test_the_teacher_signal_comes_from_verification(tiny):
    """A serving backend with teacher_topk keeps, for every output token a step produced, the
    target's top-k logits there: the same as a plain forward over the finished sequence gives at
    the position that predicted it. Outputs stay exact, and the rejected drafts' output indices
    are recorded."""
    from specjax.distill import train as tr
    from specjax.drafters.device import layer_skip
    from specjax.engine.jax_backend import JaxBackend
    from specjax.engine.loop import EventClock, ServingEngine
    from specjax.engine.scheduler import Request
    from specjax.goodput.selector import FixedK
    from specjax.reference_ar import reference_generate

    cfg, params = tiny
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(3, 250, n)] for n in (5, 9, 7)]
    want = [r.tokens for r in reference_generate(cfg, params, prompts, max_new_tokens=14, ignore_eos=True)]
    d, dparams = layer_skip(cfg, params, 1)
    k = 4
    be = JaxBackend(cfg, params, draft=d, draft_params=dparams, k_buckets=(0, 3), batch_buckets=(4,), slots=64,
                    teacher_topk=k)
    outs = ServingEngine(be, FixedK(3), clock=EventClock()).run(
        [Request(f"r{i}", p, 14, ignore_eos=True) for i, p in enumerate(prompts)])
    rejected = 0
    for p, o, w in zip(prompts, outs, want):
        assert o.tokens == w
        ids, logits = np.concatenate(o.teacher_ids), np.concatenate(o.teacher_logits)
        assert o.teacher_from == 1 and len(ids) == len(o.tokens) - 1 and ids.shape[1] == k  # 8 k bytes a token
        full = np.asarray(seq_logits(cfg, params, jnp.asarray([p + o.tokens], jnp.int32)))[0]
        at = full[len(p):len(p) + len(o.tokens) - 1]  # the positions that predicted outputs 1..n-1
        top = np.argsort(-at, axis=-1)[:, :k]
        np.testing.assert_array_equal(ids, top)
        np.testing.assert_allclose(logits, np.take_along_axis(at, top, -1), rtol=1e-4, atol=1e-4)
        assert all(1 <= i < len(o.tokens) for i in o.rejected_at)
        rejected += len(o.rejected_at)
    assert rejected > 0  # a 1-layer draft of a random model is often wrong
    with pytest.raises(SpecjaxError, match="token trees"):
        from specjax.drafters.suffix import SuffixConfig, SuffixDrafter

        JaxBackend(cfg, params, drafter=SuffixDrafter(SuffixConfig()), k_buckets=(0, 4), teacher_topk=4)


def test_online_distillation_while_serving(tiny, tmp_path):
    """Algorithm 1 on the tiny model: a stream of requests through the serving engine with a
    1-layer self-draft; every 4 finished requests the draft trains on the buffer of teacher rows
    the steps kept and swaps in. Acceptance over the last requests is well above the first ones,
    every output is exact, an update with a NaN is dropped whole, and a new distiller resumes
    from the checkpoint where this one stopped."""
    from specjax.distill import train as tr
    from specjax.distill.checkpoint import DistillCheckpoints, fingerprint
    from specjax.distill.online import OnlineConfig, OnlineDistiller, acceptance_curve
    from specjax.engine.jax_backend import JaxBackend
    from specjax.engine.loop import EventClock, ServingEngine
    from specjax.engine.scheduler import Request
    from specjax.goodput.selector import FixedK
    from specjax.reference_ar import reference_generate

    cfg, params = tiny
    rng = np.random.default_rng(5)
    family = [[int(t) for t in rng.integers(3, 250, 6)] for _ in range(6)]
    want = {tuple(p): r.tokens for p, r in zip(family, reference_generate(cfg, params, family, max_new_tokens=16,
                                                                          ignore_eos=True))}
    sd = tr.TrainableDraft.of(cfg, params, 1)
    be = JaxBackend(cfg, params, draft=sd.draft, draft_params=sd.params(sd.trainable), k_buckets=(0, 3),
                    batch_buckets=(4,), slots=64, teacher_topk=8)
    pol = FixedK(3)
    ck = DistillCheckpoints(str(tmp_path / "ck"), fingerprint(cfg, sd.draft.cfg, sd.trainable))
    od = OnlineDistiller(be, pol, sd, tr.TrainConfig(lr=3e-3, warmup_steps=2, total_steps=200),
                         OnlineConfig(every=4, steps=6, batch=8, length=32, checkpoint_every=3), checkpoints=ck)
    reqs = [Request(f"q{i}", family[i % 6], 16, arrival=0.0, ignore_eos=True) for i in range(48)]
    od.expect(reqs)
    finished = []
    eng = ServingEngine(be, pol, clock=EventClock(), on_finish=lambda o: (finished.append(o), od.on_finish(o)))
    outs = eng.run(reqs)
    for r, o in zip(reqs, outs):
        assert o.tokens == want[tuple(r.prompt)], o.id
    assert od.updates == 12 and od.dropped == 0 and od.buffer.added == 48
    curve = acceptance_curve(finished, window=8)
    assert curve[-1] >= curve[7] + 0.15, (curve[7], curve[-1])
    assert od.losses[-1] < od.losses[0]
    # an update that meets a NaN is dropped whole: the serving draft stays the very same arrays
    serving = be.dparams
    orig = od.buffer.batch
    od.buffer.batch = lambda *a: (lambda t, i, lg, m: (t, i, np.full_like(lg, np.nan), m))(*orig(*a))
    assert od.update() is False and od.dropped == 1 and be.dparams is serving
    od.buffer.batch = orig
    # resume in a fresh distiller (a restarted process): the checkpointed draft swaps in
    ck.wait()  # (periodic checkpoints are written in the background)
    assert ck.latest_step() == 4  # a checkpoint every 3 updates, numbered from 1
    # a kill between orbax finishing step 5 and its record: the step a restart restores, and the
    # one reported as saved, stays 4
    ck.save(5, od.trainable, od.opt_state, od.record(), wait=False)
    ck.mgr.wait_until_finished()
    ck._unrecorded.clear()
    assert ck.latest_step() == 5 and od.save() == 4
    sd2 = tr.TrainableDraft.of(cfg, params, 1)
    be2 = JaxBackend(cfg, params, draft=sd2.draft, draft_params=sd2.params(sd2.trainable), k_buckets=(0, 3),
                     batch_buckets=(4,), slots=64, teacher_topk=8)
    od2 = OnlineDistiller(be2, FixedK(3), sd2, od.tc, od.oc, checkpoints=DistillCheckpoints(str(tmp_path / "ck"), ck.fp))
    assert od2.resume() == 4 and od2.updates == 12 and od2.finished == 48
    for a, b in zip(jax.tree_util.tree_leaves(be2.dparams), jax.tree_util.tree_leaves(sd.params(od.trainable))):
        np.testing.assert_array_equal(a, b)


def test_reduced_vocab_head_maps_to_target_ids_and_refuses_bad_maps(tiny):
    """frequent_tokens keeps the most frequent ids (and the ones it must keep); a reduced head is
    the target head's columns for them; ids that do not map onto the target's vocabulary, repeated
    ids, or params without the map are one-line errors."""
    from specjax.distill import train as tr
    from specjax.drafters.device import frequent_tokens, layer_skip, reduced_vocab
    from specjax.engine.jax_backend import JaxBackend

    cfg, params = tiny
    ids = frequent_tokens([[5, 5, 5, 9, 9, 7], [9, 200]], cfg.vocab_size, 3, keep=[2])
    np.testing.assert_array_equal(ids, [2, 5, 9])  # 9 x3, 5 x3 (ties: lower id first), 2 kept; 7 and 200 cut
    d, dparams = layer_skip(cfg, params, 1)
    rd, rp = reduced_vocab(d, dparams, np.array([3, 17, 250]))
    assert rd.vocab == 3 and rd.label == "layer_skip1_v3" and rp["lm_head"].shape == (cfg.hidden_size, 3)
    np.testing.assert_array_equal(rp["lm_head"], np.asarray(params["lm_head"])[:, [3, 17, 250]])
    for bad, msg in (([3, 256], "map onto the target's 256 tokens"), ([3, 3], "distinct"),
                     ([[1, 2]], "1-D list"), ([-1], "map onto")):
        with pytest.raises(SpecjaxError, match=msg) as e:
            reduced_vocab(d, dparams, np.array(bad))
        assert "\n" not in str(e.value)
    with pytest.raises(SpecjaxError, match="need vocab_ids"):
        JaxBackend(cfg, params, draft=rd, draft_params={k: v for k, v in rp.items() if k != "vocab_ids"},
                   k_buckets=(0, 2))
    with pytest.raises(SpecjaxError, match="1..256 tokens"):
        frequent_tokens([[1]], cfg.vocab_size, 0)
    sd = tr.TrainableDraft.of(cfg, params, 1, vocab_ids=ids)
    assert set(sd.frozen) == {"embed", "lm_head", "vocab_ids"} and sd.draft.vocab == 3


def _chi_square_p(cells: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value of observed cell indices against exact cell probabilities
    (expected counts below 5 pooled); a sample in a zero-probability cell fails at once."""
    from scipy.stats import chi2

    n = len(cells)
    obs = np.bincount(cells, minlength=len(probs)).astype(float)
    assert obs[probs == 0].sum() == 0, "samples where the target has probability 0"
    exp = probs * n
    big = exp >= 5
    o, e = list(obs[big]), list(exp[big])
    small = (probs > 0) & ~big
    if small.any():
        o.append(obs[small].sum())
        e.append(exp[small].sum())
    o, e = np.asarray(o), np.asarray(e)
    assert len(o) >= 10, "too few cells for a meaningful test"
    return float(chi2.sf(((o - e) ** 2 / e).sum(), len(o) - 1))


def test_trained_reduced_vocab_draft_stays_lossless(tiny):
    """A self-draft with a reduced head (64 of 256 tokens) trained a few steps: greedy
    speculation returns the target's own tokens, and sampled speculation (temperature 1.3,
    top-k 6) draws output tokens 2 and 3, which both pass through verification with K = 3, from
    the target's exact joint distribution (chi-square), though the draft can propose only a
    quarter of the vocabulary and its own distribution is far from the target's (the same test
    rejects it)."""
    from specjax.distill import train as tr
    from specjax.drafters.device import frequent_tokens
    from specjax.generate import Generator
    from specjax.sampling import SamplingParams
    from specjax.spec_generate import SpecGenerator

    cfg, params = tiny
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(3, 250, 6)] for _ in range(8)]
    outs = [r.tokens for r in Generator(cfg, params, batch_buckets=(8,)).generate(prompts, max_new_tokens=24,
                                                                                   ignore_eos=True)]
    vocab = frequent_tokens(outs, cfg.vocab_size, 64)
    sd = tr.TrainableDraft.of(cfg, params, 1, vocab_ids=vocab)
    tokens = jnp.asarray([p + o for p, o in zip(prompts, outs)], jnp.int32)
    teacher = dv.TopK.of(seq_logits(cfg, params, tokens), 8)
    mask = jnp.broadcast_to(jnp.arange(tokens.shape[1]) >= 5, tokens.shape)
    tc = tr.TrainConfig(lr=3e-3, warmup_steps=2, total_steps=40)
    opt = tr.make_optimizer(tc)
    trainable, state = sd.trainable, opt.init(sd.trainable)
    for _ in range(10):
        trainable, state, loss, ok = tr.train_step(trainable, state, sd.frozen, tokens, teacher, mask,
                                                   cfg=sd.draft.cfg, tc=tc, optimizer=opt)
        assert bool(ok) and np.isfinite(float(loss))
    spec = SpecGenerator(cfg, params, draft=sd.draft, draft_params=sd.params(trainable), k_buckets=(0, 3),
                         batch_buckets=(8, 64), slot_buckets=(64,))
    res = spec.generate(prompts, max_new_tokens=24, num_spec_tokens=3, ignore_eos=True)
    assert [r.tokens for r in res] == outs

    # the exact joint of output tokens 2 and 3 under the warped target, summed over token 1
    prompt, T, k = prompts[0], 1.3, 6

    def warped(seq):
        z = np.asarray(seq_logits(cfg, params, jnp.asarray([seq], jnp.int32)))[0, -1] / T
        p = np.zeros_like(z, np.float64)
        top = np.argsort(-z)[:k]
        p[top] = np.exp(z[top] - z[top].max())
        return p / p.sum()

    V = cfg.vocab_size
    joint = np.zeros((V, V))
    p1 = warped(prompt)
    for a in np.flatnonzero(p1):
        p2 = warped(prompt + [int(a)])
        for b in np.flatnonzero(p2):
            joint[b] += p1[a] * p2[b] * warped(prompt + [int(a), int(b)])
    joint = joint.reshape(-1)
    n = 2048
    got = spec.generate([prompt] * n, [SamplingParams(temperature=T, top_k=k, seed=s) for s in range(n)],
                        max_new_tokens=3, num_spec_tokens=3, ignore_eos=True)
    cells = np.array([r.tokens[1] * V + r.tokens[2] for r in got])
    assert _chi_square_p(cells, joint) > 1e-3
    # the draft's own joint of tokens 2, 3 (the same sum with q for those two): the test tells them apart
    dparams = sd.params(trainable)

    def warped_q(seq):
        z = np.full(V, -np.inf)
        z[vocab] = np.asarray(seq_logits(sd.draft.cfg, dparams, jnp.asarray([seq], jnp.int32)))[0, -1] / T
        p = np.zeros(V)
        top = np.argsort(-z)[:k]
        p[top] = np.exp(z[top] - z[top].max())
        return p / p.sum()

    qjoint = np.zeros((V, V))
    for a in np.flatnonzero(p1):
        q2 = warped_q(prompt + [int(a)])
        for b in np.flatnonzero(q2):
            qjoint[b] += p1[a] * q2[b] * warped_q(prompt + [int(a), int(b)])
    qcells = np.array([int(x) for x in rng.choice(V * V, n, p=qjoint.reshape(-1) / qjoint.sum())])
    with pytest.raises(AssertionError):
        assert _chi_square_p(qcells, joint) > 1e-3


def test_distillation_data_by_teacher_student_and_mixed_sampling(tiny):
    """Teacher sampling at temperature 0 writes the target's greedy text, student sampling the
    draft's, and both keep the target's top-k at every output position; the mixture picks the
    argmax of beta p + (1 - beta) q; a sequence stops at an end-of-sequence id."""
    from specjax.distill import data as dd
    from specjax.distill import train as tr
    from specjax.drafters.device import layer_skip
    from specjax.reference_ar import reference_generate

    cfg, params = tiny
    rng = np.random.default_rng(11)
    prompts = [[int(t) for t in rng.integers(3, 250, n)] for n in (4, 9, 6)]
    d, dparams = layer_skip(cfg, params, 1)
    # batch 2 throughout (3 prompts: a full batch and a padded one), so every call shares its shapes
    teach = dd.sample_records(cfg, params, d, dparams, prompts, max_new_tokens=10, mode="teacher", temperature=0,
                              topk=4, batch=2)
    want = [r.tokens for r in reference_generate(cfg, params, prompts, max_new_tokens=10, ignore_eos=True)]
    stud = dd.sample_records(cfg, params, d, dparams, prompts, max_new_tokens=10, mode="student", temperature=0,
                             topk=4, batch=2)
    dwant = [r.tokens for r in reference_generate(d.cfg, dparams, prompts, max_new_tokens=10, ignore_eos=True)]
    assert want != dwant  # the two writers differ, so each check below tells them apart
    recs = [rec for t, s in zip(teach, stud) for rec in (t, s)]
    padded = np.full((len(recs), max(len(r.tokens) for r in recs)), 3, np.int32)  # (causal: padding is harmless)
    for i, rec in enumerate(recs):
        padded[i, :len(rec.tokens)] = rec.tokens
    full = np.asarray(seq_logits(cfg, params, jnp.asarray(padded)))  # one forward for every record
    for i, (p, t, w, s, dw) in enumerate(zip(prompts, teach, want, stud, dwant)):
        assert list(t.tokens) == p + w and list(s.tokens) == p + dw
        for j, rec in enumerate((t, s)):  # the target's top 4 where each output token was predicted
            at = full[2 * i + j][rec.positions]
            np.testing.assert_array_equal(rec.ids, np.argsort(-at, -1)[:, :4])
            np.testing.assert_allclose(rec.logits, np.take_along_axis(at, rec.ids, -1), rtol=1e-4, atol=1e-4)
    mixed = dd.sample_records(cfg, params, d, dparams, prompts[:1], max_new_tokens=1, mode="mixed", beta=0.3,
                              temperature=0, batch=2)[0]
    P = len(prompts[0])
    lp = jax.nn.softmax(seq_logits(cfg, params, jnp.asarray([prompts[0]]))[0, -1])
    lq = jax.nn.softmax(seq_logits(d.cfg, dparams, jnp.asarray([prompts[0]]))[0, -1])
    assert int(mixed.tokens[P]) == int(jnp.argmax(0.3 * lp + 0.7 * lq))
    cut = dd.sample_records(cfg, params, d, dparams, prompts[:1], max_new_tokens=10, mode="teacher", temperature=0,
                            eos_ids=[want[0][3]], batch=2)[0]
    assert list(cut.tokens) == prompts[0] + want[0][:want[0].index(want[0][3]) + 1] and cut.rows == len(cut.tokens) - P
    with pytest.raises(SpecjaxError, match="teacher, student or mixed"):
        dd.sample_records(cfg, params, d, dparams, prompts, max_new_tokens=4, mode="both")


def test_warm_up_distillation_script_then_the_batch_job_trains_on(tiny, tmp_path):
    """launch/distill.py on the tiny model: the held-out acceptance rises, the draft and a plot
    are written; the batch job's --online_distill on that directory starts from it (the
    reduced head included); a second warm-up into the same directory is a one-line error."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    inp, ck = tmp_path / "p.jsonl", tmp_path / "ck"
    inp.write_text("".join(json.dumps({"prompt": f"row {i % 7} " + "ab" * (i % 3)}) + "\n" for i in range(40)))
    args = [sys.executable, os.path.join(root, "launch", "distill.py"), "--model", "tiny-random", "--input_jsonl",
            str(inp), "--checkpoint_dir", str(ck), "--draft_layers", "1", "--max_new_tokens", "24", "--eval_prompts",
            "8", "--steps", "30", "--distill_lr", "3e-3", "--draft_vocab", "64", "--sampling", "mixed",
            "--plot", str(tmp_path / "d.png")]
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    before = float(r.stderr.split("acceptance before training: ")[1].split()[0])
    after = float(r.stderr.strip().split("held-out acceptance ")[-1].split()[0])
    assert after >= before + 0.05, r.stderr[-2000:]
    assert (tmp_path / "d.png").stat().st_size > 0 and json.loads((ck / "draft.json").read_text())["vocab_ids"]
    out = tmp_path / "out.jsonl"
    r = subprocess.run([sys.executable, os.path.join(root, "launch", "batch.py"), "--input_jsonl", str(inp),
                        "--output_jsonl", str(out), "--model", "tiny-random", "--batch_buckets", "2",
                        "--k_buckets", "0,2", "--num_spec_tokens", "2", "--slots", "128", "--max_new_tokens", "8",
                        "--drafter", "layer_skip", "--draft_layers", "1", "--online_distill", str(ck),
                        "--distill_every", "8"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "online distillation of layer_skip1_v64" in r.stderr and "resumed from checkpoint 1 (0 updates" in r.stderr
    assert "5 updates" in r.stderr and len(out.read_text().splitlines()) == 40
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == \
        f"error: {ck} already holds a draft; give a new --checkpoint_dir"


def test_opportunistic_updates_run_only_at_light_load(tiny):
    """idle_rows: an update runs between engine steps once enough new records are in, but only
    while at most idle_rows rows run and nothing waits: a burst of requests gets none until its
    queue has drained; requests arriving one at a time get them as they go."""
    from specjax.distill import train as tr
    from specjax.distill.online import OnlineConfig, OnlineDistiller
    from specjax.engine.jax_backend import JaxBackend
    from specjax.engine.loop import EventClock, ServingEngine
    from specjax.engine.scheduler import Request
    from specjax.goodput.selector import FixedK

    cfg, params = tiny
    rng = np.random.default_rng(2)
    sd = tr.TrainableDraft.of(cfg, params, 1)
    be = JaxBackend(cfg, params, draft=sd.draft, draft_params=sd.params(sd.trainable), k_buckets=(0, 2),
                    batch_buckets=(4,), slots=64, teacher_topk=4)
    for spacing in (0.0, 10.0):
        pol = FixedK(2)
        od = OnlineDistiller(be, pol, sd, tr.TrainConfig(total_steps=100),
                             OnlineConfig(every=1000, steps=1, batch=2, length=16, idle_rows=1, idle_min_new=2))
        loads = []

        def on_step(eng, od=od, loads=loads):
            before = od.idle_updates
            od.on_step(eng)
            if od.idle_updates > before:
                loads.append((eng.load(), od.finished))

        reqs = [Request(f"s{i}", [int(t) for t in rng.integers(3, 250, 5)], 12, arrival=i * spacing, ignore_eos=True)
                for i in range(12)]
        od.expect(reqs)
        ServingEngine(be, pol, clock=EventClock(), on_finish=od.on_finish, on_step=on_step).run(reqs)
        assert od.updates == od.idle_updates == len(loads) and all(r <= 1 and w == 0 for (r, w), _ in loads), loads
        if spacing:
            assert od.updates >= 4, loads  # one every two requests or so
        else:
            # 12 at once on 4 rows: only the last ones run alone
            assert loads and all(done >= 8 for _, done in loads), loads


def test_several_drafts_routed_by_tag_or_classifier(tiny, tmp_path):
    """Two prompt families (disjoint token ranges), interleaved: the centroid router separates
    them without labels, and after a few labelled ones; with a draft per family on one backend
    (MultiDraft: a batch runs one draft, the engine switches between batches) every output is
    the target's, each draft trains on its own family only, and a restart restores both drafts
    and the router from their checkpoints."""
    from specjax.distill import train as tr
    from specjax.distill.checkpoint import DistillCheckpoints, fingerprint
    from specjax.distill.online import OnlineConfig, OnlineDistiller
    from specjax.distill.routing import CentroidRouter, MultiDraft, TagRouter
    from specjax.engine.jax_backend import JaxBackend
    from specjax.engine.loop import EventClock, ServingEngine
    from specjax.engine.scheduler import Request
    from specjax.goodput.selector import FixedK
    from specjax.reference_ar import reference_generate

    cfg, params = tiny
    rng = np.random.default_rng(4)
    words = [rng.choice(np.arange(lo, lo + 100), 12, replace=False) for lo in (3, 140)]  # each family's own
    fams = [[[int(t) for t in rng.choice(w, 8)] for _ in range(4)] for w in words]
    stream = [(i % 2, fams[i % 2][(i // 2) % 4]) for i in range(24)]
    unsup, sup = CentroidRouter(2), CentroidRouter(2, tags=["a", "b"])
    got_u = [unsup.route(p) for _, p in stream]
    assert got_u == [f for f, _ in stream] or got_u == [1 - f for f, _ in stream]
    got_s = [sup.route(p, "ab"[f] if i < 4 else None) for i, (f, p) in enumerate(stream)]
    assert got_s == [f for f, _ in stream]

    want = {tuple(p): r.tokens for p, r in zip(fams[0] + fams[1], reference_generate(
        cfg, params, fams[0] + fams[1], max_new_tokens=12, ignore_eos=True))}
    sd0 = tr.TrainableDraft.of(cfg, params, 1)
    be = JaxBackend(cfg, params, draft=sd0.draft, draft_params=sd0.params(sd0.trainable), k_buckets=(0, 2),
                    batch_buckets=(2,), slots=64, teacher_topk=4)

    def multi(router):
        ds = []
        for g in range(2):
            sd = tr.TrainableDraft.of(cfg, params, 1)
            ck = DistillCheckpoints(str(tmp_path / f"d{g}"), fingerprint(cfg, sd.draft.cfg, sd.trainable))
            ds.append(OnlineDistiller(be, FixedK(2), sd, tr.TrainConfig(lr=3e-3, warmup_steps=1, total_steps=100),
                                      OnlineConfig(every=2, steps=2, batch=4, length=24, checkpoint_every=1),
                                      checkpoints=ck))
        return MultiDraft(router, ds)

    md = multi(TagRouter(["a", "b"]))
    reqs = [Request(f"t{i}", p, 12, ignore_eos=True, tag="ab"[f]) for i, (f, p) in enumerate(stream)]
    md.expect(reqs)
    mixed = []

    def on_step(e):  # every running batch is one draft's, the backend's live one
        mixed.extend(r.req.id for r in e.sched.running if md.of[r.req.id] != md.active)
        md.on_step(e)

    eng = ServingEngine(be, md.distillers[0].policy, clock=EventClock(), drafts=md, on_finish=md.on_finish,
                        on_step=on_step)
    outs = eng.run(reqs)
    assert not mixed
    assert [o.tokens for o in outs] == [want[tuple(r.prompt)] for r in reqs]
    for g, d in enumerate(md.distillers):
        assert d.buffer.added == 12 and d.updates == 6
        assert all(np.all((r.tokens[:8] >= 3 + 137 * g) & (r.tokens[:8] < 103 + 137 * g)) for r in d.buffer.records)
    assert sum(d.serving for d in md.distillers) == 1
    assert md.save() == [6, 6]  # (waits for the checkpoints written in the background)
    md2 = multi(TagRouter(["a", "b"]))
    assert md2.resume() == [6, 6]
    for a, b in zip(jax.tree_util.tree_leaves(md2.distillers[1].trainable),
                    jax.tree_util.tree_leaves(md.distillers[1].trainable)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(SpecjaxError, match="router"):
        multi(TagRouter(["x", "y"])).resume()


def test_an_independent_draft_model_trains_and_serves_from_its_checkpoint(tiny, tmp_path):
    """An independent 2-layer draft model (other random weights, the target's vocabulary) trains
    toward the target like a self-draft: its acceptance rises, speculation stays exact, and the
    trained params come back from its checkpoint directory to serve with (load_draft), which
    refuses to be read as a self-draft's."""
    import types

    from specjax.distill import train as tr
    from specjax.distill.checkpoint import load_draft, open_draft
    from specjax.generate import Generator
    from specjax.spec_generate import SpecGenerator, SpecStats

    cfg, params = tiny
    dcfg = cfg.replace(name="tiny-draft", num_layers=2)
    dm = types.SimpleNamespace(cfg=dcfg, params=llama_init(dcfg))
    td, ck = open_draft(str(tmp_path / "ck"), cfg, params, draft_model=dm)
    assert td.draft.cfg.name == "tiny-draft" and set(td.frozen) == {"embed", "lm_head"}
    rng = np.random.default_rng(8)
    prompts = [[int(t) for t in rng.integers(3, 250, 6)] for _ in range(8)]
    outs = [r.tokens for r in Generator(cfg, params, batch_buckets=(8,)).generate(prompts, max_new_tokens=24,
                                                                                   ignore_eos=True)]
    tokens = jnp.asarray([p + o for p, o in zip(prompts, outs)], jnp.int32)
    teacher = dv.TopK.of(seq_logits(cfg, params, tokens), 8)
    mask = jnp.broadcast_to(jnp.arange(tokens.shape[1]) >= 5, tokens.shape)
    tc = tr.TrainConfig(lr=3e-3, warmup_steps=5, total_steps=80)
    opt = tr.make_optimizer(tc)
    trainable, state = td.trainable, opt.init(td.trainable)
    spec = SpecGenerator(cfg, params, draft=td.draft, draft_params=td.params(trainable), k_buckets=(0, 3),
                         batch_buckets=(8,), slot_buckets=(64,))

    def acceptance():
        stats = SpecStats()
        assert [r.tokens for r in spec.generate(prompts, max_new_tokens=24, num_spec_tokens=3, ignore_eos=True,
                                                stats=stats)] == outs
        return stats.acceptance_rate

    before = acceptance()
    for _ in range(50):
        trainable, state, loss, ok = tr.train_step(trainable, state, td.frozen, tokens, teacher, mask,
                                                   cfg=td.draft.cfg, tc=tc, optimizer=opt)
        assert bool(ok)
    spec.swap_draft_params(td.params(trainable))
    assert acceptance() >= before + 0.15
    ck.save(1, trainable, state, {"finished": 0, "updates": 0, "dropped": 0})
    td2, served = load_draft(str(tmp_path / "ck"), cfg, params, draft_model=dm)
    for a, b in zip(jax.tree_util.tree_leaves(served), jax.tree_util.tree_leaves(trainable)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(SpecjaxError, match="trains the draft model tiny-draft, not a self-draft"):
        load_draft(str(tmp_path / "ck"), cfg, params)


def llama_init(cfg, seed=1):
    from specjax.models import llama

    return llama.init_random_params(cfg, seed=seed)
