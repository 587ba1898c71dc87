"""Sharding hooks: logical axis names on params and cache, mapped to mesh axes by one rules table.

Every array dimension carries a logical name (``embed``, ``heads``, ``mlp`` ...).
``LOGICAL_RULES`` maps names to mesh axes (``data`` for batch parallelism,
``model`` for tensor parallelism). A dimension that does not divide evenly over
its mesh axis (e.g. 3 KV heads on 2 model shards) is replicated instead, so any
config runs on any mesh. By default everything runs on a 1-device mesh.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specjax.config import ModelConfig

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


def param_logical_axes(cfg: ModelConfig) -> dict[str, Any]:
    keys = list(_LAYER_AXES)
    if not cfg.qkv_bias:
        keys = [k for k in keys if k not in ("bq", "bk", "bv")]
    axes: dict[str, Any] = {
        "embed": ("vocab", "embed"),
        "final_norm": ("embed",),
        "layers": [{k: _LAYER_AXES[k] for k in keys} for _ in range(cfg.num_layers)],
    }
    if not cfg.tie_embeddings:
        axes["lm_head"] = ("embed", "vocab")
    return axes


def make_mesh(data: int = 1, model: int = 1, devices=None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    n = data * model
    if n > len(devices):
        from specjax.errors import SpecjaxError

        raise SpecjaxError(f"mesh {data}x{model} needs {n} devices, only {len(devices)} available")
    return Mesh(np.asarray(devices[:n]).reshape(data, model), ("data", "model"))


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
    return tree_shardings(param_logical_axes(cfg), params_or_shapes, mesh, rules, head_units(cfg))


def shard_params(cfg: ModelConfig, params, mesh: Mesh, rules=None):
    return jax.device_put(params, param_shardings(cfg, params, mesh, rules))


def cache_shardings(cache, mesh: Mesh, rules=None):
    from specjax.cache import KVCache

    return KVCache(**{name: NamedSharding(mesh, logical_to_spec(CACHE_AXES[name], tuple(getattr(cache, name).shape),
                                                                mesh, rules, units=None))
                      for name in ("k", "v", "lengths")})


def abstract_params(cfg: ModelConfig, dtype=jax.numpy.bfloat16):
    """ShapeDtypeStructs of a config's params (no memory; for layout checks of 7B-70B configs)."""
    D, F, H, Hkv, hd, V = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                           cfg.head_dim, cfg.vocab_size)
    shapes = {"attn_norm": (D,), "mlp_norm": (D,), "wq": (D, H * hd), "wk": (D, Hkv * hd), "wv": (D, Hkv * hd),
              "bq": (H * hd,), "bk": (Hkv * hd,), "bv": (Hkv * hd,), "wo": (H * hd, D),
              "w_gate": (D, F), "w_up": (D, F), "w_down": (F, D)}
    keys = [k for k in shapes if cfg.qkv_bias or k not in ("bq", "bk", "bv")]
    sds = jax.ShapeDtypeStruct
    out = {"embed": sds((V, D), dtype), "final_norm": sds((D,), dtype),
           "layers": [{k: sds(shapes[k], dtype) for k in keys} for _ in range(cfg.num_layers)]}
    if not cfg.tie_embeddings:
        out["lm_head"] = sds((D, V), dtype)
    return out
