"""Fixtures shared across test modules."""

from __future__ import annotations

import pytest

from specjax.config import get_model_config
from specjax.models import llama


@pytest.fixture(scope="module")
def tiny():
    """The tiny random-weight Llama (configs/tiny-random.json) and its params, seed 0."""
    cfg = get_model_config("tiny-random")
    return cfg, llama.init_random_params(cfg, seed=0)
