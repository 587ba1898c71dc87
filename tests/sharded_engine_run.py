"""Run in a subprocess by test_sharding.py (the fake device count must be set before JAX starts):
the serving engine sharded over several meshes of 8 fake CPU devices gives the unsharded
engine's tokens, greedy (prompt lookup, suffix trees, an independent draft model, replicated and
sharded, an EAGLE feature head) and sampled with fixed seeds; the sharded forward gives the same logits; bad meshes are
one-line errors. Prints SHARDED_ENGINE_OK at the end. argv[1]: the meshes, DATAxMODEL comma list
(default 1x2,2x4: rows unsplit and split; the default suite runs 2x4, the slow test 1x2, 2x4, 4x2 and 8x1)."""
import os
import sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
import time
import jax, numpy as np
from specjax import sharding as sh
from specjax.config import get_model_config
from specjax.drafters import eagle, medusa
from specjax.drafters.device import DeviceTreeDrafter
from specjax.drafters.device import ModelDraft
from specjax.drafters.prompt_lookup import PromptLookupDrafter
from specjax.drafters.suffix import SuffixDrafter
from specjax.engine.jax_backend import JaxBackend
from specjax.engine.loop import EventClock, ServingEngine
from specjax.engine.scheduler import Request
from specjax.errors import SpecjaxError
from specjax.goodput import FixedK
from specjax.models import attention, llama
from specjax.models.options import ForwardOptions
from specjax.reference_ar import reference_generate
from specjax.sampling import SamplingParams

assert len(jax.devices()) == 8
t0 = time.time()
cfg = get_model_config("tiny-random")
params = llama.init_random_params(cfg, 0)
# an independent draft model: a copy of the target's first 3 of 4 layers (it agrees often enough
# for accepted drafts; its params are not the target's arrays, so a layout places them itself)
dcfg = cfg.replace(name="tiny-draft", num_layers=3)
dparams = dict(params, layers=[dict(lp) for lp in params["layers"][:3]])
rng = np.random.default_rng(0)
prompts = []
for i in range(6):
    unit = list(map(int, rng.integers(1, 255, size=3)))
    prompts.append((unit * 5)[:12] if i % 2 == 0 else list(map(int, rng.integers(1, 255, size=9))))
greedy = [Request(f"g{i}", p, 12, arrival=0.0) for i, p in enumerate(prompts)]
sampled = [Request(f"s{i}", p, 12, sampling=SamplingParams(temperature=1.0, top_k=50, seed=7 + i), arrival=0.0)
           for i, p in enumerate(prompts)]

def run(kind, layout, reqs, K=2, fwd=ForwardOptions()):
    kw = dict(k_buckets=(0, K), batch_buckets=(2, 8), slots=64, layout=layout, fwd=fwd)
    if kind == "prompt_lookup":
        be = JaxBackend(cfg, params, drafter=PromptLookupDrafter(), **kw)
    elif kind == "suffix":
        be = JaxBackend(cfg, params, drafter=SuffixDrafter(), **kw)
    elif kind == "eagle":  # a random head: drafts that are mostly rejected, on the target's features
        be = JaxBackend(cfg, params, drafter=eagle.EagleDrafter(*eagle.init_params(cfg, params)), **kw)
    elif kind == "medusa":  # heads drafting token trees inside the tree step
        tree = medusa.best_tree(medusa.prior_accuracy(4), 4)
        be = JaxBackend(cfg, params, drafter=DeviceTreeDrafter(*medusa.init_params(cfg, params, tree=tree)),
                        **kw)
    else:
        be = JaxBackend(cfg, params, draft=ModelDraft(dcfg), draft_params=dparams, **kw)
    outs = ServingEngine(be, FixedK(K), clock=EventClock()).run([Request(r.id, r.prompt, r.max_new_tokens, sampling=r.sampling) for r in reqs])
    if layout is not None:  # the live state and the params are where the layout puts them
        st = be.state
        assert st.cache.k.sharding.is_equivalent_to(layout.cache(st.cache).k, 5), (st.cache.k.sharding, layout)
        w_up = be.params["layers"]["w_up"] if isinstance(be.params["layers"], dict) else be.params["layers"][0]["w_up"]
        assert tuple(w_up.sharding.spec)[-2:] == (None, "model"), w_up.sharding
        if kind == "draft" and not layout.shard_draft:
            assert be.dparams["layers"][0]["w_up"].sharding.is_fully_replicated
        if kind in ("eagle", "medusa"):  # the head is replicated on every device
            assert all(a.sharding.is_fully_replicated for a in jax.tree_util.tree_leaves(be.dparams))
    return [o.tokens for o in outs], sum(o.accepted for o in outs), sum(o.drafted for o in outs)

# logits: the sharded forward against the unsharded one
toks = jax.numpy.asarray(rng.integers(0, cfg.vocab_size, (4, 6)), jax.numpy.int32)
pos = jax.numpy.broadcast_to(jax.numpy.arange(6, dtype=jax.numpy.int32), (4, 6))
def logits(p, layout=None):
    c = llama.init_cache_for(cfg, 4, 16)
    if layout is not None:
        c = jax.device_put(c, layout.cache(c))
    return np.asarray(jax.jit(lambda p, c: llama.forward(p, toks, pos, c, llama.causal_mask(4, 6), cfg=cfg)[0])(p, c))
want_logits = logits(params)

meshes = [tuple(map(int, m.split("x"))) for m in (sys.argv[1] if len(sys.argv) > 1 else "1x2,2x4").split(",")]
# greedy: every drafter's tokens are the reference AR loop's (the unsharded engine's, which
# test_engine.py and test_launch_matrix.py check against that loop), so one AR run is the baseline
# of all three; sampled: the unsharded engine's own tokens, run only when a mesh samples (1x2, 4x2)
ar = [r.tokens for r in reference_generate(cfg, params, prompts, max_new_tokens=12, batch_buckets=(8,))]
want = {kind: (ar, None) for kind in ("prompt_lookup", "suffix", "draft", "eagle", "medusa")}
want_s = None
print("baseline", round(time.time() - t0, 1), flush=True)
for data, model in meshes:
    lay = sh.Layout(sh.make_mesh(data, model))
    got = logits(lay.put_params(cfg, params), lay)
    np.testing.assert_allclose(got, want_logits, rtol=2e-5, atol=2e-5)
    # prompt lookup on every mesh; the draft model, suffix trees and sampling on two each (rows
    # split and heads split: the tree step's and the draft's shardings are the chain step's)
    kinds = ("prompt_lookup",) + {(1, 2): ("draft",), (2, 4): ("suffix", "eagle", "medusa"), (4, 2): ("draft",),
                                  (8, 1): ("suffix",)}[(data, model)]
    for kind in kinds:
        got = run(kind, lay, greedy)
        assert got[0] == want[kind][0], (kind, data, model)
        # the verify path ran, not only K = 0 (the random head's drafts are verified but rarely accepted)
        assert (got[2] if kind in ("eagle", "medusa") else got[1]) > 0, (kind, data, model, "no draft verified or accepted")
    if (data, model) in ((1, 2), (4, 2)):
        want_s = want_s or run("prompt_lookup", None, sampled)
        assert run("prompt_lookup", lay, sampled)[0] == want_s[0], ("sampled", data, model)
    print("mesh", data, model, "ok", round(time.time() - t0, 1), flush=True)
# the scanned layer stack (ForwardOptions.scan_layers), sharded, gives the same tokens
scan = ForwardOptions(scan_layers=True)
assert run("draft", sh.Layout(sh.make_mesh(2, 4)), greedy, fwd=scan)[0] == want["draft"][0], "scan"
# the Pallas tree-attention kernel (interpret mode here) under shard_map: heads and KV heads both
# split (1x2), and KV heads replicated under query heads split four ways (2x4)
traced = []
attention._pallas_sharded = (lambda f: lambda *a: traced.append(a[-1]) or f(*a))(attention._pallas_sharded)
pallas = ForwardOptions(attention="pallas")
for (data, model), kind in (((1, 2), "suffix"), ((2, 4), "prompt_lookup")):
    assert run(kind, sh.Layout(sh.make_mesh(data, model)), greedy, fwd=pallas)[0] == want[kind][0], ("pallas", kind)
assert {lay.mesh.shape["model"] for lay in traced} == {2, 4}  # the kernel went through shard_map
print("pallas under shard_map ok", round(time.time() - t0, 1), flush=True)
# a draft sharded like the target gives the same tokens
assert run("draft", sh.Layout(sh.make_mesh(2, 4), shard_draft=True), greedy)[0] == want["draft"][0]
# prefix caching on a mesh: prompts sharing 32 of their 40-42 tokens (chunks of 16), served twice
# by one sharded backend with a draft model (the second run restores stored chunks, target and
# draft entries, kept in the cache's head sharding) give the unsharded, uncached tokens
shared = list(map(int, rng.integers(1, 255, size=32)))
pre = [Request(f"p{i}", shared + list(map(int, rng.integers(1, 255, size=8 + i))), 8, arrival=0.0) for i in range(3)]


def run_prefix(layout, mb):
    be = JaxBackend(cfg, params, draft=ModelDraft(dcfg), draft_params=dparams, k_buckets=(0, 2), batch_buckets=(4,),
                    slots=64, layout=layout, prefill_chunk=16, prefix_cache_mb=mb)
    outs = []
    for _ in range(2):
        be.reset()
        outs.append([o.tokens for o in ServingEngine(be, FixedK(2), clock=EventClock()).run(
            [Request(r.id, r.prompt, r.max_new_tokens) for r in pre])])
    return outs, be


want_p = [r.tokens for r in reference_generate(cfg, params, [r.prompt for r in pre], max_new_tokens=8,
                                               batch_buckets=(4,))]
lay = sh.Layout(sh.make_mesh(2, 4))
got, be = run_prefix(lay, 1024)
assert got == [want_p, want_p], "prefix cache on a mesh"
assert be.prefix.stats.hits >= 3 and be.prefix.stats.tokens_saved >= 3 * 32, be.prefix.stats
seg = next(iter(be.prefix._nodes())).segment
assert seg["dcache"] is not None and seg["cache"]["k"].sharding.is_equivalent_to(lay.segment(seg)["cache"]["k"], 4)
print("prefix cache on a mesh ok", round(time.time() - t0, 1), flush=True)
# bad meshes: one line each, before any device work
for data, model, needle in ((1, 8, "tiny-random does not fit mesh data=1 x model=8: 4 attention heads"),
                            (4, 4, "needs 16 devices; 8 cpu device(s) present"), (0, 2, "positive integers")):
    try:
        JaxBackend(cfg, params, layout=sh.Layout(sh.make_mesh(data, model)), k_buckets=(0,), batch_buckets=(2,), slots=64)
        raise SystemExit(f"no error for mesh {data} x {model}")
    except SpecjaxError as e:
        assert needle in str(e) and "\n" not in str(e), str(e)
# a device whose memory cannot hold the weights and every row's KV cache (a GPU's limit, faked)
sh.device_memory_budget = lambda: 2e6
try:
    JaxBackend(cfg, params, layout=sh.Layout(sh.make_mesh(1, 2)), k_buckets=(0,), batch_buckets=(8,), slots=512)
    raise SystemExit("no error for a KV cache over the budget")
except SpecjaxError as e:
    assert str(e).startswith("tiny-random on mesh data=1 x model=2:") and "of KV cache (8 x 512 tokens)" in str(e), e
print("SHARDED_ENGINE_OK", round(time.time() - t0, 1))
