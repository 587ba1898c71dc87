"""Run in a subprocess by test_sharding.py on 8 fake CPU devices: ahead-of-time compilation of the
engine's executables for abstract 70B- and 8B-shaped params (two layers each: the layouts and the
per-layer memory do not depend on depth), golden layouts, the memory analysis against the exact
per-device bytes, and the one-line errors of meshes and KV budgets that cannot fit.
Prints AOT_OK at the end."""
import os
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from specjax import aot, sharding as sh
from specjax.config import get_model_config
from specjax.errors import SpecjaxError

M = "model"
for name, data, model, golden in [
    # wq, wk, w_down, embed, lm_head, cache k (batch 2 over data where data divides it)
    ("llama2-70b", 1, 8, (P(None, M), P(None, M), P(M, None), P(M, None), P(None, M), P(None, "data", M, None, None))),
    ("llama3-8b", 2, 2, (P(None, M), P(None, M), P(M, None), P(M, None), P(None, M), P(None, "data", M, None, None))),
    ("qwen2.5-7b", 1, 4, (P(None, M), P(None, M), P(M, None), P(M, None), P(None, M), P(None, "data", M, None, None))),
    # 8 KV heads over 8 shards, 64 query heads: Llama-2 70B; Qwen2.5-7B's 4 KV heads on 8 shards would be
    # replicated, but its 28 heads do not divide over 8 at all (refused below)
]:
    cfg = get_model_config(name).replace(num_layers=2)
    lay = sh.Layout(sh.make_mesh(data, model))
    table = aot.abstract_table(cfg, lay)
    B, S = 2, 256
    exe = table.step(B, 4, S, True)
    (params, dparams, state, *_), _ = exe.input_shardings
    got = (params["layers"][0]["wq"].spec, params["layers"][0]["wk"].spec, params["layers"][1]["w_down"].spec,
           params["embed"].spec, params["lm_head"].spec, state.cache.k.spec)
    assert got == golden, (name, got)
    out_state = exe.output_shardings[0]
    # the step hands the next one its state in the same shardings: nothing reshards between steps
    for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(out_state)):
        assert a.is_equivalent_to(b, len(a.spec) or 1), (name, a, b)
    m = exe.memory_analysis()
    exact = aot.per_device_bytes(table.params) + aot.per_device_bytes(table.state_info(B, S))
    assert exact <= m.argument_size_in_bytes <= exact + 4096, (name, m.argument_size_in_bytes, exact)
    assert m.alias_size_in_bytes >= aot.per_device_bytes(table.state_info(B, S).cache.k) * 2  # the cache is donated
    pre = table.prefill(B, 128, S, True, first=False)
    assert pre.output_shardings.cache.k.is_equivalent_to(state.cache.k, 5)

# one-line errors before any compilation
errors = [
    (lambda: aot.abstract_table(get_model_config("qwen2.5-7b"), sh.Layout(sh.make_mesh(1, 8))),
     "qwen2.5-7b does not fit mesh data=1 x model=8: 28 attention heads"),
    (lambda: aot.check_fit(get_model_config("llama2-70b"), sh.Layout(sh.make_mesh(1, 1)), 1, 4096),
     "llama2-70b on mesh data=1 x model=1: 138.0 GB of weights"),
    (lambda: aot.check_fit(get_model_config("llama2-70b"), sh.Layout(sh.make_mesh(1, 8)), 512, 4096),
     "exceed the 80 GB budget; at most"),
    (lambda: sh.make_mesh(2, 8), "needs 16 devices; 8 cpu device(s) present"),
]
for f, needle in errors:
    try:
        f()
        raise SystemExit(f"no error: {needle}")
    except SpecjaxError as e:
        assert needle in str(e) and "\n" not in str(e), (needle, str(e))
assert aot.check_fit(get_model_config("llama2-70b"), sh.Layout(sh.make_mesh(1, 8)), 8, 4096) == 80 * 2 * 128 * 2
print("AOT_OK")
