"""Host arrays onto the device without compiling anything."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def to_device(a: np.ndarray, dtype=None) -> jax.Array:
    """A host array on the default device, as ``dtype`` (default its own). Where numpy converts
    exactly (same type, or widening to float32) through ``jax.device_put``: ``jnp.asarray`` of a
    numpy array compiles a program per shape, 30-70 ms each, which a model load paid once per
    weight shape."""
    dt = np.dtype(a.dtype if dtype is None else jnp.dtype(dtype))
    if dt == a.dtype or (dt == np.float32 and jnp.issubdtype(a.dtype, jnp.floating) and a.dtype.itemsize < 4):
        return jax.device_put(np.ascontiguousarray(a, dt))
    return jnp.asarray(a, dt)
