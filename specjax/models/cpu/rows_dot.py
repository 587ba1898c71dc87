"""Few-row matrix products on the CPU as an XLA FFI custom call (``rows_dot.cc``).

A decode step projects B activation rows and a verify step B x (K + 1); both are bound by
reading the weights. XLA:CPU's dot reads them at about 19 GB/s for one row and 10-12 GB/s for
5-16 rows while this 2-core Xeon reads 28-32 GB/s (benchmarks/roofline.py), which is what
makes verifying K drafts cost 1.6-1.9x a decode step. The kernel reads weights packed per
16-column block (``pack``: [K, N] -> [ceil(N/16), K, 16], each block one contiguous stream), once
for all rows, and sums each output over k in an order that does not depend on the row count,
so a row's result is the same in a verify block as in a one-token step.

It is compiled on first use with the system C++ compiler (``g++ -O3 -march=native``) into
``$SPECJAX_CACHE_DIR/ext`` (default ``~/.cache/specjax/ext``), keyed by its source, the
compiler, jaxlib and this CPU's feature flags, and registered as the FFI target
``specjax_rows_packed``. ``ensure()`` raises a one-line SpecjaxError where that is impossible.
``rows_dot_reference`` is the plain-XLA definition the tests hold it to.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading

import jax
import jax.numpy as jnp
import jaxlib

from specjax.errors import SpecjaxError

LANES = 16  # output columns per packed block
_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rows_dot.cc")
_TARGET = "specjax_rows_packed"
_lock = threading.Lock()
_loaded: dict = {}  # "ok": True, or "error": why it cannot be built


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _build(cxx: str) -> str:
    """The shared library's path, compiled now unless an identical build is cached."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    with open(_SRC, "rb") as f:
        src = f.read()
    key = hashlib.sha256(b"\n".join([src, repr(version).encode(), jaxlib.__version__.encode(),
                                     _cpu_flags().encode()])).hexdigest()[:24]
    base = os.environ.get("SPECJAX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "specjax")
    out_dir = os.path.join(base, "ext")
    path = os.path.join(out_dir, f"rows_dot_{key}.so")
    if os.path.exists(path):
        return path
    os.makedirs(out_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so")
    os.close(fd)
    cmd = [cxx, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", f"-I{jax.ffi.include_dir()}", _SRC,
           "-o", tmp]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        os.unlink(tmp)
        lines = r.stderr.strip().splitlines() or ["no output"]
        first = next((line for line in lines if "error" in line), lines[-1])
        raise SpecjaxError(f"could not compile the rows kernel ({' '.join(cmd[:2])} ...): {first.strip()[:300]}")
    os.replace(tmp, path)  # atomic: a concurrent process sees the whole library or none
    return path


def ensure() -> None:
    """Build (or find) and register the kernel once per process; a one-line error if impossible."""
    with _lock:
        if "ok" in _loaded:
            return
        if "error" not in _loaded:
            try:
                cxx = _compiler()
                if cxx is None:
                    raise SpecjaxError("the rows kernel needs a C++ compiler (g++), and none was found")
                lib = ctypes.cdll.LoadLibrary(_build(cxx))
                jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.SpecjaxRowsPacked), platform="cpu")
                _loaded["ok"] = True
                return
            except (SpecjaxError, OSError) as e:
                _loaded["error"] = str(e)
        raise SpecjaxError(_loaded["error"])


def available() -> bool:
    try:
        ensure()
        return True
    except SpecjaxError:
        return False


def pack(w: jax.Array) -> jax.Array:
    """[K, N] -> [ceil(N / 16), K, 16] (columns padded with zeros to a whole block)."""
    K, N = w.shape
    nb = -(-N // LANES)
    w = jnp.pad(w, ((0, 0), (0, nb * LANES - N)))
    return w.reshape(K, nb, LANES).transpose(1, 0, 2)


def rows_dot(x: jax.Array, wp: jax.Array, n: int) -> jax.Array:
    """``x @ w`` for x [..., K] float32 and ``wp = pack(w)``, w [K, n], through the kernel."""
    ensure()
    if x.dtype != jnp.float32 or wp.dtype != jnp.float32:
        raise SpecjaxError(f"the rows kernel is float32 only, got {x.dtype} x {wp.dtype}")
    lead, K = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, K)
    y = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((flat.shape[0], n), jnp.float32))(flat, wp)
    return y.reshape(*lead, n)


def rows_dot_reference(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.dot(x, w, preferred_element_type=jnp.float32)
