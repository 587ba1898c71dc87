"""What every generation path returns, and the request checks they all apply."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from specjax.config import ModelConfig
from specjax.errors import require


@dataclasses.dataclass
class GenerationResult:
    tokens: list[int]
    finish_reason: str  # "eos" | "length"
    prompt_len: int
    prefill_s: float = 0.0
    decode_s: float = 0.0


def validate_request(prompt: Sequence[int], max_new_tokens: int, cfg: ModelConfig) -> None:
    require(len(prompt) > 0, "empty prompt: give at least one token of input")
    require(max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {max_new_tokens}")
    require(len(prompt) < cfg.max_position,
            f"prompt has {len(prompt)} tokens but {cfg.name}'s context is {cfg.max_position}")
    bad = [t for t in prompt if not 0 <= int(t) < cfg.vocab_size]
    require(not bad, f"prompt token ids out of range [0, {cfg.vocab_size}): {bad[:5]}")
