"""Medusa heads (drafters.medusa, issue 30 part 3): the carried hidden state after any mix of
steps is the one a prefill of what was committed gives, greedy serving is token-identical to
the autoregressive reference with requests joining and leaving and plain decode calls between
verify steps, sampling is reproducible and verifies with the heads' real draft distributions,
heads save and load (and are refused for another target), and training lowers the loss."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import registry
from specjax.distill import eagle_train as et
from specjax.distill import medusa_train as mt
from specjax.distill import train as tr
from specjax.drafters import heads, medusa
from specjax.drafters.device import DeviceTreeDrafter, FeatureHeadDrafter
from specjax.engine.jax_backend import JaxBackend
from specjax.engine.loop import ServingEngine
from specjax.engine.scheduler import Request
from specjax.errors import SpecjaxError
from specjax.goodput import FixedK
from specjax.reference_ar import reference_generate
from specjax.sampling import SamplingArrays, SamplingParams
from tests.test_eagle import PROMPTS, Alternating, prefill_row0, serves_as_ar, serves_at_batch_1_and_8

SLOTS = 64
MAX_NEW = 12
B = 4
VOCAB_IDS = np.arange(0, 256, 2)


@pytest.fixture(scope="module")
def head(tiny):
    cfg, params = tiny
    return medusa.init_params(cfg, params, VOCAB_IDS, heads=3, scale=0.5, seed=1)


@pytest.fixture(scope="module")
def backend(tiny, head):
    cfg, params = tiny
    return JaxBackend(cfg, params, drafter=FeatureHeadDrafter(*head), k_buckets=(0, 2), batch_buckets=(B,),
                      slots=SLOTS)


@pytest.mark.parametrize("greedy,steps", [(False, (2, 2, 0, 2)), (True, (0, 2, 0, 0))])
def test_carried_hidden_state_is_a_prefills_of_what_was_committed(backend, greedy, steps):
    """After a prefill and chain steps (K = 2, drafts accepted and rejected: sampled at a high
    temperature; and plain K = 0 steps), row 0's carried state is the target's last hidden state
    at its last committed position, as a prefill of its committed tokens gives it."""
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
        state, o = t.step(B, K, SLOTS, greedy)(backend.params, backend.dparams, state,
                                               put(np.zeros((B, max(K, 1)), np.int32)), put(np.full(B, K, np.int32)),
                                               active, samp, None, None)
        n = int(o.n_accepted[0])
        accepted += n
        out += [int(x) for x in o.tokens[0, :n + 1]]
    L = int(state.cache.lengths[0])
    assert L == len(prompt) + len(out) - 1 and (greedy or accepted > 0)
    want = prefill((prompt + out)[:L]).dcache
    assert int(state.dcache.lengths[0]) == int(want.lengths[0]) == L
    np.testing.assert_allclose(state.dcache.feat[0], want.feat[0], atol=1e-5)


def test_greedy_token_identical_to_ar_with_joins_leaves_and_plain_calls(tiny, backend):
    """Chains: K = 2 steps, alone and alternating with decode calls of plain steps."""
    serves_as_ar(tiny, backend, [FixedK(2), Alternating()])


@pytest.fixture(scope="module")
def tree_backend(tiny, head):
    cfg, params = tiny
    draft = dataclasses.replace(head[0], tree=medusa.best_tree(medusa.prior_accuracy(3, 2), 4))
    return JaxBackend(cfg, params, drafter=DeviceTreeDrafter(draft, head[1]), k_buckets=(0, 2, 4),
                      batch_buckets=(B,), slots=SLOTS)


def test_best_tree_is_best_first_and_a_tree_at_every_prefix():
    acc = np.array([[0.6, 0.2], [0.5, 0.1], [0.3, 0.1]])
    t = medusa.best_tree(acc, 6)
    # node values (products along the path): .6, then .3 (head 1 under node 1), .2, .1 (head 1
    # under node 3), .09 (head 2 under node 2), .06
    assert t == ((0, 0), (1, 0), (0, 1), (3, 0), (2, 0), (1, 1))
    parents = [p for p, _ in t]
    assert all(p <= i for i, p in enumerate(parents))  # parents first: every prefix is a tree


def test_tree_mode_lossless_with_joins_leaves_and_plain_calls(tiny, tree_backend):
    """Token trees from the heads (node budgets 2 and 4, rows cut to fewer nodes by the policy's
    caps too, plain decode calls between)."""
    serves_as_ar(tiny, tree_backend, [FixedK(4), Alternating()], 4)


def test_chains_and_trees_at_batch_1_and_8(tiny, head):
    """8 requests at once and 1 alone in their own batch buckets (the tests above run 1 to 3 in
    a 4-row state), chains then trees."""
    serves_at_batch_1_and_8(tiny, FeatureHeadDrafter(*head), 2)
    draft = dataclasses.replace(head[0], tree=medusa.best_tree(medusa.prior_accuracy(3, 2), 4))
    serves_at_batch_1_and_8(tiny, DeviceTreeDrafter(draft, head[1]), 4)


@dataclasses.dataclass(frozen=True)
class OracleTree(medusa.MedusaDraft):
    """Heads whose tree tokens are given (params "oracle" [B, N]): a tree step's accepted path is
    then known."""

    def draft_tree(self, dparams, dcache, pending, lengths, n):
        return dparams["oracle"][:, :n + 1], jnp.asarray(self.tree_parents(n))


def test_tree_step_keeps_the_last_accepted_nodes_hidden_state(tiny, head):
    """Greedy tree steps whose accepted path runs through second siblings (nodes 2 and 3 of the
    tree 1 <- 0, 2 <- 0, 3 <- 2, 4 <- 3, with node 4 wrong): the tokens are AR's and the carried
    hidden state is the last accepted node's, the one a prefill of the committed tokens gives."""
    cfg, params = tiny
    prompt = [5, 17, 42, 9, 100]
    ref = reference_generate(cfg, params, [prompt], max_new_tokens=16, batch_buckets=(1,))[0].tokens
    draft = OracleTree(**{f.name: getattr(head[0], f.name) for f in dataclasses.fields(head[0])})
    draft = dataclasses.replace(draft, tree=((0, 0), (0, 1), (2, 0), (3, 0)))
    oracle = np.zeros((B, 5), np.int32)
    be = JaxBackend(cfg, params, drafter=DeviceTreeDrafter(draft, {**head[1], "oracle": oracle}),
                    k_buckets=(0, 4), batch_buckets=(B,), slots=SLOTS)
    t, put = be.table, jax.device_put
    samp = SamplingArrays.build([SamplingParams()], B)

    def prefill(tokens):
        return prefill_row0(be, tokens, True, samp)

    state, out = prefill(prompt), []
    out.append(int(state.pending[0]))
    parents = np.broadcast_to(draft.tree_parents(4), (B, 5)).copy()
    valid = np.broadcast_to(np.arange(5) > 0, (B, 5)).copy()
    for _ in range(3):
        j = len(out)  # ref[j], ref[j + 1] follow the pending token ref[j - 1]
        oracle[0] = [0, (ref[j] + 1) % cfg.vocab_size, ref[j], ref[j + 1], (ref[j + 2] + 1) % cfg.vocab_size]
        state, o = t.tree_step(B, 4, SLOTS, True)(be.params, {**be.dparams, "oracle": put(oracle)}, state,
                                                  put(np.zeros((B, 5), np.int32)), put(parents), put(valid),
                                                  put(np.arange(B) == 0), samp, None)
        assert int(o.n_accepted[0]) == 2
        out += [int(x) for x in o.tokens[0, :3]]
    assert out == ref[:len(out)]
    L = int(state.cache.lengths[0])
    want = prefill((prompt + out)[:L]).dcache
    assert L == len(prompt) + len(out) - 1 and int(state.dcache.lengths[0]) == L
    np.testing.assert_allclose(state.dcache.feat[0], want.feat[0], atol=1e-5)


def test_sampled_reproducible_and_verified_with_the_heads_q(backend):
    """At T > 0 the same seeds give the same tokens, and drafts are accepted at the rate exact
    speculative sampling gives with the heads' q (about a half at a high temperature with half
    the vocabulary; as if q were one-hot at the draft, about 1/256)."""
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


def test_save_load_registry_and_refusals(tiny, head, tmp_path, monkeypatch):
    """Saved heads load back exactly through ``--medusa_head`` (the target's arrays not in them),
    heads of another target or an EAGLE head's folder are refused, and K buckets above what a
    step can take (the heads; a tree's nodes) are not compiled, none left being refused, as is
    such a K when the step is built all the same."""
    from specjax.drafters import eagle
    from specjax.models import prepared

    cfg, params = tiny
    draft, dparams = head
    heads.save_head(medusa.KIND, str(tmp_path / "m"), cfg, dparams, draft)
    monkeypatch.setattr(prepared, "_DIRECTORY", str(tmp_path / "store"))
    model = types.SimpleNamespace(cfg=cfg, params=params)
    chain = registry.drafter_parts(model, "medusa", k=2, medusa_head=str(tmp_path / "m"), medusa_tree=False)["drafter"]
    assert type(chain) is FeatureHeadDrafter and chain.draft == draft and chain.draft.heads == 3
    d = registry.drafter_parts(model, "medusa", k=2, medusa_head=str(tmp_path / "m"))["drafter"]
    prepared.wait()  # (a head saved without a tree drafts the prior's)
    assert isinstance(d, DeviceTreeDrafter) and d.draft.tree == medusa.best_tree(medusa.prior_accuracy(3), 16)
    for k in ("w", "b", "lm_head", "vocab_ids"):
        np.testing.assert_array_equal(d.params[k], dparams[k])
    assert d.params["embed"] is params["embed"] and set(heads.trainable_of(draft, dparams)) == {"w", "b"}
    with pytest.raises(SpecjaxError, match="not of other"):
        heads.load_head(medusa.KIND, str(tmp_path / "m"), cfg.replace(name="other"), params)
    eagle.save_head(str(tmp_path / "e"), cfg, eagle.init_params(cfg, params, VOCAB_IDS)[1])
    with pytest.raises(SpecjaxError, match="holds no Medusa head"):
        heads.load_head(medusa.KIND, str(tmp_path / "e"), cfg, params)
    assert heads.shipped_head(medusa.KIND, cfg) is None
    be = JaxBackend(cfg, params, drafter=FeatureHeadDrafter(draft, dparams), k_buckets=(0, 1, 2, 4, 8),
                    batch_buckets=(1,), slots=SLOTS)
    assert be.k_buckets == (0, 1, 2) and be.k_max == 2
    with pytest.raises(SpecjaxError, match="3 heads"):
        be.table.step(1, 4, SLOTS, True)
    small = dataclasses.replace(draft, tree=medusa.best_tree(medusa.prior_accuracy(3, 2), 5))
    assert JaxBackend(cfg, params, drafter=DeviceTreeDrafter(small, dparams), k_buckets=(0, 2, 4, 8),
                      batch_buckets=(1,), slots=SLOTS).k_buckets == (0, 2, 4)
    with pytest.raises(SpecjaxError, match="at most 3 drafts a step; --k_buckets \\[0, 4\\] has no K in 1..3"):
        JaxBackend(cfg, params, drafter=FeatureHeadDrafter(draft, dparams), k_buckets=(0, 4), batch_buckets=(1,),
                   slots=SLOTS)


def test_training_lowers_the_loss(tiny):
    """A few optimizer steps on the target's own text (its last hidden states and top-k teacher,
    the EAGLE trainer's data with Medusa's features) lower the heads' loss."""
    cfg, params = tiny
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, 255, 6)) for _ in range(4)]
    outs = [r.tokens for r in reference_generate(cfg, params, prompts, max_new_tokens=20, batch_buckets=(4,))]
    seqs = et.make_sequences(cfg, params, prompts, outs, topk=8, features=(cfg.num_layers,))
    assert seqs[0].feats.shape[1] == cfg.hidden_size
    draft, dparams = medusa.init_params(cfg, params, VOCAB_IDS, heads=3)
    trainable = heads.trainable_of(draft, dparams)
    frozen = {k: v for k, v in dparams.items() if k not in trainable}
    tc = tr.TrainConfig(lr=3e-3, warmup_steps=1, total_steps=30)
    opt = tr.make_optimizer(tc)
    state = opt.init(trainable)
    batch = et.make_batch(seqs, np.random.default_rng(1), 4, 32)
    losses = []
    for _ in range(12):
        trainable, state, loss, ok = mt.train_step(trainable, state, frozen, batch[1], batch[3], batch[4],
                                                   draft=draft, tc=tc, optimizer=opt)
        assert bool(ok)
        losses.append(float(loss))
    assert losses[-1] < 0.8 * losses[0], losses
    assert not np.allclose(np.asarray(trainable["w"]), 0)


def test_the_shipped_heads_are_the_embedded_models_and_small():
    """heads/: the embedded SmolLM2's Medusa heads are what --drafter medusa loads by default, with
    the tree their held-out accuracy made best; medusa.json names that target; the files stay
    small (bfloat16, the target's vocab rows shared, not saved)."""
    import os

    from specjax.config import get_model_config

    cfg = get_model_config("smollm2-135m")
    path = heads.shipped_head(medusa.KIND, cfg)
    assert path and os.path.basename(path) == "smollm2-135m-instruct-medusa"
    spec = heads.read_spec(medusa.KIND, path, cfg)
    assert spec["shared_head"] and spec["dtype"] == "bfloat16" and spec["heads"] == 4
    assert len(spec["tree"]) == medusa.TREE_NODES and all(0 <= p <= i for i, (p, _) in enumerate(spec["tree"]))
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)
    assert size < 4e6, size
