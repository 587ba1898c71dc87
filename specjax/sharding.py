"""Sharding: one logical-axis rules table places every array of the engine on a device mesh.

Every array dimension carries a logical name (``embed``, ``heads``, ``mlp`` ...).
``LOGICAL_RULES`` maps names to mesh axes (``data`` for batch parallelism, ``model`` for
tensor parallelism: attention heads, MLP columns, the vocabulary of the embedding and the
head, the KV cache by KV heads). A dimension that does not divide over its mesh axis is
replicated (KV heads fewer than the model shards, a batch bucket of 1 on two data shards);
``Layout.check`` refuses, in one line, meshes whose model axis would have to split attention
heads or MLP columns unevenly.

A ``Layout`` (a mesh, the rules, whether drafts are sharded) is part of every CompileKey of a
sharded engine: the compiled prefills, steps and row operations take their inputs with the
layout's shardings and pin the state they return to the same cache sharding, so the live state
never reshards between steps. Without a layout everything runs on one device.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from specjax.config import ModelConfig
from specjax.errors import SpecjaxError

LOGICAL_RULES: dict[str, str | None] = {
    "batch": "data",
    "vocab": "model",
    "embed": None,
    "heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "layers": None,
    "cache_seq": None,
    "head_dim": None,
}

_LAYER_AXES = {
    "attn_norm": ("embed",), "mlp_norm": ("embed",),
    "wq": ("embed", "heads"), "wk": ("embed", "kv_heads"), "wv": ("embed", "kv_heads"),
    "bq": ("heads",), "bk": ("kv_heads",), "bv": ("kv_heads",),
    "wo": ("heads", "embed"),
    "w_gate": ("embed", "mlp"), "w_up": ("embed", "mlp"), "w_down": ("mlp", "embed"),
}

CACHE_AXES = {"k": ("layers", "batch", "kv_heads", "cache_seq", "head_dim"),
              "v": ("layers", "batch", "kv_heads", "cache_seq", "head_dim"),
              "lengths": ("batch",)}


def param_logical_axes(cfg: ModelConfig, stacked: bool = False) -> dict[str, Any]:
    """Logical axes of every param; ``stacked``: layers as one dict of [L, ...] arrays
    (llama.stack_layers), whose leading axis is ``layers``."""
    keys = list(_LAYER_AXES)
    if not cfg.qkv_bias:
        keys = [k for k in keys if k not in ("bq", "bk", "bv")]
    axes: dict[str, Any] = {
        "embed": ("vocab", "embed"),
        "final_norm": ("embed",),
        "layers": ({k: ("layers",) + _LAYER_AXES[k] for k in keys} if stacked
                   else [{k: _LAYER_AXES[k] for k in keys} for _ in range(cfg.num_layers)]),
    }
    if not cfg.tie_embeddings:
        axes["lm_head"] = ("embed", "vocab")
    return axes


def make_mesh(data: int = 1, model: int = 1, devices=None) -> Mesh:
    """A ``data`` x ``model`` mesh (jax.make_mesh, GSPMD-propagated ``Auto`` axes) over the
    first data * model of ``devices`` (default: this process's devices; in a multi-process job
    each process serves as a data-parallel replica on its own)."""

    if not (isinstance(data, (int, np.integer)) and isinstance(model, (int, np.integer)) and data >= 1 and model >= 1):
        raise SpecjaxError(f"mesh sizes must be positive integers, got data={data!r} x model={model!r}")
    devices = list(devices if devices is not None else jax.local_devices())
    n = data * model
    if n > len(devices):
        kind = devices[0].platform if devices else "jax"
        raise SpecjaxError(f"mesh data={data} x model={model} needs {n} devices; {len(devices)} {kind} "
                           "device(s) present")
    return jax.make_mesh((data, model), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto),
                         devices=devices[:n])


def describe_mesh(mesh: Mesh) -> str:
    return " x ".join(f"{name}={size}" for name, size in mesh.shape.items())


def logical_to_spec(axes: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh, rules=None,
                    units: dict[str, int] | None = None) -> P:
    """units: for axes that pack several heads into one dimension ("heads": H, "kv_heads": Hkv),
    shard only if whole heads divide over the mesh axis (never split a head)."""
    rules = LOGICAL_RULES if rules is None else rules
    units = units or {}
    out = []
    used = set()
    for name, dim in zip(axes, shape):
        mesh_axis = rules.get(name)
        n = units.get(name, dim)
        if mesh_axis is None or mesh_axis in used or n % mesh.shape[mesh_axis] != 0:
            out.append(None)
        else:
            out.append(mesh_axis)
            used.add(mesh_axis)
    return P(*out)


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(a, str) for a in x)


def tree_shardings(axes_tree, shapes_tree, mesh: Mesh, rules=None, units=None):
    """NamedShardings for a pytree, given matching trees of logical axes and shapes."""
    return jax.tree_util.tree_map(
        lambda ax, shp: NamedSharding(mesh, logical_to_spec(ax, tuple(shp.shape), mesh, rules, units)),
        axes_tree, shapes_tree, is_leaf=_is_axes)


def head_units(cfg: ModelConfig) -> dict[str, int]:
    return {"heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads}


def param_shardings(cfg: ModelConfig, params_or_shapes, mesh: Mesh, rules=None):
    stacked = isinstance(params_or_shapes["layers"], dict)
    return tree_shardings(param_logical_axes(cfg, stacked), params_or_shapes, mesh, rules, head_units(cfg))


def abstract_params(cfg: ModelConfig, dtype=jax.numpy.bfloat16, stacked: bool = False):
    """ShapeDtypeStructs of a config's params (no memory; for layout checks of 7B-70B configs);
    ``stacked``: layers as llama.stack_layers gives them."""
    D, F, H, Hkv, hd, V = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                           cfg.head_dim, cfg.vocab_size)
    shapes = {"attn_norm": (D,), "mlp_norm": (D,), "wq": (D, H * hd), "wk": (D, Hkv * hd), "wv": (D, Hkv * hd),
              "bq": (H * hd,), "bk": (Hkv * hd,), "bv": (Hkv * hd,), "wo": (H * hd, D),
              "w_gate": (D, F), "w_up": (D, F), "w_down": (F, D)}
    keys = [k for k in shapes if cfg.qkv_bias or k not in ("bq", "bk", "bv")]
    sds = jax.ShapeDtypeStruct
    out = {"embed": sds((V, D), dtype), "final_norm": sds((D,), dtype),
           "layers": ({k: sds((cfg.num_layers,) + shapes[k], dtype) for k in keys} if stacked
                      else [{k: sds(shapes[k], dtype) for k in keys} for _ in range(cfg.num_layers)])}
    if not cfg.tie_embeddings:
        out["lm_head"] = sds((D, V), dtype)
    return out


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where every array of a sharded engine lives: a mesh, the logical rules, and whether an
    independent draft model is sharded like the target (``shard_draft``) or replicated on every
    device (the default: a small draft then runs without collectives). Hashable: it is part of
    the CompileKey. (A layer-skip draft's params are the target's first layers: replicating
    them copies those layers; give it ``shard_draft=True``.)"""

    mesh: Mesh
    shard_draft: bool = False
    rules: tuple = tuple(LOGICAL_RULES.items())

    def describe(self) -> str:
        return f"mesh {describe_mesh(self.mesh)}"

    def _rules(self) -> dict:
        return dict(self.rules)

    def sharding(self, axes: tuple, shape: tuple, units: dict | None = None) -> NamedSharding:
        return NamedSharding(self.mesh, logical_to_spec(axes, tuple(shape), self.mesh, self._rules(), units))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def rows(self, shape: tuple) -> NamedSharding:
        """A per-row array ([B, ...]: tokens, lengths, sampling parameters): batch over ``data``."""
        return self.sharding(("batch",) + (None,) * (len(shape) - 1), shape)

    def check(self, cfg: ModelConfig, role: str = "model") -> None:
        """One-line SpecjaxError, naming the config and the mesh, for a model axis that would
        split attention heads or MLP columns unevenly (KV heads fewer than the shards are
        replicated instead; more but not divisible is an error)."""

        tp = self.mesh.shape.get(self._rules().get("heads") or "", 1)
        bad = [f"{n} {what}" for n, what in ((cfg.num_heads, "attention heads"), (cfg.intermediate_size, "MLP columns"))
               if n % tp]
        if cfg.num_kv_heads >= tp and cfg.num_kv_heads % tp:
            bad.append(f"{cfg.num_kv_heads} KV heads")
        if bad:
            raise SpecjaxError(f"{role} {cfg.name} does not fit {self.describe()}: {', '.join(bad)} do not divide over "
                               f"{tp} model shards (pick a model axis that divides them)")

    def params(self, cfg: ModelConfig, tree, draft: bool = False):
        """Shardings of a params pytree (arrays or ShapeDtypeStructs); an independent draft's are
        replicated unless ``shard_draft``."""
        if draft and not self.shard_draft:
            return jax.tree_util.tree_map(lambda _: self.replicated(), tree)
        return param_shardings(cfg, tree, self.mesh, self._rules())

    def put_params(self, cfg: ModelConfig, params, draft: bool = False):
        return jax.device_put(params, self.params(cfg, params, draft))

    def place(self, cfg: ModelConfig, params, fwd, rows: int, slots: int, draft_cfg: ModelConfig | None = None,
              draft_params=None):
        """(params, draft params or None) placed by this layout for an engine of ``rows`` x
        ``slots`` cached tokens, after one-line SpecjaxErrors for what cannot run on it: the CPU
        rows kernel, heads or MLP columns that do not divide (``check``), weights and the KV cache
        of every row beyond one device's memory. A draft without params of its own (None or the
        target's) runs on the target's."""
        from specjax.errors import require

        require(not fwd.rows_kernel, f"the CPU rows kernel runs on one device; use rows_kernel 0 on {self.describe()}")
        self.check(cfg)
        if draft_cfg is not None and self.shard_draft:
            self.check(draft_cfg, "draft")
        budget = device_memory_budget()
        if budget:
            check_fit(cfg, self, rows, slots, jax.tree_util.tree_leaves(params)[0].dtype, budget)
        same = draft_params is None or draft_params is params
        return (self.put_params(cfg, params),
                None if same else self.put_params(draft_cfg or cfg, draft_params, draft=True))

    def abstract_params(self, cfg: ModelConfig, dtype=jax.numpy.bfloat16, stacked: bool = False):
        """A config's params as ShapeDtypeStructs placed by this layout (no memory)."""
        ab = abstract_params(cfg, dtype, stacked)
        return with_shardings(ab, self.params(cfg, ab))

    def cache(self, cache, draft: bool = False):
        """KVCache of shardings for a cache (arrays or ShapeDtypeStructs): KV heads over ``model``
        where they divide, rows over ``data``; a replicated draft's cache is replicated."""
        if draft and not self.shard_draft:
            out = dict(k=self.replicated(), v=self.replicated(), lengths=self.rows(cache.lengths.shape))
        else:
            out = {name: self.sharding(CACHE_AXES[name], getattr(cache, name).shape) for name in ("k", "v", "lengths")}
        # a feature head's cache (cache.FeatureCache) also carries per-row features: rows over ``data``
        extra = {f.name: self.rows(getattr(cache, f.name).shape) for f in dataclasses.fields(cache)
                 if f.name not in out}
        return type(cache)(**out, **extra)

    def segment(self, seg: dict) -> dict:
        """Shardings of a prefix-store segment (table.take_segment: one row's chunk of entries,
        [L, Hkv, C, hd], and its scalars): KV heads over ``model`` as in the cache, so a stored
        chunk stays on the devices its row's shards live on; a replicated draft's replicated."""
        def part(c, draft):
            if c is None:
                return None
            if draft and not self.shard_draft:
                return {n: self.replicated() for n in c}
            kv = {n: self.sharding(tuple(a for a in CACHE_AXES[n] if a != "batch"), c[n].shape) for n in ("k", "v")}
            return {n: kv.get(n, self.replicated()) for n in c}

        return {"cache": part(seg["cache"], False), "dcache": part(seg["dcache"], True),
                "prev": self.replicated(), "pending": self.replicated()}

    def state(self, st):
        """StepState of shardings (one for every prefill, step and row operation of a bucket)."""
        cls = type(st)
        dc = None if st.dcache is None else self.cache(st.dcache, draft=True)
        return cls(cache=self.cache(st.cache), dcache=dc, prev=self.rows(st.prev.shape),
                   pending=self.rows(st.pending.shape))

    def pin_state(self, st):
        """``st`` constrained to ``state``'s shardings (inside a compiled function)."""
        return jax.lax.with_sharding_constraint(st, self.state(st))


def device_memory_budget() -> float | None:
    """Bytes one of this process's devices may hold (an accelerator's memory limit), or None where
    jax does not say (the CPU)."""
    try:
        stats = jax.local_devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None
    return float(stats["bytes_limit"]) if stats.get("bytes_limit") else None


def with_shardings(abstract, shardings):
    """ShapeDtypeStructs of ``abstract`` carrying ``shardings`` (a matching tree)."""
    return jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


GB = 1e9


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a pytree of placed arrays or sharded ShapeDtypeStructs (the
    largest shard: uneven splits are padded to it)."""
    total = 0
    for x in jax.tree_util.tree_leaves(tree):
        shape = x.sharding.shard_shape(tuple(x.shape)) if getattr(x, "sharding", None) is not None else x.shape
        total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return total


def kv_bytes_per_token(cfg: ModelConfig, layout: "Layout", dtype=jnp.bfloat16) -> float:
    """KV cache bytes one device holds per cached token (K and V of every layer; KV heads split
    over the model axis where they divide, replicated where they do not)."""
    from specjax.cache import KVCache

    shape = (cfg.num_layers, 1, cfg.num_kv_heads, 1, cfg.head_dim)
    s = layout.cache(KVCache(k=jax.ShapeDtypeStruct(shape, dtype), v=jax.ShapeDtypeStruct(shape, dtype),
                             lengths=jax.ShapeDtypeStruct((1,), jnp.int32))).k
    return 2 * math.prod(s.shard_shape(shape)) * jnp.dtype(dtype).itemsize


def check_fit(cfg: ModelConfig, layout: "Layout", batch: int, slots: int, dtype=jnp.bfloat16,
              budget: float = 80 * GB) -> float:
    """One-line SpecjaxError, before any compilation or device work, when one device's share of
    the weights and of a ``batch`` x ``slots`` KV cache exceeds ``budget`` bytes; else the KV bytes
    per cached token and device."""
    layout.check(cfg)
    weights = per_device_bytes(layout.abstract_params(cfg, dtype))
    kv_tok = kv_bytes_per_token(cfg, layout, dtype)
    kv = kv_tok * batch * slots
    if weights + kv > budget:
        room = max(0, int((budget - weights) // kv_tok))
        raise SpecjaxError(f"{cfg.name} on {layout.describe()}: {weights / GB:.1f} GB of weights + {kv / GB:.1f} GB "
                           f"of KV cache ({batch} x {slots} tokens) per device exceed the {budget / GB:.0f} GB budget; "
                           f"at most {room} cached tokens fit beside the weights")
    return kv_tok
