"""Training the EAGLE head (distill.eagle_train, issue 30 part 5): the training-time test's
unrolled logits are the ones the head computes when it drafts a chain in the engine's draft path,
and a few optimizer steps on target-written data lower the loss."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.distill import eagle_train as et
from specjax.distill.train import TrainConfig, make_optimizer
from specjax.drafters import eagle
from specjax.models import llama
from specjax.sampling import SamplingArrays, SamplingParams, probs_from_logits

VOCAB_IDS = np.arange(0, 256, 2)


def test_ttt_mask_is_the_chain_drafting_pattern():
    """Entry (j, q) sees the committed entries up to its chain's base q - j and its own chain."""
    m = et.ttt_mask(4, 2)
    assert m[:4, :4].tolist() == np.tril(np.ones((4, 4), bool)).tolist() and not m[:4, 4:].any()
    # (2, 3): base 1 -> real 0..1, (1, 2), (2, 3)
    assert np.flatnonzero(m[8 + 3]).tolist() == [0, 1, 4 + 2, 8 + 3]
    assert np.flatnonzero(m[4 + 1]).tolist() == [0, 4 + 1]


@pytest.mark.parametrize("layers", [1, 2])
def test_training_unroll_equals_chain_drafting(tiny, layers):
    """The training forward's logits at unroll steps 0..3 equal (float32) the distributions
    EagleDraft.draft computes in the step's draft path after a prefill with the target's real
    features, for the same prefix (the training sequence continues with the drafted tokens); for
    a head of one layer and of two (each layer's earlier unroll steps its own)."""
    cfg, params = tiny
    draft, dparams = eagle.init_params(cfg, params, VOCAB_IDS, seed=3, shared_head=True, layers=layers)
    feats_at = llama.feature_layers(cfg.num_layers)
    prompt = [7, 31, 200, 4, 99, 18]
    L, K = len(prompt) - 1, 4  # committed x_0..x_{L-1}, pending x_L
    samp = SamplingArrays.build([SamplingParams(temperature=1.0, seed=5)], 1)

    @jax.jit
    def drafting(dparams, F):  # the engine's prefill of the committed tokens, then the step's chain
        dc = draft.prefill(dparams, draft.init_cache(1, 32, jnp.float32), jnp.asarray([prompt[:L]]),
                           jnp.arange(L, dtype=jnp.int32)[None], llama.causal_mask(1, L), jnp.asarray([L]), True,
                           feats=F[:, :L])
        toks, qs, _ = draft.draft(dparams, dc, jnp.asarray([prompt[L - 1]]), jnp.asarray([prompt[L]]),
                                  jnp.asarray([L]), K, samp, False)
        return toks, qs

    def features(seq):  # (causal: the committed positions' features do not depend on what follows)
        return et.target_signal(params, jnp.asarray([seq]), cfg=cfg, features=feats_at, k=2)[0]

    toks, qs = drafting(dparams, features(prompt + [0] * (K - 1)))
    seq = prompt + [int(t) for t in toks[0, :K - 1]]
    F = features(seq)
    prev = jnp.concatenate([jnp.zeros_like(F[:, :1]), F[:, :-1]], axis=1)
    pos = jnp.arange(len(seq), dtype=jnp.int32)[None]
    got = jax.jit(lambda dp, t, f, p: [probs_from_logits(draft._full(dp, lg), samp)
                                       for lg in et.unrolled_logits(draft, dp, t, f, p, K - 1)]
                  )(dparams, jnp.asarray([seq]), prev, pos)
    for j in range(K):
        np.testing.assert_allclose(got[j][:, L + j], qs[:, j], atol=2e-6, err_msg=f"unroll step {j}")


def test_train_steps_lower_the_loss(tiny):
    """On sequences of the tiny model (features and top-k from one target forward each), a few
    steps of the training-time-test loss go down; a window batch masks the prompt."""
    cfg, params = tiny
    draft, dparams = eagle.init_params(cfg, params, VOCAB_IDS, seed=1)
    prompts = [[3, 9, 27, 81], [5, 25, 125], [2, 4, 8, 16, 32]]
    outs = [[int(t) for t in np.random.default_rng(i).integers(1, 255, 12)] for i in range(3)]  # (any text)
    seqs = et.make_sequences(cfg, params, prompts, outs, topk=4, batch=4, length_bucket=16)
    assert [len(s.tokens) for s in seqs] == [16, 15, 17] and seqs[1].start == 2
    trainable = eagle.trainable_of(draft, dparams)
    frozen = {k: v for k, v in dparams.items() if k not in trainable}
    tc = TrainConfig(lr=3e-3, warmup_steps=1, total_steps=20)
    opt = make_optimizer(tc)
    state = opt.init(trainable)
    tokens, prev, pos, teacher, mask = et.make_batch(seqs, np.random.default_rng(0), 3, 16)
    # windows of the last 16 positions; the loss on the positions whose next token the target wrote
    # (lengths 16, 15, 17, prompts of 4, 3, 5: 13 such positions in every window)
    assert np.asarray(mask).sum(1).tolist() == [13, 13, 13] and not np.asarray(mask)[:, :2].any()
    start = trainable
    for compute in ("float32", "bfloat16"):  # (bfloat16: mixed precision, the params float32)
        tc_c = dataclasses.replace(tc, compute_dtype=compute)
        opt = make_optimizer(tc_c)
        trainable, state, losses = start, opt.init(start), []
        for _ in range(6):
            trainable, state, loss, ok = et.train_step(trainable, state, frozen, tokens, prev, pos, teacher, mask,
                                                       draft=draft, tc=tc_c, optimizer=opt, steps=1)
            assert bool(ok)
            losses.append(float(loss))
        assert losses[-1] < 0.8 * losses[0], (compute, losses)
        assert {a.dtype for a in jax.tree_util.tree_leaves(trainable)} == {jnp.dtype(jnp.float32)}
        if compute == "float32":
            first = losses
    assert losses != first and abs(losses[0] - first[0]) < 0.02 * first[0]  # (the same loss, rounded otherwise)


def test_shared_bf16_head_saves_small_and_loads(tiny, tmp_path):
    """A head whose vocab rows are the target's saves only fc and the layer, in bfloat16, and
    loads back (in the target's dtype) with the target's rows rebuilt; the shipped-head default
    is keyed by the target (none for the tiny model: a random head)."""
    import os

    cfg, params = tiny
    draft, dparams = eagle.init_params(cfg, params, VOCAB_IDS, seed=2, shared_head=True)
    assert set(eagle.trainable_of(draft, dparams)) == {"fc", "layer"}
    eagle.save_head(str(tmp_path), cfg, dparams, draft, dtype=jnp.bfloat16)
    d2, p2 = eagle.load_head(str(tmp_path), cfg, params)
    assert d2 == draft and p2["fc"].dtype == params["embed"].dtype
    np.testing.assert_array_equal(p2["fc"], np.asarray(jnp.asarray(dparams["fc"], jnp.bfloat16), np.float32))
    np.testing.assert_array_equal(p2["lm_head"], np.asarray(params["lm_head"])[:, VOCAB_IDS])
    saved = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(tmp_path) for f in fs)
    D, F = cfg.hidden_size, cfg.intermediate_size
    assert saved < 2 * (3 * D * D + 2 * D * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + 3 * D * F) * 1.3
    assert eagle.shipped_head(cfg) is None


@pytest.mark.slow
def test_warm_up_script_trains_resumes_and_refuses_mistakes(tmp_path):
    """launch/distill.py --drafter eagle on the tiny model: tokens per verify step rise, outputs
    stay identical to AR, the head serves through --eagle_head, a second run resumes after the
    first's rounds, and user mistakes are one-line errors (exit 2)."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    inp, ck = tmp_path / "p.jsonl", tmp_path / "ck"
    inp.write_text("".join(json.dumps({"prompt": f"row {i % 7} " + "ab" * (i % 3)}) + "\n" for i in range(40)))
    args = [sys.executable, os.path.join(root, "launch", "distill.py"), "--drafter", "eagle", "--model", "tiny-random",
            "--input_jsonl", str(inp), "--checkpoint_dir", str(ck), "--max_new_tokens", "24", "--eval_prompts", "8",
            "--steps", "20", "--distill_lr", "3e-3", "--draft_vocab", "64", "--distill_length", "48"]

    def run(*extra):
        return subprocess.run(args + list(extra), capture_output=True, text=True, env=env, timeout=300)

    r = run("--rounds", "2", "--plot", str(tmp_path / "d.png"))
    assert r.returncode == 0, r.stderr[-3000:]
    before = float(r.stderr.split("per verify step before training: ")[1].split()[0])
    after = float(r.stderr.strip().split("held-out tokens per verify step ")[-1].split()[0])
    assert after >= before + 0.2 and "(8/8 identical to AR)" in r.stderr, r.stderr[-2000:]
    assert (tmp_path / "d.png").stat().st_size > 0
    assert len(json.loads((ck / "eagle.json").read_text())["vocab_ids"]) == 64
    r = run("--rounds", "3")
    assert r.returncode == 0 and "(32 sequences of earlier rounds)" in r.stderr and "round 3:" in r.stderr \
        and "round 2:" not in r.stderr, \
        r.stderr[-2000:]
    g = subprocess.run([sys.executable, os.path.join(root, "launch", "generate.py"), "--model", "tiny-random",
                        "--drafter", "eagle", "--eagle_head", str(ck), "--prompt", "row 3", "--max_new_tokens", "8"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert g.returncode == 0, g.stderr[-2000:]
    for extra, msg in [
            (("--rounds", "3"), f"{ck} has trained 3 rounds already: give a larger --rounds to go on"),
            (("--rounds", "4", "--draft_vocab", "32"), f"{ck} holds a head of 64 tokens, not --draft_vocab 32"),
            (("--sampling", "student"), "--drafter eagle trains on the target's own text: --sampling teacher"),
            (("--self_prompts", "4"), "--self_prompts writes prompts from the chat template: it needs --chat")]:
        r = run(*extra)
        assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == f"error: {msg}", r.stderr[-2000:]


def test_the_shipped_head_is_the_embedded_models_and_small():
    """heads/: the embedded SmolLM2's head is what --drafter eagle loads by default, its eagle.json
    names that target (load_head refuses it for any other), and the files stay small (bfloat16,
    the target's vocab rows shared, not saved)."""
    import os

    from specjax.config import get_model_config

    cfg = get_model_config("smollm2-135m")
    path = eagle.shipped_head(cfg)
    assert path and os.path.basename(path) == "smollm2-135m-instruct-eagle"
    spec = eagle.read_spec(path, cfg)
    assert spec["shared_head"] and spec["dtype"] == "bfloat16" and len(spec["vocab_ids"]) <= 8192
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)
    assert size < 12e6, size
    assert eagle.shipped_head(cfg.replace(name="smollm2-360m")) is None


def test_compute_dtype_is_checked_and_float32_runs_keep_their_record():
    from specjax.distill import train as tr
    from specjax.errors import SpecjaxError

    with pytest.raises(SpecjaxError, match="compute dtype"):
        tr.TrainConfig(compute_dtype="float16")
    assert "compute_dtype" not in tr.run_record(tr.TrainConfig())  # (runs recorded before the field resume)
    assert tr.run_record(tr.TrainConfig(compute_dtype="bfloat16"))["compute_dtype"] == "bfloat16"
    assert tr.default_compute_dtype() in tr.COMPUTE_DTYPES
