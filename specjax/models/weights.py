"""Weight loading: GGUF (llama.cpp) and Hugging Face safetensors into the params pytree.

GGUF files are parsed by :mod:`specjax.models.gguf_file`. Q4_1 / Q8_0 tensors are
dequantized by the numpy code below (bit-identical to the ``gguf`` package, but faster);
the ``gguf`` package dequantizes every other type. llama.cpp's converter permutes the rows
of attn_q / attn_k of *llama*-arch models so that GGML's interleaved RoPE works; we use
rotate-half RoPE (like Hugging Face), so those rows are un-permuted here. qwen2-arch GGUFs
are not permuted.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig, RopeScaling, WeightsSource
from specjax.device_arrays import to_device
from specjax.errors import SpecjaxError
from specjax.models.gguf_file import GGUFFile

# ---------------------------------------------------------------- GGUF


def check_gguf_path(path: str) -> None:
    """A one-line error unless ``path`` is a file."""
    if not os.path.isfile(path):
        raise SpecjaxError(f"GGUF file not found: {path}")


def open_gguf(path: str) -> GGUFFile:
    check_gguf_path(path)
    return GGUFFile(path)


def gguf_metadata(reader: GGUFFile) -> dict[str, Any]:
    """All key/value fields except the (large) tokenizer arrays."""
    return {name: value for name, value in reader.fields.items()
            if not (name.startswith("tokenizer.ggml.")
                    and name.split(".")[-1] in ("tokens", "merges", "token_type", "scores"))}


def gguf_field(reader: GGUFFile, name: str, default=None):
    return reader.fields.get(name, default)


def config_from_gguf(reader: GGUFFile, name: str | None = None) -> ModelConfig:
    meta = gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in ("llama", "qwen2"):
        raise SpecjaxError(f"unsupported GGUF architecture {arch!r} (supported: llama, qwen2)")

    def g(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    n_heads = int(g("attention.head_count"))
    d = int(g("embedding_length"))
    tensor_names = {t.name for t in reader.tensors}
    vocab = g("vocab_size")
    if vocab is None:
        tokens = gguf_field(reader, "tokenizer.ggml.tokens")
        if tokens is None:
            raise SpecjaxError(f"{reader.path}: GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
        vocab = len(tokens)
    scaling = None
    stype = g("rope.scaling.type")
    if stype not in (None, "none"):
        raise SpecjaxError(f"GGUF rope scaling type {stype!r} is not supported")
    if "rope_freqs.weight" in tensor_names:
        # llama.cpp stores Llama-3.1 scaling as per-frequency factors; refusing beats a silently wrong model.
        raise SpecjaxError("GGUF files with rope_freqs.weight (Llama-3.1 rope scaling) are not supported yet; "
                           "load the Hugging Face safetensors checkpoint instead")
    return ModelConfig(
        name=name or str(meta.get("general.name", "gguf-model")),
        arch=arch,
        vocab_size=int(vocab),
        hidden_size=d,
        intermediate_size=int(g("feed_forward_length")),
        num_layers=int(g("block_count")),
        num_heads=n_heads,
        num_kv_heads=int(g("attention.head_count_kv", n_heads)),
        head_dim=int(g("rope.dimension_count", d // n_heads)),
        max_position=int(g("context_length", 4096)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        weights=WeightsSource(kind="gguf_file", file=os.path.abspath(reader.path)),
    )


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation. w: [out, in] (torch layout) or [out]."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation (inverse of unpermute_qk); used to write test GGUFs."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _assemble(cfg: ModelConfig, get: Callable[[str], np.ndarray], names: dict[str, str], dtype) -> dict:
    """Build the params pytree from a tensor getter returning torch-layout ([out, in]) arrays."""
    L = cfg.num_layers
    H, Hkv = cfg.num_heads, cfg.num_kv_heads

    permuted = names.get("_permuted") == "yes" and cfg.arch == "llama"
    fixes = {}
    if permuted:
        fixes = {"wq": lambda a: unpermute_qk(a, H), "bq": lambda a: unpermute_qk(a, H),
                 "wk": lambda a: unpermute_qk(a, Hkv), "bk": lambda a: unpermute_qk(a, Hkv)}
    keys = ["attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"]
    if cfg.qkv_bias:
        keys += ["bq", "bk", "bv"]

    def tensor(key, i):
        a = get(names[key].format(i=i))
        if key in fixes:
            a = fixes[key](a)
        return to_device(a.T if a.ndim == 2 else a, dtype)

    layers = [{key: tensor(key, i) for key in keys} for i in range(L)]
    params = {
        "embed": to_device(get(names["embed"]), dtype),
        "layers": layers,
        "final_norm": to_device(get(names["final_norm"]), dtype),
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = to_device(get(names["lm_head"]).T, dtype)
    return params



_GGUF_NAMES = {
    "_permuted": "yes",
    "embed": "token_embd.weight", "final_norm": "output_norm.weight", "lm_head": "output.weight",
    "attn_norm": "blk.{i}.attn_norm.weight", "wq": "blk.{i}.attn_q.weight", "wk": "blk.{i}.attn_k.weight",
    "wv": "blk.{i}.attn_v.weight", "wo": "blk.{i}.attn_output.weight", "bq": "blk.{i}.attn_q.bias",
    "bk": "blk.{i}.attn_k.bias", "bv": "blk.{i}.attn_v.bias", "mlp_norm": "blk.{i}.ffn_norm.weight",
    "w_gate": "blk.{i}.ffn_gate.weight", "w_up": "blk.{i}.ffn_up.weight", "w_down": "blk.{i}.ffn_down.weight",
}


# GGML block layouts (little-endian, packed), 32 values per block.
_Q4_1_BLOCK = np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)])  # byte j: value j low, j+16 high nibble
_Q8_0_BLOCK = np.dtype([("d", "<f2"), ("qs", "i1", 32)])
# Q4_1 runs four passes over its output; chunks of this many blocks (256 KiB of fp32) keep them in cache.
_Q4_1_CHUNK = 2048


def _blocks(raw: np.ndarray, block: np.dtype) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.uint8).reshape(-1).view(block)


def _dequantize_q4_1(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, _Q4_1_BLOCK)
    # q * d + m with fp32 rounding after each op, exactly as gguf.quants does (bit-identical results).
    d = b["d"].astype(np.float32)[:, None, None]
    m = b["m"].astype(np.float32)[:, None, None]
    qs = b["qs"]
    out = np.empty((len(b), 2, 16), np.float32)
    for s in range(0, len(b), _Q4_1_CHUNK):
        o, q = out[s:s + _Q4_1_CHUNK], qs[s:s + _Q4_1_CHUNK]
        np.bitwise_and(q, 15, out=o[:, 0], casting="unsafe")  # uint8 nibbles written straight as fp32
        np.right_shift(q, 4, out=o[:, 1], casting="unsafe")
        o *= d[s:s + _Q4_1_CHUNK]
        o += m[s:s + _Q4_1_CHUNK]
    return out


def _dequantize_q8_0(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, _Q8_0_BLOCK)
    out = np.empty((len(b), 32), np.float32)
    np.multiply(b["qs"], b["d"].astype(np.float32)[:, None], out=out)  # int8 -> fp32 is exact
    return out


def dequantize(raw: np.ndarray, qtype) -> np.ndarray:
    """A GGUF tensor's raw data as fp32 values in storage order (the shape is the caller's to set)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    fast = {GGMLQuantizationType.Q4_1: _dequantize_q4_1, GGMLQuantizationType.Q8_0: _dequantize_q8_0}.get(qtype)
    return fast(raw) if fast else gguf_dequantize(raw, qtype)


def load_gguf_params(reader: GGUFFile, cfg: ModelConfig, dtype=jnp.float32) -> dict:
    from gguf import GGMLQuantizationType

    tensors = {t.name: t for t in reader.tensors}

    def get(name):
        if name not in tensors:
            raise SpecjaxError(f"GGUF file lacks tensor {name!r}; is it a {cfg.arch} model?")
        t = tensors[name]
        qtype = GGMLQuantizationType(t.tensor_type)
        try:
            a = dequantize(t.data, qtype)
        except NotImplementedError:
            raise SpecjaxError(f"{reader.path}: tensor {name!r} has type {qtype.name}, "
                               "which the gguf package cannot dequantize") from None
        shape = tuple(int(s) for s in reversed(t.shape))
        return np.asarray(a, np.float32).reshape(shape)

    return _assemble(cfg, get, _GGUF_NAMES, dtype)


def gguf_has_row_packs(reader: GGUFFile) -> bool:
    """Whether any matrix of the file is stored in a block type the rows kernel reads as is."""
    from gguf import GGMLQuantizationType as Q

    return any(t.tensor_type in (Q.Q4_1, Q.Q8_0) and len(t.shape) == 2 for t in reader.tensors)


def gguf_row_packs(reader: GGUFFile, cfg: ModelConfig, pairs: bool = False) -> dict:
    """The weights of the file that are stored as Q4_1 or Q8_0, packed in those blocks for the CPU
    rows kernel (models.cpu.rows_dot): ``{"layers": {name: stack}, "head": packed}``, the names
    of ``llama.pack_for_rows``, each projection's packs of every layer as one stack
    (rows_dot.stack_packs); a projection stored in another type, or in different blocks in
    different layers, is left out (the caller packs it from float32). The same values as
    ``load_gguf_params`` gives, at 4.6-8.5 bits a weight. ``pairs``: in the layout the kernel's
    int8 activations read (rows_dot.pack_q4_1)."""
    from gguf import GGMLQuantizationType as Q

    from specjax.models.cpu import rows_dot

    tensors = {t.name: t for t in reader.tensors}
    permuted = cfg.arch == "llama"  # as in _assemble: llama.cpp permuted the rows of attn_q/attn_k
    heads = {"wq": cfg.num_heads, "wk": cfg.num_kv_heads}

    def pack(name, key=None):
        t = tensors.get(name)
        if t is None or t.tensor_type not in (Q.Q4_1, Q.Q8_0) or int(t.shape[0]) % rows_dot.GROUP:
            return None
        block = _Q4_1_BLOCK if t.tensor_type == Q.Q4_1 else _Q8_0_BLOCK
        b = _blocks(t.data, block).reshape(int(t.shape[1]), int(t.shape[0]) // rows_dot.GROUP)  # [out, groups]
        if permuted and key in heads:
            b = unpermute_qk(b, heads[key])
        if t.tensor_type == Q.Q4_1:
            return rows_dot.pack_q4_1(b["d"], b["m"], b["qs"], pairs)
        return rows_dot.pack_q8_0(b["d"], b["qs"], pairs)

    def tensor_type(name):
        t = tensors.get(name)
        return None if t is None else t.tensor_type

    layers = {}
    for key in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        names = [_GGUF_NAMES[key].format(i=i) for i in range(cfg.num_layers)]
        if len({tensor_type(n) for n in names}) == 1:  # (one stack needs one format in every layer)
            packs = [pack(n, key) for n in names]
            if packs[0] is not None:
                layers[key] = rows_dot.stack_packs(packs)
    head = pack(_GGUF_NAMES["embed"] if cfg.tie_embeddings else _GGUF_NAMES["lm_head"])
    return {"layers": layers, **({"head": head} if head is not None else {})}


# ---------------------------------------------------------------- safetensors (Hugging Face names)

_HF_NAMES = {
    "embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight",
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    "wq": "model.layers.{i}.self_attn.q_proj.weight", "wk": "model.layers.{i}.self_attn.k_proj.weight",
    "wv": "model.layers.{i}.self_attn.v_proj.weight", "wo": "model.layers.{i}.self_attn.o_proj.weight",
    "bq": "model.layers.{i}.self_attn.q_proj.bias", "bk": "model.layers.{i}.self_attn.k_proj.bias",
    "bv": "model.layers.{i}.self_attn.v_proj.bias",
    "mlp_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "w_gate": "model.layers.{i}.mlp.gate_proj.weight", "w_up": "model.layers.{i}.mlp.up_proj.weight",
    "w_down": "model.layers.{i}.mlp.down_proj.weight",
}


def config_from_hf(config_json: dict, name: str) -> ModelConfig:
    c = config_json
    model_type = c.get("model_type", "llama")
    if model_type not in ("llama", "qwen2", "mistral"):
        raise SpecjaxError(f"unsupported Hugging Face model_type {model_type!r} (supported: llama, qwen2)")
    H = int(c["num_attention_heads"])
    rs = c.get("rope_scaling") or None
    scaling = None
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":
        scaling = RopeScaling(factor=float(rs["factor"]), low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
                              high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
                              original_max_position=int(rs.get("original_max_position_embeddings", 8192)))
    return ModelConfig(
        name=name, arch="qwen2" if model_type == "qwen2" else "llama",
        vocab_size=int(c["vocab_size"]), hidden_size=int(c["hidden_size"]),
        intermediate_size=int(c["intermediate_size"]), num_layers=int(c["num_hidden_layers"]),
        num_heads=H, num_kv_heads=int(c.get("num_key_value_heads", H)),
        head_dim=int(c.get("head_dim") or c["hidden_size"] // H),
        max_position=int(c.get("max_position_embeddings", 4096)),
        rope_theta=float(c.get("rope_theta", 10000.0)), rope_scaling=scaling,
        rms_eps=float(c.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(c.get("attention_bias", False)),
        weights=WeightsSource(kind="safetensors_dir"),
    )


# ---------------------------------------------------------------- sharded safetensors, straight into shards

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": "bfloat16", "F64": np.float64}


def _safetensors_header(path: str) -> tuple[dict, int]:
    """A .safetensors file's tensor table and the byte offset its data starts at (the format: a
    little-endian u64 header size, a JSON header, then the raw tensors)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


class SafetensorsIndex:
    """Where each tensor of a (possibly sharded) Hugging Face checkpoint lives, read from
    ``model.safetensors.index.json`` (or the one ``model.safetensors``) and the files' headers
    only. ``array(name)`` is a read-only memory map of one tensor: slicing it reads those bytes
    and no others."""

    def __init__(self, model_dir: str):
        idx = os.path.join(model_dir, "model.safetensors.index.json")
        if os.path.isfile(idx):
            with open(idx) as f:
                weight_map = json.load(f).get("weight_map", {})
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
            weight_map = None
        if not files:
            raise SpecjaxError(f"no .safetensors files in {model_dir}")
        self.entries: dict[str, tuple[str, dict, int]] = {}
        for fname in files:
            path = os.path.join(model_dir, fname)
            if not os.path.isfile(path):
                raise SpecjaxError(f"{idx} names {fname}, which is not in {model_dir}")
            header, start = _safetensors_header(path)
            for name, info in header.items():
                if weight_map is None or weight_map.get(name) == fname:
                    self.entries[name] = (path, info, start)
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(self.entries))
            if missing:
                raise SpecjaxError(f"{idx} maps {missing[0]!r} to a file whose header lacks it")

    def shape(self, name: str) -> tuple[int, ...] | None:
        e = self.entries.get(name)
        return None if e is None else tuple(e[1]["shape"])

    def array(self, name: str) -> np.ndarray:
        path, info, start = self.entries[name]
        dt = _ST_DTYPES.get(info["dtype"])
        if dt is None:
            raise SpecjaxError(f"{path}: tensor {name!r} has dtype {info['dtype']}, not a float type specjax loads")
        if dt == "bfloat16":
            import ml_dtypes

            dt = ml_dtypes.bfloat16
        b0, _ = info["data_offsets"]
        return np.memmap(path, dtype=dt, mode="r", offset=start + b0, shape=tuple(info["shape"]))


def _flipped(key: str, ndim: int) -> bool:
    """Whether a param is stored transposed in a Hugging Face file: params are ``x @ W`` ([in, out]),
    the files hold torch's [out, in]; the embedding is [vocab, hidden] in both."""
    return ndim == 2 and key != "embed"


def load_safetensors_params(model_dir: str, cfg: ModelConfig, dtype=jnp.float32) -> dict:
    index = SafetensorsIndex(model_dir)

    def get(name):
        if index.shape(name) is None:
            raise SpecjaxError(f"safetensors checkpoint in {model_dir} lacks tensor {name!r}")
        return np.asarray(index.array(name), np.float32)

    return _assemble(cfg, get, _HF_NAMES, dtype)


def _hf_tensors(placed) -> dict[str, tuple[str, int | None, object]]:
    """HF tensor name -> (params key, layer or None, the param's abstract value) for every param of
    an (abstract) params tree (sharding.abstract_params: the one table of param shapes)."""
    out = {_HF_NAMES[k]: (k, None, a) for k, a in placed.items() if k != "layers"}
    for i, lp in enumerate(placed["layers"]):
        out.update({_HF_NAMES[k].format(i=i): (k, i, a) for k, a in lp.items()})
    return out


def load_safetensors_sharded(model_dir: str, cfg: ModelConfig, layout, dtype=jnp.bfloat16) -> dict:
    """The params of a Hugging Face checkpoint placed by ``layout`` (sharding.Layout), each device
    reading only its own slice of each tensor from the memory-mapped files (no host copy of the
    whole model). Every tensor's presence and shape is checked from the headers first: a missing
    or misshapen tensor is a one-line error naming the config and the mesh, before any device work."""
    import jax

    from specjax import sharding as sh

    index = SafetensorsIndex(model_dir)
    where = f"{cfg.name} on {layout.describe()}"
    expected = _hf_tensors(sh.abstract_params(cfg, dtype))
    for name, (key, _, a) in expected.items():
        got, shape = index.shape(name), tuple(reversed(a.shape)) if _flipped(key, a.ndim) else tuple(a.shape)
        if got is None:
            raise SpecjaxError(f"{where}: the checkpoint in {model_dir} lacks tensor {name!r}")
        if got != shape:
            raise SpecjaxError(f"{where}: tensor {name!r} has shape {got} in {model_dir}, the config needs {shape}")
    layout.check(cfg)
    placed = layout.abstract_params(cfg, dtype)

    def place(name, key, a):
        src, flip = index.array(name), _flipped(key, a.ndim)

        def read(idx):  # idx: this device's slice of our layout
            part = src[tuple(reversed(idx))].T if flip else src[idx]
            return np.asarray(part, np.float32).astype(dtype)

        return jax.make_array_from_callback(a.shape, a.sharding, read)

    params: dict = {"layers": [{} for _ in range(cfg.num_layers)]}
    for name, (key, layer, a) in _hf_tensors(placed).items():
        (params if layer is None else params["layers"][layer])[key] = place(name, key, a)
    return params


def save_safetensors_params(params: dict, cfg: ModelConfig, model_dir: str, shards: int = 1) -> None:
    """Write params with Hugging Face names (torch layout) plus a config.json (for tests and export);
    ``shards`` > 1: in that many files with a ``model.safetensors.index.json``, as large
    checkpoints come."""
    from safetensors.numpy import save_file

    os.makedirs(model_dir, exist_ok=True)
    out = {_HF_NAMES["embed"]: np.asarray(params["embed"], np.float32),
           _HF_NAMES["final_norm"]: np.asarray(params["final_norm"], np.float32)}
    if not cfg.tie_embeddings:
        out[_HF_NAMES["lm_head"]] = np.asarray(params["lm_head"], np.float32).T.copy()
    for i, lp in enumerate(params["layers"]):
        for key, arr in lp.items():
            a = np.asarray(arr, np.float32)
            out[_HF_NAMES[key].format(i=i)] = a.T.copy() if a.ndim == 2 else a.copy()
    if shards <= 1:
        save_file(out, os.path.join(model_dir, "model.safetensors"))
    else:
        names = list(out)
        weight_map = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: out[n] for n in names[s::shards]}
            save_file(part, os.path.join(model_dir, fname))
            weight_map.update({n: fname for n in part})
        with open(os.path.join(model_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    hf = {"model_type": "qwen2" if cfg.arch == "qwen2" else "llama", "vocab_size": cfg.vocab_size,
          "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
          "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
          "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
          "max_position_embeddings": cfg.max_position, "rope_theta": cfg.rope_theta,
          "rms_norm_eps": cfg.rms_eps, "tie_word_embeddings": cfg.tie_embeddings,
          "attention_bias": cfg.qkv_bias}
    if cfg.rope_scaling is not None:  # else a Llama-3 export reloads with unscaled RoPE
        rs = cfg.rope_scaling
        hf["rope_scaling"] = {"rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
                              "high_freq_factor": rs.high_freq_factor,
                              "original_max_position_embeddings": rs.original_max_position}
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
