"""On-disk state specjax reads back (issue 33): a damaged cache entry is never loaded (one warning,
rebuilt, replaced) and a cache location that cannot be used is one warning and a run without it.
The random-damage property is tests/test_ondisk_fuzz.py."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import ondisk
from specjax.engine import exe_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# In a subprocess: build (or find) the rows kernel, run it, compare with XLA's dot.
ROWS_RUN = """
import logging, sys
import jax, jax.numpy as jnp, numpy as np
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
from specjax.models.cpu import rows_dot as rd
rd.ensure()
x = jax.random.normal(jax.random.PRNGKey(0), (3, 64))
w = jax.random.normal(jax.random.PRNGKey(1), (64, 40))
got = np.asarray(rd.rows_dot(x, rd.pack(w), 40))
np.testing.assert_allclose(got, np.asarray(rd.rows_dot_reference(x, w)), rtol=1e-5, atol=1e-5)
print("rows ok")
"""


def _rows_subprocess(cache: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, SPECJAX_CACHE_DIR=cache, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", ROWS_RUN], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def rows_cache(tmp_path_factory):
    """A cache directory holding a good build of the rows kernel (built once, in a subprocess)."""
    cache = str(tmp_path_factory.mktemp("rows_cache"))
    r = _rows_subprocess(cache)
    assert r.returncode == 0 and "rows ok" in r.stdout, r.stderr[-2000:]
    return cache


@pytest.mark.parametrize("damage", ["truncate", "another_library"])
def test_a_damaged_rows_library_is_rebuilt_not_loaded(rows_cache, tmp_path, damage):
    """The issue's bus error: a cut-short kernel library in the cache crashed every later run
    (exit 135) when ctypes loaded it. Now its recorded hash is checked first: one warning, a
    rebuild that replaces it, and the kernel runs. In a subprocess, so a crash cannot take pytest."""
    import shutil

    cache = str(tmp_path / "cache")
    shutil.copytree(rows_cache, cache)
    (lib,) = [os.path.join(cache, "ext", f) for f in os.listdir(os.path.join(cache, "ext"))
              if f.endswith(".so") and "stub" not in f]  # the kernel (beside it: its forwarders)
    good = open(lib, "rb").read()
    if damage == "truncate":  # as a full disk or an interrupted copy leaves it
        with open(lib, "r+b") as f:
            f.truncate(len(good) // 2)
    else:  # a valid shared library, but not this one (it would load, without the kernel's symbols)
        shutil.copyfile(next(p for p in ("/lib/x86_64-linux-gnu/libm.so.6", "/usr/lib/x86_64-linux-gnu/libm.so.6",
                                         "/lib64/libm.so.6") if os.path.exists(p)), lib)
    r = _rows_subprocess(cache)
    assert r.returncode == 0 and "rows ok" in r.stdout, (r.returncode, r.stderr[-2000:])
    warnings = [line for line in r.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and lib in warnings[0] and "does not match" in warnings[0]
    assert open(lib, "rb").read() == good and ondisk.verified(lib)  # replaced by the rebuild


def test_an_uncreatable_cache_location_is_one_warning_and_the_kernel_still_builds(tmp_path):
    """SPECJAX_CACHE_DIR that cannot be created: the rows kernel is built into a private
    directory and runs (it was unavailable before: makedirs failed)."""
    r = _rows_subprocess("/proc/specjax-nope")
    assert r.returncode == 0 and "rows ok" in r.stdout, (r.returncode, r.stderr[-2000:])
    warnings = [line for line in r.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "/proc/specjax-nope" in warnings[0] and "running without the cache" in warnings[0]


@pytest.mark.parametrize("where", ["proc", "under_a_file"])
def test_an_uncreatable_cache_location_is_one_warning_and_the_run_goes_on(tiny, tmp_path, monkeypatch, caplog, where):
    """A launch script's cache setup with SPECJAX_CACHE_DIR that cannot be created (was: a
    FileNotFoundError traceback from os.makedirs when the first generator was built): one warning,
    no cache, and generation is exact."""
    from specjax import runtime
    from specjax.drafters.prompt_lookup import PromptLookupDrafter
    from specjax.reference_ar import reference_generate
    from specjax.spec_generate import SpecGenerator

    if where == "proc":
        root = "/proc/specjax-nope"
    else:
        (tmp_path / "file").write_text("not a directory")
        root = str(tmp_path / "file" / "cache")
    monkeypatch.setenv("SPECJAX_CACHE_DIR", root)
    monkeypatch.setattr(exe_cache, "_DIRECTORY", None)  # (restored after the test)
    monkeypatch.setattr(ondisk, "_warned", set())
    cfg, params = tiny
    with caplog.at_level(logging.WARNING):
        where = runtime.enable_compilation_cache()
        gen = SpecGenerator(cfg, params, drafter=PromptLookupDrafter(), batch_buckets=(1,), k_buckets=(0, 2),
                            slot_buckets=(64,))
        got = gen.generate([[5, 6, 7, 5, 6]], max_new_tokens=8, num_spec_tokens=2)
    want = reference_generate(cfg, params, [[5, 6, 7, 5, 6]], max_new_tokens=8)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert where is None and exe_cache.default() is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and root in warnings[0] and "running without the cache" in warnings[0]


def test_a_cached_executable_swapped_for_another_is_compiled_again(tmp_path, caplog):
    """An entry of the executable cache holding another executable of the same signature (a file
    copied over it, with or without its record) was loaded and run: the wrong function. Now it
    does not verify: one warning, compiled again, replaced."""
    import shutil

    cache = exe_cache.ExecutableCache(str(tmp_path))
    x = jnp.arange(6, dtype=jnp.float32)
    double, shift = jax.jit(lambda v: v * 2), jax.jit(lambda v: v + 100)
    for what, fn in (("double", double), ("shift", shift)):
        exe_cache.compile_cached(cache, what, fn, (x,))
    d, s = cache.entry("double", (x,)), cache.entry("shift", (x,))
    for with_record in (False, True):
        shutil.copyfile(tmp_path / s, tmp_path / d)
        if with_record:
            shutil.copyfile(tmp_path / (s + ondisk.RECORD), tmp_path / (d + ondisk.RECORD))
        ondisk._warned.discard("verify:" + str(tmp_path / d))
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            exe = exe_cache.compile_cached(cache, "double", double, (x,))
        np.testing.assert_array_equal(exe(x), np.arange(6) * 2)
        assert [r.getMessage() for r in caplog.records] == [
            f"ignoring {tmp_path / d}: it does not match the size and hash recorded when it was written "
            "(damaged or incomplete)"]
        assert cache.load(d) is not None  # the recompiled one replaced it


def test_a_command_imports_the_engine_before_its_prefetch_thread_starts():
    """cli.prefetch_executables imports, in the caller's thread, the engine modules whose classes
    the cached programs' trees name (through specjax.goodput), so the loading thread's unpickling
    never races the caller's own imports (a half-built module). In a fresh process, with the
    thread's start stubbed out: the modules are there all the same."""
    code = ("import sys\nfrom absl import flags\nfrom specjax import cli\nfrom specjax.engine import exe_cache\n"
            "flags.FLAGS(['t'])\nexe_cache.prefetch = lambda *a, **k: None\nbefore = 'specjax.goodput.selector' in sys.modules\n"
            "cli.prefetch_executables()\nprint(before, 'specjax.goodput.selector' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True"]


def test_a_command_prefetches_the_executables_its_last_run_used_first(tmp_path, monkeypatch):
    """exe_cache.prefetch: a run remembers (at exit) the entries it used first; the next run of
    the same command starts loading them in a thread, and compile_cached hands out the loaded
    executable without tracing the function again. Another command prefetches nothing."""
    import atexit

    traces = []

    @jax.jit
    def triple(v):
        traces.append(1)
        return v * 3

    x = jnp.arange(4, dtype=jnp.float32)
    monkeypatch.setattr(exe_cache, "_DIRECTORY", str(tmp_path))
    monkeypatch.setattr(exe_cache, "_used", [])
    monkeypatch.setattr(exe_cache, "_prefetched", {})
    at_exit = []
    monkeypatch.setattr(atexit, "register", at_exit.append)

    exe_cache.prefetch("run --flag=1")  # (nothing remembered yet)
    assert exe_cache._prefetched == {}
    exe_cache.compile_cached(exe_cache.default(), "triple", triple, (x,))
    assert len(traces) == 1
    at_exit.pop()()  # the first run exits

    monkeypatch.setattr(exe_cache, "_used", [])
    exe_cache.prefetch("run --flag=2")
    assert exe_cache._prefetched == {}
    exe_cache.prefetch("run --flag=1")
    (name,) = exe_cache._prefetched
    assert name == exe_cache.default().entry("triple", (x,))
    exe = exe_cache.compile_cached(exe_cache.default(), "triple", triple, (x,))
    np.testing.assert_array_equal(exe(x), np.arange(4) * 3)
    assert len(traces) == 1 and exe_cache._prefetched == {}
