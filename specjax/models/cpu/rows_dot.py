"""Few-row matrix products on the CPU as an XLA FFI custom call (``rows_dot.cc``).

A decode step projects B activation rows and a verify step B x (K + 1); both are bound by
reading the weights. XLA:CPU's dot reads them at about 19 GB/s for one row and 10-12 GB/s for
5-16 rows while this 2-core Xeon reads 28-32 GB/s (benchmarks/roofline.py), which is what
makes verifying K drafts cost 1.6-1.9x a decode step. The kernel reads weights packed per
16-column block (``pack``: [K, N] -> [ceil(N/16), K, 16], each block one contiguous stream), once
for all rows, and sums each output over k in an order that does not depend on the row count,
so a row's result is the same in a verify block as in a one-token step. GGUF weights stored as
Q4_1 or Q8_0 can stay in those blocks (``pack_q4_1`` / ``pack_q8_0``: 4.6 or 8.5 bits a weight
read instead of 32) and are decoded in registers to exactly the float32 values the loader's
dequantization gives, so the model is the same; only the summation order differs from XLA's dot.

It is compiled on first use with the system C++ compiler (``g++ -O3 -march=native``: the AVX-512
path, or the AVX2 + FMA + F16C one, where the CPU has it; portable loops elsewhere) into
``$SPECJAX_CACHE_DIR/ext`` (default ``~/.cache/specjax/ext``), keyed by its source, the
compiler, jaxlib and this CPU's feature flags, verified against its recorded hash before it is
loaded (``_build``). XLA sees forwarders (``rows_dot_stub.cc``, ``ensure_targets``) registered as
the FFI targets ``specjax_rows_packed`` (and ``specjax_rows_q4_1`` / ``specjax_rows_q8_0``, ...), so
a program calling the kernel compiles beside the kernel's build; ``ensure()`` builds it and
points the forwarders at it, and raises a one-line SpecjaxError where that is impossible.
``rows_dot_reference`` is the plain-XLA definition the tests hold it to.
"""

from __future__ import annotations

import contextlib
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
import numpy as np

from specjax import ondisk
from specjax.device_arrays import to_device
from specjax.errors import SpecjaxError
from specjax.models.options import ROWS_ACTIVATIONS

LANES = 16  # output columns per packed block
_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rows_dot.cc")
_STUB_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rows_dot_stub.cc")
_HEADER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rows_dot_ffi.h")
_TARGET = "specjax_rows_packed"
_TARGETS = {_TARGET: "SpecjaxRowsPacked", "specjax_rows_q4_1": "SpecjaxRowsQ4_1", "specjax_rows_q8_0": "SpecjaxRowsQ8_0",
            "specjax_rows_q4_1_i8": "SpecjaxRowsQ4_1I8", "specjax_rows_q8_0_i8": "SpecjaxRowsQ8_0I8",
            "specjax_block_attention": "SpecjaxBlockAttention",
            "specjax_rows_q4_1_bf16": "SpecjaxRowsQ4_1Bf16", "specjax_rows_q8_0_bf16": "SpecjaxRowsQ8_0Bf16"}
GROUP = 32  # k values per GGUF quantization group
_lock = threading.Lock()
_loaded: dict = {}  # "ok": True, or "error": why it cannot be built
_stub_lock = threading.Lock()
_stub: dict = {}  # "lib": the forwarders' library once its targets are registered


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _build(cxx: str, march: str | None = "native", src_path: str = _SRC) -> str:
    """The shared library's path (of ``src_path``: the kernel, or its forwarders), compiled for
    ``-march=<march>`` now unless an identical build is
    cached (None: no -march, the kernel's portable loops; the tests and rows_builds.py compare
    other builds with the default one). A cached build is loaded only if it matches the size and
    hash recorded beside it (specjax.ondisk): loading a damaged library is no Python exception
    but a crash (a truncated one: SIGBUS), so one that does not match is built again and replaced.
    Where the cache cannot be used, the build goes to a private temporary directory."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    with open(src_path, "rb") as f, open(_HEADER, "rb") as h:
        src = f.read() + h.read()  # (both sources include the header)
    key = hashlib.sha256(b"\n".join([src, repr(version).encode(), jaxlib.__version__.encode(),
                                     _cpu_flags().encode(), repr(march).encode(), b"recorded"])).hexdigest()[:24]
    cache = ondisk.cache_dir("ext")
    stem = os.path.splitext(os.path.basename(src_path))[0]
    path = None if cache is None else os.path.join(cache, f"{stem}_{key}.so")
    if path is not None and ondisk.verified(path):
        return path
    build_dir = tempfile.mkdtemp(prefix="specjax-rows-")
    tmp = os.path.join(build_dir, f"{stem}_{key}.so")
    cmd = [cxx, "-O3", *([f"-march={march}"] if march else []), "-std=c++17", "-shared", "-fPIC",
           f"-I{jax.ffi.include_dir()}", src_path, "-o", tmp]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        shutil.rmtree(build_dir, ignore_errors=True)
        lines = r.stderr.strip().splitlines() or ["no output"]
        first = next((line for line in lines if "error" in line), lines[-1])
        raise SpecjaxError(f"could not compile the rows kernel ({' '.join(cmd[:2])} ...): {first.strip()[:300]} "
                           "(--rows_kernel 0 runs XLA's dot instead)")
    with open(tmp, "rb") as f:
        built = f.read()
    if path is not None and ondisk.write(path, built):
        shutil.rmtree(build_dir, ignore_errors=True)
        return path
    return tmp  # (no usable cache: loaded from the private build directory, left for the process)


def default_solo_rows() -> int:
    """Activation rows up to which a kernel call (an int8 or bfloat16 projection, the attention)
    runs on the calling thread alone, its outputs the same bits: 3 on a machine of at most 2 CPUs, whose second is
    likely a sibling of the first (the 2-vCPU AVX-512 EPYC's share one core's vector units: waking
    XLA's helper thread for each of a decode step's ~150 calls cost more than it bought; plain
    decoding 1.05-1.09x faster, blocks of 4 rows and more slower alone, BENCHMARKS.md); 0 (always
    split over XLA's threads) elsewhere."""
    return 3 if (os.cpu_count() or 1) <= 2 else 0


_solo = {"rows": None, "libs": []}


def set_solo_rows(rows: int | None = None) -> None:
    """Run calls of at most ``rows`` activation rows on the calling thread alone, in this process
    (None: ``default_solo_rows``). A machine's setting, not a model's: it changes no output bit."""
    _solo["rows"] = default_solo_rows() if rows is None else int(rows)
    for lib in _solo["libs"]:
        lib.specjax_set_solo_rows(ctypes.c_int64(_solo["rows"]))


def _solo_for(lib) -> None:
    _solo["libs"].append(lib)
    lib.specjax_set_solo_rows(ctypes.c_int64(default_solo_rows() if _solo["rows"] is None else _solo["rows"]))


def register(path: str, suffix: str = "") -> None:
    """Load a built library and register its FFI targets, each name followed by ``suffix`` (the
    default build has none; another build beside it, for comparison, takes its own)."""
    lib = ctypes.cdll.LoadLibrary(path)
    _solo_for(lib)
    for target, symbol in _TARGETS.items():
        jax.ffi.register_ffi_target(target + suffix, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")


def _compiler_or_error() -> str:
    cxx = _compiler()
    if cxx is None:
        raise SpecjaxError("the rows kernel needs a C++ compiler (g++), and none was found")
    return cxx


def ensure_targets() -> None:
    """Register the kernel's FFI target names, without waiting for its build: forwarders
    (``rows_dot_stub.cc``: the C API alone, a fraction of a second to build) that ``ensure``
    points at the built handlers. A program calling the kernel may then be compiled or loaded
    beside the kernel's build; it must not run before ``ensure`` returns (until then a call is
    an FFI error, never a wrong result). A one-line error if no compiler is found."""
    with _stub_lock:
        if "lib" in _stub:
            return
        if "error" in _loaded:  # (the kernel's build failed: say why, not that the stub built)
            raise SpecjaxError(_loaded["error"])
        try:
            lib = ctypes.cdll.LoadLibrary(_build(_compiler_or_error(), march=None, src_path=_STUB_SRC))
        except OSError as e:
            raise SpecjaxError(f"could not load the rows kernel's forwarders: {e}") from None
        for i, target in enumerate(_TARGETS):
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, f"specjax_rows_stub_{i}")),
                                        platform="cpu")
        _stub["lib"] = lib


def ensure() -> None:
    """Build (or find) the kernel once per process and point its registered targets at it
    (``ensure_targets``); a one-line error if impossible. A program calling the kernel runs
    only after this returned."""
    with _lock:
        if "ok" in _loaded:
            return
        if "error" not in _loaded:
            try:
                lib = ctypes.cdll.LoadLibrary(_build(_compiler_or_error()))
                _solo_for(lib)
                ensure_targets()
                set_real = _stub["lib"].specjax_rows_stub_set
                set_real.argtypes = (ctypes.c_int, ctypes.c_void_p)
                for i, symbol in enumerate(_TARGETS.values()):
                    if set_real(i, ctypes.cast(getattr(lib, symbol), ctypes.c_void_p)):
                        raise SpecjaxError(f"the rows kernel's forwarders have no slot for {symbol}")
                _loaded["ok"] = True
                return
            except (SpecjaxError, OSError) as e:
                _loaded["error"] = str(e)
        raise SpecjaxError(_loaded["error"])


def simd_class() -> str:
    """The kernel's vector path on this CPU: 'avx512', 'avx2' (with FMA and F16C) or
    'portable'. A step's speed, and the ratio of a verify block's cost to a decode step's, differ
    between them (the AVX-512 EPYC ran SmolLM2's steps ~2.3x faster than the AVX2 one, at
    g / d 0.38 against 0.63), so performance models are keyed by it (perf_model.hardware_key)."""
    flags = set(_cpu_flags().split())
    return "avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma", "f16c"} <= flags else "portable"


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 pairs natively (AVX512_BF16 with AVX512BW): the rows
    kernel's bfloat16 activations run ``vdpbf16ps`` here; elsewhere they are scalar code (the
    same bits, slowly), so the launch scripts' ``--rows_activations auto`` picks them only here."""
    flags = set(_cpu_flags().split())
    return {"avx512_bf16", "avx512bw"} <= flags


def vectorized() -> bool:
    """Whether this CPU runs one of the kernel's vector paths: AVX-512, or AVX2 with FMA and F16C
    (each 16-column block as two 8-lane halves). Elsewhere it runs portable loops, which give the
    same results but were 3-13x slower than XLA's dot (benchmarks/rows_builds.py): a correctness
    fallback, not a speed-up."""
    return simd_class() != "portable"


_trace = threading.local()


@contextlib.contextmanager
def deferred():
    """Tracing a program that calls the kernel, inside, does not wait for its build: the caller
    ensures it before compiling (engine.exe_cache.compile_cached's ``ready``), so a cold build
    runs beside the tracing and lowering. Outside, the trace ensures it (a plain jax.jit).
    Yields ``calls(lowered)``: whether the program lowered inside calls the kernel (one that does
    not, e.g. a prefill chunk on XLA's dot, compiles without waiting for the build); a trace jax
    had cached runs no Python, so then the lowered module's text decides."""
    _trace.deferred, _trace.called = True, False
    try:
        yield lambda lowered: _trace.called or any(t in lowered.as_text() for t in _TARGETS)
    finally:
        _trace.deferred = False


def _traced() -> None:
    if getattr(_trace, "deferred", False):
        _trace.called = True
    else:
        ensure()


def buildable() -> bool:
    """Whether this process may run the kernel, without waiting for its build: a C++ compiler
    is found and no build has failed here. (A launch script decides on the rows kernel with this
    while the build runs in a thread, cli.prebuild_rows_kernel; if that build then fails, the
    first compilation that needs the kernel reports it as a one-line error.)"""
    return "error" not in _loaded and _compiler() is not None  # (no lock: the build holds it)


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


def _column_blocks(a: np.ndarray) -> np.ndarray:
    """[N, G, ...] per output column -> [ceil(N/16), G, ..., 16] (columns padded with zeros)."""
    N = a.shape[0]
    nb = -(-N // LANES)
    a = np.concatenate([a, np.zeros((nb * LANES - N,) + a.shape[1:], a.dtype)]) if nb * LANES != N else a
    a = a.reshape((nb, LANES) + a.shape[1:])
    return np.ascontiguousarray(np.moveaxis(a, 1, -1))


def _pair_rows(codes: np.ndarray) -> np.ndarray:
    """[nb, G, R, 16] code rows -> [nb, G, R / 2, 32]: rows 2p and 2p + 1 interleaved per column
    (byte 2c + j = row 2p + j of column c), the pairs the int8 path's byte multiply-adds read."""
    nb, G, R, L = codes.shape
    return np.ascontiguousarray(codes.reshape(nb, G, R // 2, 2, L).transpose(0, 1, 2, 4, 3).reshape(nb, G, R // 2, 2 * L))


def _unpair_rows(codes: np.ndarray) -> np.ndarray:
    nb, G, P, L2 = codes.shape
    return codes.reshape(nb, G, P, L2 // 2, 2).transpose(0, 1, 2, 4, 3).reshape(nb, G, 2 * P, L2 // 2)


def pack_q4_1(d: np.ndarray, m: np.ndarray, qs: np.ndarray, pairs: bool = False) -> dict:
    """A GGUF Q4_1 weight of N output columns and K = 32 G inputs (d, m float16 [N, G]; qs uint8
    [N, G, 16], byte j holding code j low and code j + 16 high, as the file stores it) packed for
    the kernel: codes [ceil(N/16), G, 16, 16] uint8, scales [ceil(N/16), G, 2, 16] float16.
    ``pairs``: the int8 activations' layout, code rows interleaved in pairs (codes
    [ceil(N/16), G, 8, 32]: the same bytes, read without shuffles by that path)."""
    codes = _column_blocks(np.asarray(qs, np.uint8))
    scales = _column_blocks(np.stack([np.asarray(d, np.float16), np.asarray(m, np.float16)], axis=2))
    return {"codes": to_device(_pair_rows(codes) if pairs else codes), "scales": to_device(scales)}


def pack_q8_0(d: np.ndarray, qs: np.ndarray, pairs: bool = False) -> dict:
    """A GGUF Q8_0 weight (d float16 [N, G], qs int8 [N, G, 32]) packed for the kernel: codes
    [ceil(N/16), G, 32, 16] int8 ([ceil(N/16), G, 16, 32] with ``pairs``), scales
    [ceil(N/16), G, 16] float16."""
    codes = _column_blocks(np.asarray(qs, np.int8))
    return {"codes": to_device(_pair_rows(codes) if pairs else codes),
            "scales": to_device(_column_blocks(np.asarray(d, np.float16)))}


def packed_format(wp) -> str:
    """"f32", "q4_1" or "q8_0": which of the kernel's weight formats ``wp`` is."""
    if isinstance(wp, dict):
        return "q8_0" if wp["codes"].dtype == jnp.int8 else "q4_1"
    return "f32"


def paired(wp) -> bool:
    """Whether a GGUF pack is in the int8 activations' layout (``pairs``)."""
    return isinstance(wp, dict) and wp["codes"].shape[-1] == 2 * LANES


def dequantize_packed(wp, n: int) -> np.ndarray:
    """The [K, n] float32 weight a packed one stands for (numpy; the reference for the tests):
    q * d (+ m), rounded as the GGUF loader's dequantization rounds."""
    fmt = packed_format(wp)
    if fmt == "f32":
        a = np.asarray(wp)
        return a.transpose(1, 0, 2).reshape(a.shape[1], -1)[:, :n]
    codes, scales = np.asarray(wp["codes"]), np.asarray(wp["scales"]).astype(np.float32)
    codes = _unpair_rows(codes) if paired(wp) else codes
    nb, G = codes.shape[:2]
    if fmt == "q8_0":
        w = codes.astype(np.float32) * scales[:, :, None, :]  # [nb, G, 32, 16]
    else:
        q = np.concatenate([codes & 15, codes >> 4], axis=2).astype(np.float32)  # [nb, G, 32, 16]
        w = q * scales[:, :, 0:1, :] + scales[:, :, 1:2, :]
    return w.transpose(1, 2, 0, 3).reshape(G * GROUP, nb * LANES)[:, :n]


def stack_packs(packs: list):
    """One pack per layer (the same format and shape) -> one pack of [L, ...] stacks, which
    ``rows_dot`` reads a layer of by index."""
    if isinstance(packs[0], dict):
        return {k: to_device(np.stack([np.asarray(p[k]) for p in packs])) for k in packs[0]}
    return to_device(np.stack([np.asarray(p) for p in packs]))


def concat_stacks(stacks: list):
    """Stacked packs (``stack_packs``) of the same format, layout, layers and inputs -> one stack
    whose column blocks are theirs in turn: the kernel then computes every member's outputs in
    one call, each output column summed as in its own (the same bits). Members must fill whole
    blocks (no padded columns between them); ``None`` where they do not match."""
    fmts = {packed_format(p) for p in stacks}
    if len(fmts) != 1:
        return None
    parts = [p if isinstance(p, dict) else {"w": p} for p in stacks]
    keys = parts[0].keys()
    if any(p.keys() != keys or any(p[k].shape[:1] + p[k].shape[2:] != parts[0][k].shape[:1] + parts[0][k].shape[2:]
                                   or p[k].dtype != parts[0][k].dtype for k in keys) for p in parts):
        return None
    out = {k: jnp.concatenate([p[k] for p in parts], axis=1) for k in keys}
    return out if isinstance(stacks[0], dict) else out["w"]


def stack_width(wp) -> int:
    """The output columns a stacked pack holds, padding included (its blocks x 16)."""
    return (wp["codes"] if isinstance(wp, dict) else wp).shape[1] * LANES


def layer_of(wp, layer: int):
    """Layer ``layer`` of a stacked pack (``stack_packs``) as a pack of its own (a copy)."""
    return {k: v[layer] for k, v in wp.items()} if isinstance(wp, dict) else wp[layer]


def rows_dot(x: jax.Array, wp, n: int, activations: str = "float32", layer=None) -> jax.Array:
    """``x @ w`` for x [..., K] float32 and ``wp`` a packed w [K, n] (``pack``, ``pack_q4_1`` or
    ``pack_q8_0``), through the kernel. ``activations``: how a GGUF
    weight (q4_1 / q8_0) multiplies the rows of x: "float32" as they are; "int8" each row rounded
    to int8 per group of 32 (``quantize_rows``; the model ``rows_dot_int8_reference`` defines);
    "bfloat16" each value rounded to bfloat16 (``rows_dot_bf16_reference``); the last two read packs
    made with ``pairs``. A float32 pack ignores it. ``layer``: ``wp`` is a
    stack of one pack per layer (``stack_packs``) and this (an int or a traced int32 scalar)
    picks one; the kernel reads it in place, so a scan over layers slices no weights."""
    _traced()
    act = activations
    if act not in ROWS_ACTIVATIONS:
        raise SpecjaxError(f"unknown rows activations {act!r} (expected one of {', '.join(ROWS_ACTIVATIONS)})")
    fmt = packed_format(wp)
    if fmt != "f32" and paired(wp) != (act != "float32"):
        raise SpecjaxError(f"a {fmt} pack {'in' if paired(wp) else 'not in'} the paired layout with "
                           f"{act} activations: int8 and bfloat16 read packs made with pairs=True, float32 without")
    operands = (wp,) if fmt == "f32" else (wp["codes"], wp["scales"])
    if x.dtype != jnp.float32 or (fmt == "f32" and wp.dtype != jnp.float32):
        raise SpecjaxError(f"the rows kernel is float32 only, got {x.dtype} x {operands[0].dtype}")
    lead, K = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, K)
    target = _TARGET if fmt == "f32" else f"specjax_rows_{fmt}" + {"float32": "", "int8": "_i8", "bfloat16": "_bf16"}[act]
    index = () if layer is None else (jnp.asarray(layer, jnp.int32).reshape(()),)
    y = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((flat.shape[0], n), jnp.float32))(flat, *operands, *index)
    return y.reshape(*lead, n)


def quantize_rows(x: np.ndarray):
    """Each row of x [M, K] rounded to int8 per group of 32 (numpy; the reference of the kernel's
    int8 path, as llama.cpp rounds activations): codes [M, K] int8 = x * 127 / amax to nearest,
    ties to even, and scales dx [M, K/32] = amax / 127 float32 (0 for an all-zero group)."""
    g = np.asarray(x, np.float32).reshape(x.shape[0], -1, GROUP)
    amax = np.abs(g).max(axis=2)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.rint(g * inv[:, :, None]), -127, 127).astype(np.int8)
    return q.reshape(x.shape), (amax / np.float32(127)).astype(np.float32)


def _group_codes(wp) -> tuple[np.ndarray, np.ndarray]:
    """A q4_1 / q8_0 pack's integer codes [nb, G, 32, 16] (k in order within each group; int64) and
    its scales as float32, whichever layout it is in (the references' common first step)."""
    codes, scales = np.asarray(wp["codes"]), np.asarray(wp["scales"]).astype(np.float32)
    codes = _unpair_rows(codes) if paired(wp) else codes
    if packed_format(wp) == "q8_0":
        return codes.astype(np.int64), scales
    return np.concatenate([codes & 15, codes >> 4], axis=2).astype(np.int64), scales


def rows_dot_int8_reference(x: np.ndarray, wp, n: int) -> np.ndarray:
    """What ``rows_dot(x, wp, n, activations="int8")`` computes for a q4_1 / q8_0 pack (numpy): the dot
    product of the rounded rows (``quantize_rows``) with the weights, per group an exact integer
    sum S = sum xq * q, added over groups in order as (d * dx) * S (+ m * dx * sum xq for q4_1).
    float64 stands in for the kernel's fused multiply-adds, so it agrees to rounding, not bits."""
    fmt = packed_format(wp)
    q, dx = quantize_rows(np.asarray(x, np.float32))
    M, G = dx.shape
    wq, scales = _group_codes(wp)
    S = np.einsum("mgk,bgkl->mgbl", q.reshape(M, G, GROUP).astype(np.int64), wq)  # [M, G, nb, 16]
    d = scales[:, :, 0, :] if fmt == "q4_1" else scales  # [nb, G, 16]
    dd = (d.transpose(1, 0, 2)[None] * dx[:, :, None, None]).astype(np.float32)  # rounded as the kernel
    terms = dd.astype(np.float64) * S
    if fmt == "q4_1":
        sx = (dx * q.reshape(M, G, GROUP).astype(np.int32).sum(axis=2).astype(np.float32)).astype(np.float32)
        terms = terms + scales[:, :, 1, :].transpose(1, 0, 2)[None].astype(np.float64) * sx[:, :, None, None]
    y = terms.sum(axis=1).reshape(M, -1)[:, :n]
    return y.astype(np.float32)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16; numpy): to nearest, ties to even, magnitudes below float32's
    smallest normal to zero (sign kept), NaN to a quiet NaN (the kernel's rounding, to_bf16)."""
    u = np.asarray(x, np.float32).view(np.uint32)
    sign = (u >> 16) & 0x8000
    b = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint32)
    b = np.where((u & 0x7F800000) == 0, sign, b)
    b = np.where((u & 0x7FFFFFFF) > 0x7F800000, sign | 0x7FC0, b)
    return b.astype(np.uint16)


def _from_bf16(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def rows_dot_bf16_reference(x: np.ndarray, wp, n: int) -> np.ndarray:
    """What ``rows_dot(x, wp, n, activations="bfloat16")`` computes for a q4_1 / q8_0 pack (numpy,
    float32 steps in the kernel's order, so the same bits): per group, A and B (k = 0-15, 16-31)
    summed pair by pair, the odd k of a pair added before the even one (vdpbf16ps's order), results
    below the smallest normal flushed to zero; y += d * (A + B), then (q4_1) y += m * sx, each a
    fused multiply-add (here the exact float64 product plus y, rounded to float64 and then to float32:
    the fused result but for a double rounding, about once in 2^29)."""
    fmt = packed_format(wp)
    xb = _from_bf16(round_bf16(x))  # [M, K]
    M, K = xb.shape
    G = K // GROUP
    q, scales = _group_codes(wp)
    q = q.astype(np.float32)
    xg = xb.reshape(M, G, GROUP)
    tiny = np.float32(1.17549435e-38)

    def ftz(a):
        return np.where(np.abs(a) < tiny, np.copysign(np.float32(0), a), a).astype(np.float32)

    halves = []
    for h in range(2):
        a = np.zeros((M, G) + q.shape[:1] + q.shape[3:], np.float32)  # [M, G, nb, 16]
        for p in range(8):
            for k in (16 * h + 2 * p + 1, 16 * h + 2 * p):
                a = ftz(a + xg[:, :, k, None, None] * q[:, :, k, :].transpose(1, 0, 2)[None])
        halves.append(a)
    S = (halves[0] + halves[1]).astype(np.float32)
    d = (scales[:, :, 0, :] if fmt == "q4_1" else scales).transpose(1, 0, 2)[None]  # [1, G, nb, 16]
    t = xg.copy()  # the group sums' tree: lanes j and j + 16, then halves
    s16 = (t[:, :, :16] + t[:, :, 16:]).astype(np.float32)
    for w in (8, 4, 2, 1):
        s16 = (s16[:, :, :w] + s16[:, :, w:2 * w]).astype(np.float32)
    sx = s16[:, :, 0]  # [M, G]
    y = np.zeros((M,) + S.shape[2:], np.float32)
    for g in range(G):
        y = (d[:, g].astype(np.float64) * S[:, g] + y).astype(np.float32)
        if fmt == "q4_1":
            y = (scales[:, g, 1, :][None].astype(np.float64) * sx[:, g, None, None] + y).astype(np.float32)
    return y.reshape(M, -1)[:, :n]


def block_attention(q, k_blk, v_blk, k_all, v_all, layer, lengths, block_mask) -> jax.Array:
    """The decode / verify block's attention (models.attention.block_attention_xla's definition:
    q [B, T, H, hd] over ``k_all[layer]``'s first ``lengths[b]`` slots and the block's own k/v
    under ``block_mask``) on the CPU, float32: every query row's keys as one list in position
    order, so a token's output has the same bits in a decode step as in a verify block.
    ``layer``: an int or a traced int32 scalar (a scan's loop counter)."""
    _traced()
    if q.dtype != jnp.float32 or k_all.dtype != jnp.float32:
        raise SpecjaxError(f"the CPU block attention is float32 only, got {q.dtype} / {k_all.dtype}")
    return jax.ffi.ffi_call("specjax_block_attention", jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q, k_blk, v_blk, k_all, v_all, lengths.astype(jnp.int32), block_mask, jnp.asarray(layer, jnp.int32).reshape(()))


def rows_dot_reference(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.dot(x, w, preferred_element_type=jnp.float32)
