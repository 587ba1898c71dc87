"""Fixtures shared across test modules."""

from __future__ import annotations

import gc

import jax
import pytest

from specjax.config import get_model_config
from specjax.models import llama


@pytest.fixture(scope="module")
def tiny():
    """The tiny random-weight Llama (configs/tiny-random.json) and its params, seed 0."""
    cfg = get_model_config("tiny-random")
    return cfg, llama.init_random_params(cfg, seed=0)


@pytest.fixture(scope="module", autouse=True)
def _release_executables():
    """After each module, drop the executables jax.jit cached for it: every XLA:CPU executable
    holds its code in memory maps of its own, and one process running the whole suite would
    otherwise reach vm.max_map_count (the engine then refuses to compile, check_map_budget)."""
    yield
    jax.clear_caches()
    gc.collect()
