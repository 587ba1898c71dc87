"""Online refinement of a feature head while serving (distill.head_online.HeadRefiner, issue 30
part 5): every few finished requests the head trains on them and its new params swap into the
running backend; the outputs stay the autoregressive reference's throughout (lossless while the
head changes), the served params are the trained ones, and the loss falls on a repeating stream."""

from __future__ import annotations

import numpy as np
import pytest

from specjax.distill import train as tr
from specjax.distill.head_online import HeadRefiner
from specjax.distill.online import OnlineConfig
from specjax.drafters import eagle, medusa
from specjax.drafters.device import FeatureHeadDrafter
from specjax.engine.jax_backend import JaxBackend
from specjax.engine.loop import ServingEngine
from specjax.engine.scheduler import Request
from specjax.goodput import FixedK
from specjax.reference_ar import reference_generate

VOCAB_IDS = np.arange(0, 256, 2)


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_head_refines_while_serving_losslessly(tiny, kind):
    cfg, params = tiny
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(1, 255, size=8)] for _ in range(4)] * 3  # a stream that repeats
    ref = [r.tokens for r in reference_generate(cfg, params, prompts, max_new_tokens=10, batch_buckets=(1,))]
    draft, dparams = (eagle.init_params(cfg, params, VOCAB_IDS) if kind == "eagle"
                      else medusa.init_params(cfg, params, VOCAB_IDS, heads=2))
    be = JaxBackend(cfg, params, drafter=FeatureHeadDrafter(draft, dparams), k_buckets=(0, 2), batch_buckets=(2,),
                    slots=64)
    policy = FixedK(2)
    ref_mod = HeadRefiner(be, policy, cfg, params, tr.TrainConfig(lr=1e-2, warmup_steps=1, total_steps=40),
                          OnlineConfig(every=4, steps=4, batch=4, length=16), prompt_loss=True)
    reqs = [Request(f"r{i}", p, 10) for i, p in enumerate(prompts)]
    ref_mod.expect(reqs)
    outs = ServingEngine(be, policy, on_finish=ref_mod.on_finish).run(reqs)
    assert [o.tokens for o in outs] == ref
    assert ref_mod.updates == 3 and not ref_mod.dropped and np.isfinite(ref_mod.losses).all()
    assert ref_mod.losses[-1] < ref_mod.losses[0], ref_mod.losses
    served = be.dparams  # (what the steps run with)
    key = "fc" if kind == "eagle" else "w"
    assert not np.allclose(np.asarray(served[key]), np.asarray(dparams[key]))
    np.testing.assert_array_equal(np.asarray(served[key]), np.asarray(ref_mod.serving_params()[key]))
