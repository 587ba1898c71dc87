"""Compiled executables on disk, found without tracing the model.

jax's persistent compilation cache is keyed by the lowered module, so a warm run still traces
and lowers every executable before it can look one up: for SmolLM2's 30 layers that is about
half a second per prefill or step, most of a warm first answer. This cache is keyed by what
determines that module instead, so a hit skips tracing, lowering and compiling:

  - the executable's static description (its ``CompileKey``, or a row operation's tuple),
  - the arguments' tree structure, shapes and dtypes,
  - jax and jaxlib versions, the backend and its device kind, ``XLA_FLAGS`` and the jax settings
    that change lowering (default matmul precision, x64),
  - a digest of specjax's own source (any code change makes every old entry unreachable).

Launch scripts turn it on through ``runtime.enable_compilation_cache``, which leaves jax's own
persistent cache off (see ``default``).
A launch script also asks for the executables the last run of the same command (flags other than
its text and files) loaded first (``prefetch``): they are deserialized in a thread while the model
loads, instead of after it (SmolLM2's 16-step decode call takes a second to deserialize on a
2-core CPU, which a warm first answer waited for).
Only single-device executables are stored: a sharded one's placement is not in its key. Each
entry is written atomically with its size and hash recorded beside it (specjax.ondisk) and read
back only if it matches; one that cannot be written (an executable holding a host callback, say)
or that does not verify (truncated, flipped, another entry's file) is compiled again and replaced.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import json
import logging
import os
import pickle
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import jaxlib

from specjax import ondisk

log = logging.getLogger(__name__)

_ROOTS = ("specjax", "kernels_pallas")  # the packages whose code is compiled into executables


@functools.lru_cache(maxsize=None)
def code_digest() -> str:
    """SHA-256 over every .py file of the packages whose code ends up in an executable."""
    h = hashlib.sha256()
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for root in _ROOTS:
        base = os.path.join(here, root)
        for dirpath, dirnames, files in os.walk(base):
            dirnames.sort()
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    h.update(os.path.relpath(path, here).encode())
                    with open(path, "rb") as fh:
                        h.update(fh.read())
    return h.hexdigest()


def _aval(x) -> str:
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None:  # a Python scalar argument
        return type(x).__name__
    return f"{tuple(shape)}:{jax.numpy.dtype(dtype).name}:{getattr(x, 'weak_type', False)}"


class ExecutableCache:
    """Executables in ``path`` (a directory that exists and is writable: ``default``), each
    written and read back through ``specjax.ondisk`` (verified against the size and hash recorded
    beside it)."""

    def __init__(self, path: str):
        self.path = path

    def entry(self, what, args) -> str:
        """The file name of an executable described by ``what`` (hashable, a stable repr) compiled
        for ``args``."""
        leaves, tree = jax.tree_util.tree_flatten(args)
        dev = jax.devices()[0]
        parts = [repr(what), str(tree), ";".join(_aval(x) for x in leaves), jax.__version__, jaxlib.__version__,
                 jax.default_backend(), dev.device_kind, os.environ.get("XLA_FLAGS", ""),
                 str(jax.config.jax_default_matmul_precision), str(jax.config.jax_enable_x64), code_digest()]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest() + ".exe"

    def has(self, name: str) -> bool:
        """Whether an entry is stored (written with its record; a damaged one is found at load
        and compiled again)."""
        path = os.path.join(self.path, name)
        return os.path.exists(path) and os.path.exists(path + ondisk.RECORD)

    def load(self, name: str):
        path = os.path.join(self.path, name)
        blob = ondisk.read(path)  # None when absent or damaged (logged once): compiled again and replaced
        if blob is None:
            return None
        try:
            from jax.experimental.serialize_executable import deserialize_and_load

            payload, in_tree, out_tree = pickle.loads(blob)
            # on the one device it was compiled for: by default jax would spread it over every
            # device of the process (a machine with several GPUs, or fake CPU devices), and each
            # call would then fail for want of a shard per device
            return deserialize_and_load(payload, in_tree, out_tree, execution_devices=jax.local_devices()[:1])
        except Exception as e:  # intact but not loadable here (jaxlib refuses it): compile again
            log.warning("ignoring unloadable cached executable %s (%s: %s)", path, type(e).__name__, e)
            return None

    def save(self, name: str, exe) -> None:
        try:
            from jax.experimental.serialize_executable import serialize

            blob = pickle.dumps(serialize(exe))
        except Exception as e:  # not serializable (e.g. a host callback inside): just not cached
            log.info("executable not cached (%s: %s)", type(e).__name__, e)
            return
        ondisk.write(os.path.join(self.path, name), blob)


_DIRECTORY: str | None = None
_FIRST = 8  # executables a run remembers for the next run of its command to prefetch
_used: list = []  # [entry name, whether it calls a registered FFI target], in the order first used
_prefetched: dict[str, Future] = {}


def set_directory(path: str | None) -> None:
    """Where StepTables created from now on keep their executables (None: nowhere)."""
    global _DIRECTORY
    _DIRECTORY = path


def default() -> ExecutableCache | None:
    """The cache runtime.enable_compilation_cache set up, or None. Also None when jax's own
    persistent cache is on (a user's setting): executables jax reloads from it are broken once
    serialized again (jaxlib 0.10: "Function ... not found" when run), and a compile here may be
    such a reload."""
    if _DIRECTORY is None or jax.config.jax_compilation_cache_dir:
        return None
    return ExecutableCache(_DIRECTORY)


def _use(name: str, registers: bool) -> None:
    if len(_used) < _FIRST and all(n != name for n, _ in _used):
        _used.append([name, registers])


def _load(cache: ExecutableCache, name: str):
    """``cache.load(name)``, or the prefetched executable: waited for if its load has started,
    loaded here if it has not."""
    fut = _prefetched.pop(name, None)
    if fut is not None and not fut.cancel():
        exe = fut.result()
        if exe is not None:
            return exe
    return cache.load(name)


def prefetch(job: str, register=None) -> None:
    """Start loading, one after another in a thread, the executables the last run of ``job`` (a
    command's identity) used first, and remember this run's for the next one (written at exit).
    ``register()`` runs first if any of them calls an FFI target (the CPU rows kernel's names)."""
    cache = default()
    if cache is None:
        return
    path = os.path.join(cache.path, "first-" + hashlib.sha256(job.encode()).hexdigest()[:32] + ".json")
    atexit.register(lambda: _used and ondisk.write(path, json.dumps(_used).encode()))
    blob = ondisk.read(path) if os.path.exists(path) else None
    names = [(n, r) for n, r in (json.loads(blob) if blob else []) if cache.has(n)]
    if not names:
        return
    pool = ThreadPoolExecutor(1, thread_name_prefix="specjax-prefetch")
    registered = threading.Event()

    def load(name, registers):
        if registers and not registered.is_set():
            try:
                register()
            except Exception:  # (the caller's own register then says why)
                return None
            registered.set()
        return cache.load(name)

    for name, registers in names:
        if registers and register is None:
            continue
        _prefetched[name] = pool.submit(load, name, registers)
    pool.shutdown(wait=False)


def compile_cached(cache: ExecutableCache | None, what, fn, args, ready=None, lowering=contextlib.nullcontext,
                   register=None, remember: bool = True, **static):
    """``fn.lower(*args, **static).compile()``, through ``cache`` when there is one. ``ready()``,
    if given, runs before the program is returned (what it calls loaded, e.g. the CPU rows
    kernel), and ``register()`` before it is compiled or loaded (what it calls known to XLA by
    name; without it ``ready`` runs then). The lowering runs inside ``lowering()``; where that
    context yields a callable, both run only if it returns true for the lowered program (the
    program calls what they provide), and a program loaded from disk counts as calling it.
    ``remember``: count it among the executables ``prefetch`` loads early next run (not a
    stand-in, engine.table.StepTable.stand_in: the next run loads the step it stood in for)."""
    register = register or ready

    def build():
        with lowering() as calls:
            lowered = fn.lower(*args, **static)
        needs = ready is not None and (calls is None or calls(lowered))
        if needs:
            register()
        exe = lowered.compile()
        if needs:
            ready()
        return exe

    if cache is None:
        return build()
    name = cache.entry(what, args)
    if remember:
        _use(name, ready is not None)
    if ready is not None and cache.has(name):
        register()
    exe = _load(cache, name)
    if exe is None:
        exe = build()
        cache.save(name, exe)
    elif ready is not None:
        ready()
    return exe
