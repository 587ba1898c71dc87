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
