"""The on-disk fuzz property (issue 33): cache and checkpoint files damaged at random (truncated,
bytes flipped, replaced with another of the files, deleted), data and records alike, and the
work that reads them back completes with exactly a clean run's outputs, never loading what was
damaged.

  - the executable cache (engine.exe_cache, through specjax.ondisk) of three small jitted
    functions: every function, loaded or compiled again, gives the clean outputs, and afterwards
    every entry verifies again (the damaged ones were replaced);
  - a distillation checkpoint directory (distill.checkpoint, the real open_draft / restore on the
    tiny model's one-layer draft, three steps and draft.json): the restore gives exactly the
    newest step whose files and record are untouched, or None (a fresh start) when none is.

The rows kernel's library is loaded with ctypes and can only be damaged in a subprocess:
tests/test_ondisk.py. A longer hunt: SPECJAX_FUZZ_EXAMPLES=2000 (the default: 200 + 80 damaged states).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from specjax import ondisk
from specjax.engine import exe_cache

SCALE = int(os.environ.get("SPECJAX_FUZZ_EXAMPLES", "0")) or None
FUZZ = dict(deadline=None, derandomize=SCALE is None, suppress_health_check=list(HealthCheck), database=None)
OPS = ("truncate", "flip", "replace", "delete")


def _files(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def _damage(root: str, draws) -> None:
    """Apply ``draws`` ((file index, op, position fraction, byte), ...) to the files under ``root``."""
    for index, op, frac, byte in draws:
        files = _files(root)
        if not files:
            return
        index = (index + 1) * 2654435761 % 2**32  # (spread the small ints hypothesis favours over the files)
        path = os.path.join(root, files[index % len(files)])
        data = open(path, "rb").read()
        if op == "delete":
            os.unlink(path)
        elif op == "truncate":
            with open(path, "r+b") as f:
                f.truncate(int(frac * len(data)))  # (strictly shorter: frac < 1)
        elif op == "flip" and data:
            b = bytearray(data)
            b[int(frac * len(b))] ^= byte
            open(path, "wb").write(bytes(b))
        elif op == "replace":
            other = os.path.join(root, files[(index + byte) % len(files)])
            if other != path:
                shutil.copyfile(other, path)


damages = st.lists(st.tuples(st.integers(0, 10_000), st.sampled_from(OPS),
                             st.floats(0, 1, exclude_max=True), st.integers(1, 255)), min_size=1, max_size=4)


def _snapshot(root: str) -> dict:
    return {f: open(os.path.join(root, f), "rb").read() for f in _files(root)}


@pytest.fixture(autouse=True)
def _quiet(caplog):
    caplog.set_level(logging.ERROR)  # (each damaged file is one warning; thousands of them here)


# ---------------------------------------------------------------- the executable cache

X = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
FUNCTIONS = {
    "square": (jax.jit(lambda v: v * v), (X,)),
    "rowsum": (jax.jit(lambda v: v.sum(axis=1)), (X,)),
    "affine": (jax.jit(lambda v, w: v @ w + 1), (X, jnp.ones((4, 2), jnp.float32))),
}


@pytest.fixture(scope="module")
def exe_dir(tmp_path_factory):
    """A cache holding every function's executable, and the clean outputs."""
    root = str(tmp_path_factory.mktemp("exe"))
    cache = exe_cache.ExecutableCache(root)
    clean = {name: np.asarray(exe_cache.compile_cached(cache, name, fn, args)(*args))
             for name, (fn, args) in FUNCTIONS.items()}
    assert len(_files(root)) == 2 * len(FUNCTIONS)  # each entry and its record
    return root, clean


@settings(max_examples=SCALE or 200, **FUZZ)
@given(draws=damages)
def test_damaged_executable_cache_gives_the_clean_outputs(exe_dir, draws):
    src, clean = exe_dir
    with tempfile.TemporaryDirectory() as root:
        shutil.copytree(src, root, dirs_exist_ok=True)
        _damage(root, draws)
        cache = exe_cache.ExecutableCache(root)
        for name, (fn, args) in FUNCTIONS.items():
            np.testing.assert_array_equal(exe_cache.compile_cached(cache, name, fn, args)(*args), clean[name])
        # every entry is whole again: loaded as it was, or compiled anew and written in its place
        for name, (_, args) in FUNCTIONS.items():
            assert ondisk.read(os.path.join(root, cache.entry(name, args))) is not None


# ---------------------------------------------------------------- distillation checkpoints

STEPS = (1, 2, 3)


@pytest.fixture(scope="module")
def ck_dir(tiny, tmp_path_factory):
    """A checkpoint directory of the tiny model's one-layer self-draft with three steps (the
    trainable params shifted by the step number), and each step's leaves."""
    from specjax.distill import train as tr
    from specjax.distill.checkpoint import open_draft

    cfg, params = tiny
    root = str(tmp_path_factory.mktemp("ck") / "draft")
    td, ck = open_draft(root, cfg, params, 1)
    opt = tr.make_optimizer(tr.TrainConfig())
    saved = {}
    for s in STEPS:
        trainable = jax.tree_util.tree_map(lambda a: a + s, td.trainable)
        state = opt.init(trainable)
        ck.save(s, trainable, state, {"finished": s, "updates": s, "dropped": 0})
        saved[s] = [np.asarray(a) for a in jax.tree_util.tree_leaves((trainable, state))]
    return root, saved, opt


@settings(max_examples=SCALE or 80, **FUZZ)
@given(draws=damages)
def test_damaged_checkpoints_restore_the_newest_intact_step(tiny, ck_dir, draws):
    from specjax.distill.checkpoint import open_draft

    src, saved, opt = ck_dir
    cfg, params = tiny
    before = _snapshot(src)
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "draft")
        shutil.copytree(src, root)
        _damage(root, draws)
        after = _snapshot(root)

        def intact(s):  # every file of the step and its record byte for byte as written
            mine = [f for f in before if f == f"{s}{ondisk.RECORD}" or f.startswith(f"{s}/")]
            return all(after.get(f) == before[f] for f in mine)

        want = next((s for s in sorted(STEPS, reverse=True) if intact(s)), None)
        event(f"restores step {want}")
        td, ck = open_draft(root, cfg, params, 1)
        got = ck.restore(td.trainable, opt.init(td.trainable))
        if want is None:
            assert got is None
            return
        step, trainable, state, record = got
        assert step == want and record == {"finished": want, "updates": want, "dropped": 0}
        for a, b in zip(jax.tree_util.tree_leaves((trainable, state)), saved[want]):
            np.testing.assert_array_equal(a, b)
