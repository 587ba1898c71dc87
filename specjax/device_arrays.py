"""Host arrays onto the device without compiling anything, and what compiled code fixes about a
params pytree (its leaves' shapes and dtypes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import SpecjaxError


def to_device(a: np.ndarray, dtype=None) -> jax.Array:
    """A host array on the default device, as ``dtype`` (default its own). Where numpy converts
    exactly (same type, or widening to float32) through ``jax.device_put``: ``jnp.asarray`` of a
    numpy array compiles a program per shape, 30-70 ms each, which a model load paid once per
    weight shape."""
    dt = np.dtype(a.dtype if dtype is None else jnp.dtype(dtype))
    if dt == a.dtype or (dt == np.float32 and jnp.issubdtype(a.dtype, jnp.floating) and a.dtype.itemsize < 4):
        return jax.device_put(np.ascontiguousarray(a, dt))
    return jnp.asarray(a, dt)


def param_avals(tree):
    """Each leaf's (shape, dtype): what a compiled executable fixes about a params pytree."""
    return jax.tree_util.tree_map(lambda a: (tuple(a.shape), str(a.dtype)), tree)


def check_same_avals(compiled, new, what: str) -> None:
    """One-line SpecjaxError unless ``new`` has ``compiled``'s tree, shapes and dtypes."""
    a, b = jax.tree_util.tree_flatten_with_path(compiled), jax.tree_util.tree_flatten_with_path(new)
    if a[1] != b[1]:
        raise SpecjaxError(f"{what} do not have the compiled tree: {b[1]} vs {a[1]}"[:400])
    for (path, x), (_, y) in zip(a[0], b[0]):
        if (tuple(x.shape), x.dtype) != (tuple(y.shape), y.dtype):
            raise SpecjaxError(f"{what} do not match the compiled ones at {jax.tree_util.keystr(path)}: "
                               f"{tuple(y.shape)} {y.dtype} vs {tuple(x.shape)} {x.dtype}")
