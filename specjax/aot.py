"""Ahead-of-time checks of a sharded engine: its executables compiled for abstract params.

No weights and no device memory are needed: ``abstract_table`` builds the engine's StepTable over
``jax.ShapeDtypeStruct`` params that carry the layout's shardings, so every prefill and step
variant lowers and compiles exactly as serving would compile it on that mesh (on fake CPU
devices, ``XLA_FLAGS=--xla_force_host_platform_device_count=8``, a 70B bucket set compiles on a
laptop). ``variant_memory`` reads an executable's per-device memory analysis; ``per_device_bytes``
(sharding.py, re-exported here) is the exact size of one device's shard of a placed pytree, which the tests hold the compiled
argument sizes to.

XLA:CPU computes bfloat16 dots in float32 and keeps converted copies of the weights among its
temporaries (a bf16 7B step on 2 devices showed 27.6 GiB of temporaries, the float32 one 0.03),
so ``plan`` takes weights and KV from a compile with the model's dtype and the temporaries from
a float32 compile of the same variant: those are float32 activations, an upper bound for a
bf16 program on an accelerator.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp

from specjax import sharding as sh
from specjax.config import ModelConfig
from specjax.engine.table import StepTable
from specjax.errors import SpecjaxError
from specjax.models.options import ForwardOptions
# (the memory arithmetic a layout checks before placing a model lives with the layout)
from specjax.sharding import GB, check_fit, kv_bytes_per_token, per_device_bytes  # noqa: F401


def abstract_table(cfg: ModelConfig, layout: sh.Layout, dtype=jnp.bfloat16,
                   fwd: ForwardOptions = ForwardOptions()) -> StepTable:
    """A StepTable over abstract params placed by ``layout`` (the config and mesh are checked
    first: a mesh that cannot hold the model is a one-line error before any compilation)."""
    layout.check(cfg)
    params = layout.abstract_params(cfg, dtype, stacked=fwd.scan_stacked)
    return StepTable(cfg, params, params, fwd=fwd, layout=layout)


@dataclasses.dataclass
class VariantMemory:
    name: str
    compile_s: float
    argument: int  # bytes per device: params, state and inputs
    output: int
    alias: int  # output bytes that reuse donated inputs (the state)
    temp: int

    @property
    def peak(self) -> int:
        return self.argument + self.output - self.alias + self.temp


def variant_memory(name: str, build) -> VariantMemory:
    t0 = time.perf_counter()
    exe = build()
    dt = time.perf_counter() - t0
    m = exe.memory_analysis()
    if m is None:
        raise SpecjaxError(f"{name}: this backend reports no memory analysis")
    return VariantMemory(name, dt, m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes,
                         m.temp_size_in_bytes)


def _variants(table: StepTable, batch: int, slots: int, ks, chunk: int):
    out = [(f"prefill {chunk}", lambda: table.prefill(batch, chunk, slots, True, first=False))]
    out += [(f"step K={k}", lambda k=k: table.step(batch, k, slots, True)) for k in ks]
    return out


def bucket_set_seconds(cfg: ModelConfig, layout: sh.Layout, batch: int, slots: int, ks=(0, 4), chunk: int = 512,
                       dtype=jnp.bfloat16, fwd: ForwardOptions = ForwardOptions()) -> dict:
    """Compile seconds of each variant of a bucket set (the forward options decide, e.g., the
    per-layer list or the scanned layer stack)."""
    table = abstract_table(cfg, layout, dtype, fwd)
    out = {n: variant_memory(n, b).compile_s for n, b in _variants(table, batch, slots, ks, chunk)}
    _release(table)
    return out


def _release(*tables: StepTable) -> None:
    """Free the executables a plan compiled (a 70B bucket set's code fills thousands of memory
    maps; several plans in one process ran out of them)."""
    import gc

    for t in tables:
        t.release()
    jax.clear_caches()
    gc.collect()


def plan(cfg: ModelConfig, layout: sh.Layout, batch: int, slots: int, ks=(0, 4), chunk: int = 512,
         dtype=jnp.bfloat16, budget: float = 80 * GB, fwd: ForwardOptions = ForwardOptions()) -> dict:
    """Compile a bucket set (a later prefill chunk and chain steps of ``ks``) for ``batch`` rows of
    ``slots`` on ``layout``, and say per device: weights, KV cache, the largest temporaries, whether
    it fits ``budget``, and the largest number of cached tokens (batch x context) that would."""
    kv_tok = check_fit(cfg, layout, batch, slots, dtype, budget)
    table = abstract_table(cfg, layout, dtype, fwd)
    weights = per_device_bytes(table.params)
    kv = per_device_bytes(table.state_info(batch, slots).cache)
    real = [variant_memory(n, b) for n, b in _variants(table, batch, slots, ks, chunk)]
    t32 = abstract_table(cfg, layout, jnp.float32, fwd)
    temps = [variant_memory(n, b).temp for n, b in _variants(t32, batch, slots, ks, chunk)]
    temp = max(temps)
    _release(table, t32)
    need = weights + kv + temp
    return {
        "config": cfg.name, "mesh": sh.describe_mesh(layout.mesh), "dtype": jnp.dtype(dtype).name,
        "batch": batch, "slots": slots, "weights_gb": weights / GB, "kv_gb": kv / GB,
        "temp_gb": temp / GB, "need_gb": need / GB, "budget_gb": budget / GB, "fits": need <= budget,
        "max_tokens": int(max(0.0, budget - weights - temp) // kv_tok),
        "kv_bytes_per_token": kv_tok,
        "variants": [dict(dataclasses.asdict(v), temp_f32=t) for v, t in zip(real, temps)],
    }
