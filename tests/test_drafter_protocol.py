"""A new drafter kind needs no edit outside its module and the registry (issue 29, must-show 4).

This file is the whole diff of adding one: ``RepeatLast`` (a drafters.protocol.Drafter that
proposes each request's last token repeated, as chain-step inputs) stands for the kind's module,
and one ``registry.register_drafter`` call makes it a drafter the registry builds. Through the
registry's backend and generator builders and the serving engine it is greedy token-identical
to autoregressive decoding, and its drafts really run in verify blocks."""

from __future__ import annotations

import numpy as np
import pytest

from specjax import registry
from specjax.drafters.protocol import CHAIN, Drafter, StepInputs
from specjax.engine.loop import Proposal, ServingEngine
from specjax.engine.observers import Observer
from specjax.engine.scheduler import Request
from specjax.goodput import FixedK
from specjax.models.loader import load_model
from specjax.reference_ar import reference_generate


class RepeatLast(Drafter):
    """Proposes K copies of each request's last token (a host chain drafter in a dozen lines)."""

    def __init__(self):
        self.last: dict = {}

    def start(self, uid, prompt):
        self.last[uid] = int(prompt[-1])

    def extend(self, uid, tokens):
        self.last[uid] = int(tokens[-1])

    def finish(self, uid):
        self.last.pop(uid)

    def propose(self, be, rs, k_max, threshold=None):
        return Proposal(draft_lens=[k_max] * len(rs))

    def step_inputs(self, be, rs, k, cap):
        tokens = np.zeros((be.B, max(k, 1)), np.int32)
        num_draft = np.zeros(be.B, np.int32)
        for r in rs:
            row = be.row_of[r.uid]
            tokens[row, :cap[r.uid]] = self.last[r.uid]
            num_draft[row] = cap[r.uid]
        return StepInputs(CHAIN, k, num_draft, (tokens,))


@pytest.fixture
def repeat_last():
    registry.register_drafter(registry.DrafterEntry("repeat_last", lambda model, spec, draft=None: RepeatLast()))
    yield "repeat_last"
    del registry.DRAFTERS["repeat_last"]


def test_a_new_drafter_kind_through_the_registry_and_the_engine(repeat_last):
    model = load_model("tiny-random")
    prompts = [[5, 6, 7, 7, 7, 7], [9, 10, 11, 9, 10, 11, 9], [3, 3, 3]]
    want = [r.tokens for r in reference_generate(model.cfg, model.params, prompts, max_new_tokens=10)]
    be = registry.make_backend(model, repeat_last, k_buckets=(0, 2), batch_buckets=(1, 4), slots=64)
    be.warmup(prompt_lens=[8])
    outs = ServingEngine(be, FixedK(2)).run([Request(str(i), p, 10) for i, p in enumerate(prompts)])
    assert [o.tokens for o in outs] == want
    assert all(o.drafted == 2 * o.steps for o in outs)
    gen = registry.build_spec_generator(model, repeat_last, k=2, k_buckets=(0, 2))
    assert [r.tokens for r in gen.generate(prompts[:2], max_new_tokens=10, num_spec_tokens=2)] == want[:2]


# ---- a device kind that carries state between steps (as a feature head carries its feature):
# this class and its cache are the kind's whole module, and the fixture's one register_drafter
# call its registration; nothing in specjax/ is edited for it.

import dataclasses  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from specjax import cache as kv  # noqa: E402
from specjax.drafters.device import DeviceDrafter, ModelDraft  # noqa: E402


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LastTokenCache(kv.KVCache):
    """No KV entries of its own (zero layers); ``last`` [B]: each row's token before its pending
    one, kept up to date by every step, plain ones included."""

    last: jax.Array


@dataclasses.dataclass(frozen=True)
class LastTokenDraft(ModelDraft):
    """Drafts K copies of the row's last committed token, which it keeps on the device between
    steps (its prefill sets it, every step's committed block moves it): the engine's step hooks
    are all it implements."""

    label: str = "last_token"
    plain_upkeep = True  # plain steps move its state too
    prefill_as_layers = False

    def init_cache(self, B, slots, dtype):
        empty = jnp.zeros((0, B, 1, slots, 1), dtype)
        return LastTokenCache(k=empty, v=empty, lengths=jnp.zeros((B,), jnp.int32), last=jnp.zeros((B,), jnp.int32))

    def prefill(self, dparams, dcache, tokens, positions, mask, n_valid, first, *feats):
        last = jnp.take_along_axis(tokens, jnp.maximum(n_valid - 1, 0)[:, None], axis=1)[:, 0]
        return dataclasses.replace(kv.advance(dcache, n_valid), last=jnp.where(n_valid > 0, last, dcache.last))

    def chain_drafts(self, dparams, dcache, state, host_tokens, num_draft, active, K, samp, greedy_only):
        assert greedy_only  # (a deterministic draft's q would be one-hot; greedy is what this test serves)
        return jnp.broadcast_to(dcache.last[:, None], (dcache.last.shape[0], K)), None, dcache, None

    def after_chain(self, dparams, dcache, carry, block, feats, lengths, n_commit, active, K):
        # the last committed token of the block: the one before the new pending token
        last = jnp.take_along_axis(block, jnp.maximum(n_commit - 1, 0)[:, None], axis=1)[:, 0]
        return dataclasses.replace(kv.advance(dcache, n_commit), last=jnp.where(n_commit > 0, last, dcache.last))


@pytest.fixture
def last_token():
    registry.register_drafter(registry.DrafterEntry(
        "last_token", lambda model, spec, draft=None: DeviceDrafter(LastTokenDraft(model.cfg),
                                                                   {"embed": model.params["embed"]}), device=True))
    yield "last_token"
    del registry.DRAFTERS["last_token"]


def test_a_new_device_kind_that_carries_state_between_steps(last_token):
    """Greedy token-identical to autoregressive decoding through the registry's backend, with
    plain decode calls (its upkeep), verify steps and calls of them in one run, batch 1 and 4,
    requests joining and leaving; its drafts (the carried last token) are accepted where the text
    repeats it."""
    model = load_model("tiny-random")
    prompts = [[5, 6, 7, 7, 7, 7], [9, 10, 11, 9, 10, 11, 9], [3, 3, 3], [8, 8, 8, 8, 8]]
    want = [r.tokens for r in reference_generate(model.cfg, model.params, prompts, max_new_tokens=12)]
    be = registry.make_backend(model, last_token, k_buckets=(0, 2), batch_buckets=(1, 4), slots=64)
    be.warmup(prompt_lens=[8])

    class Alternate(FixedK):  # a verify step, a call of verify steps, a call of plain ones, in turn
        def choose(self, view):
            self.n = getattr(self, "n", 0) + 1
            k, self.call_steps = ((2, 1), (2, 3), (0, 2))[self.n % 3]
            return k

    class CheckState(Observer):  # after every iteration: the state each running row carries on the device
        checked = 0

        def between_steps(self, engine):
            last = np.asarray(be.state.dcache.last)
            for r in engine.sched.running:
                if not r.prefilling and r.out.tokens:
                    assert int(last[be.row_of[r.uid]]) == (list(r.req.prompt) + r.out.tokens)[-2], r.req.id
                    self.checked += 1

    check = CheckState()
    calls, decode = [], be.decode
    be.decode = lambda rs, n, *a: (lambda out: calls.append((a[-1], max(map(len, out[0])))) or out)(decode(rs, n, *a))
    reqs = [Request(str(i), p, 12, arrival=0.0 if i < 3 else 1e-6) for i, p in enumerate(prompts)]
    outs = ServingEngine(be, Alternate(2), observers=[check]).run(reqs)
    assert [o.tokens for o in outs] == want and check.checked > 12
    assert {k for k, steps in calls if steps > 1} == {0, 2}, calls  # (calls of several steps, K = 2's too)
    assert sum(o.accepted for o in outs) > 0
