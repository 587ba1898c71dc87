"""Weight loading round trips (safetensors, GGUF) and user-facing load errors.

No jit here: these tests only move arrays through files.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
import pytest

from specjax.config import RopeScaling, get_model_config
from specjax.errors import SpecjaxError
from specjax.models import llama, weights
from specjax.models.loader import load_model
from tiny_gguf import _gguf_cfg, tiny_bpe_vocab, write_tiny_gguf

TINY = get_model_config("tiny-random")


def assert_params_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want), (
        f"params trees differ:\n{jax.tree.structure(got)}\nvs\n{jax.tree.structure(want)}")
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape, f"{jax.tree_util.keystr(path)}: shape {a.shape} != {b.shape}"
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def assert_cfg_matches(got, want, skip=("name", "weights")):
    for f in dataclasses.fields(want):
        if f.name in skip:
            continue
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, float):  # GGUF stores float32 metadata (as llama.cpp does)
            a, b = np.float32(a), np.float32(b)
        assert a == b, (
            f"config field {f.name}: loaded {getattr(got, f.name)!r} != written {getattr(want, f.name)!r}")


# ---------------------------------------------------------------- safetensors

ST_VARIANTS = {
    "llama": TINY.replace(rms_eps=1e-6, rope_theta=50000.0, max_position=512),
    "qwen2": TINY.replace(name="tiny-qwen2", arch="qwen2", qkv_bias=True, rms_eps=1e-6),
    "tied": TINY.replace(name="tiny-tied", tie_embeddings=True),
    "llama3_rope": TINY.replace(name="tiny-l3", rope_scaling=RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=64)),
}


@pytest.mark.parametrize("variant", sorted(ST_VARIANTS))
def test_safetensors_round_trip(tmp_path, variant):
    cfg = ST_VARIANTS[variant]
    params = llama.init_random_params(cfg, seed=4)
    d = tmp_path / f"model-{variant}"
    weights.save_safetensors_params(params, cfg, str(d))
    assert (d / "config.json").is_file() and (d / "model.safetensors").is_file()
    m = load_model(str(d))
    assert m.cfg.name == f"model-{variant}"
    assert_cfg_matches(m.cfg, cfg)
    assert_params_equal(m.params, params)
    # No tokenizer.json in the directory: the byte-level fallback tokenizer.
    assert m.tokenizer.vocab_size == 256
    assert m.tokenizer.decode(m.tokenizer.encode("héllo 🙂")) == "héllo 🙂"


def test_safetensors_dir_errors(tmp_path):
    with pytest.raises(SpecjaxError, match="no config.json"):
        load_model(str(tmp_path))
    cfg = TINY
    weights.save_safetensors_params(llama.init_random_params(cfg, seed=0), cfg, str(tmp_path / "m"))
    os.remove(tmp_path / "m" / "model.safetensors")
    with pytest.raises(SpecjaxError, match=r"no \.safetensors files"):
        load_model(str(tmp_path / "m"))


# ---------------------------------------------------------------- GGUF


@pytest.mark.parametrize("variant", ["llama", "llama_tied", "qwen2"])
def test_gguf_round_trip(tmp_path, variant):
    tokens, merges, types = tiny_bpe_vocab()
    cfg = _gguf_cfg(variant, len(tokens))
    params = llama.init_random_params(cfg, seed=5)
    path = tmp_path / f"tiny-{variant}.gguf"
    write_tiny_gguf(path, cfg, params, tokens, merges, types, write_vocab_size=(variant != "llama_tied"),
                    pre="qwen2" if variant == "qwen2" else "default")

    m = load_model(str(path))
    assert m.cfg.name == path.name
    assert m.cfg.weights.kind == "gguf_file"
    assert_cfg_matches(m.cfg, cfg)
    assert_params_equal(m.params, params)

    tok = m.tokenizer
    im_start, im_end = tokens.index("<|im_start|>"), tokens.index("<|im_end|>")
    assert tok.vocab_size == len(tokens)
    assert tok.bos_id == im_start and tok.eos_ids == (im_end,)
    assert tok.special_tokens == {"<|im_start|>": im_start, "<|im_end|>": im_end}
    # Merges are applied (whole words become single tokens).
    assert tok.encode("hello the") == [tokens.index("hello"), tokens.index("Ġthe")]
    assert tok.encode("hell") == [tokens.index("hell")]
    # Specials are atomic.
    chat = "<|im_start|>user\nhi<|im_end|>"
    ids = tok.encode(chat)
    assert ids[0] == im_start and ids[-1] == im_end
    assert ids[1:-1] == [tokens.index(c) for c in ["u", "s", "e", "r", "Ċ", "h", "i"]]
    for text in ["hello the world", "café naïve 🙂 你好", "a  b\n\n\tc", " hello", chat]:
        assert tok.decode(tok.encode(text), skip_special=False) == text
    assert tok.decode(ids) == "user\nhi"  # default decode drops specials

    rendered = tok.apply_chat_template([{"role": "user", "content": "Hello!"}])
    assert rendered == "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False) == \
        "<|im_start|>user\nx<|im_end|>\n"
    enc = tok.encode_chat("Hello!")
    assert enc[0] == im_start and enc.count(im_start) == 2 and enc.count(im_end) == 1
    assert tok.decode(enc, skip_special=False) == rendered


@pytest.mark.parametrize("n_head,rows,cols", [(4, 64, 32), (2, 32, 64), (3, 48, None)])
def test_permute_unpermute_inverse(n_head, rows, cols):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((rows,) if cols is None else (rows, cols)).astype(np.float32)
    p = weights.permute_qk(w, n_head)
    assert not np.array_equal(p, w)
    np.testing.assert_array_equal(weights.unpermute_qk(p, n_head), w)
    np.testing.assert_array_equal(weights.permute_qk(weights.unpermute_qk(w, n_head), n_head), w)


def test_permute_qk_is_llama_cpp_permutation():
    """llama.cpp's convert_hf_to_gguf.py: w.reshape(n_head, 2, hd//2, ...).swapaxes(1, 2).reshape(w.shape),
    i.e. per head, rotate-half order [0..h/2) [h/2..h) becomes interleaved (0, h/2, 1, h/2+1, ...)."""
    hd, n_head = 8, 2
    w = np.arange(hd * n_head, dtype=np.float32)
    p = weights.permute_qk(w, n_head)
    assert p.tolist() == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]



@pytest.mark.parametrize("qtype_name,block_bytes", [("Q4_1", 20), ("Q8_0", 34)])
def test_fast_dequantize_bit_identical_to_gguf(qtype_name, block_bytes):
    """weights.dequantize's numpy Q4_1 / Q8_0 paths vs gguf.quants.dequantize on random raw blocks,
    with nan / inf / subnormal / signed-zero f16 scales (and Q4_1 mins) mixed in."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType[qtype_name]
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, (300, block_bytes), dtype=np.uint8)  # random bytes: f16 scales of every kind
    edge = np.array([0x7E00, 0x7C01, 0xFC00, 0x7C00, 0x0001, 0x83FF, 0x8000, 0x0000, 0x7BFF], np.uint16)
    n = len(edge) ** 2
    raw[:n, 0:2] = edge.repeat(len(edge)).view(np.uint8).reshape(-1, 2)  # d
    if qtype_name == "Q4_1":
        raw[:n, 2:4] = np.tile(edge, len(edge)).view(np.uint8).reshape(-1, 2)  # m
    raw = raw.reshape(30, -1)  # GGUF layout: rows of whole blocks
    with np.errstate(invalid="ignore"):  # inf * 0 and inf - inf, in both implementations
        got, want = weights.dequantize(raw, qtype), dequantize(raw, qtype)
    assert got.dtype == np.float32 and got.size == want.size == 300 * 32
    np.testing.assert_array_equal(got.reshape(-1).view(np.uint32), want.reshape(-1).view(np.uint32))


# ---------------------------------------------------------------- GGUFFile (our reader) vs gguf.GGUFReader

# (GGUF value type, scalar, array) for every fixed-size type; floats are float32-exact where stored as float32.
_KV_CASES = {
    "uint8": (0, 200, [0, 7, 255]), "int8": (1, -100, [-128, 0, 127]),
    "uint16": (2, 60000, [1, 65535]), "int16": (3, -30000, [-32768, 32767]),
    "uint32": (4, 4_000_000_000, [0, 2**32 - 1]), "int32": (5, -2_000_000_000, [-(2**31), 3]),
    "float32": (6, 0.25, [1.5, -2.0, 1e-5]), "bool": (7, True, [True, False, True]),
    "uint64": (10, 2**63 + 5, [2**64 - 1, 0]), "int64": (11, -(2**62), [-(2**63), 2**63 - 1]),
    "float64": (12, 0.1, [0.1, -1e300]),
}
_STRINGS = ["", "a b", "héllo 🙂", "<|im_end|>"]
_NESTED = [[1, 2, 3], [4]]


def write_kitchen_sink_gguf(path):
    """Every KV value type (scalars, arrays, string arrays, a nested array), a non-default alignment,
    and tensors of several ggml types (element types and block-quantized ones)."""
    import gguf
    from gguf import GGMLQuantizationType as Q, GGUFValueType as V

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    for name, (vtype, scalar, array) in _KV_CASES.items():
        w.add_key_value(f"test.{name}", scalar, V(vtype))
        w.add_key_value(f"test.{name}_array", array, V.ARRAY, sub_type=V(vtype))
    w.add_string("test.string", "héllo 🙂")
    w.add_array("test.strings", _STRINGS)
    w.add_array("test.nested", _NESTED)
    tensors = {
        "f32": (rng.standard_normal((3, 64)).astype(np.float32), None),
        "f16": (rng.standard_normal((2, 3, 32)).astype(np.float16), None),
        "i32": (np.arange(10, dtype=np.int32), None),
        "bf16": (rng.standard_normal((2, 64)).astype(np.float32), Q.BF16),
        "q8_0": (rng.standard_normal((4, 64)).astype(np.float32), Q.Q8_0),
        "q4_1": (rng.standard_normal((4, 64)).astype(np.float32), Q.Q4_1),
    }
    for name, (a, qtype) in tensors.items():
        if qtype is None:
            w.add_tensor(name, a)
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def test_gguf_file_matches_gguf_reader(tmp_path):
    import gguf
    from gguf.quants import dequantize

    from specjax.models.gguf_file import GGUFFile

    path = tmp_path / "sink.gguf"
    written = write_kitchen_sink_gguf(path)
    old, new = gguf.GGUFReader(str(path)), GGUFFile(str(path))

    assert new.version == 3
    assert list(new.fields) == [k for k in old.fields if not k.startswith("GGUF.")]  # GGUF.*: reader's own
    for key, value in new.fields.items():
        if key != "test.nested":  # GGUFReader.contents() flattens nested arrays
            got = value.tolist() if isinstance(value, np.ndarray) else value
            assert got == old.fields[key].contents(), key
    assert new.fields["general.alignment"] == 64
    for name, (vtype, scalar, array) in _KV_CASES.items():
        dtype = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
                 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}[vtype]
        assert type(new.fields[f"test.{name}"]) is type(scalar) and new.fields[f"test.{name}"] == scalar, name
        arr = new.fields[f"test.{name}_array"]
        assert arr.dtype == dtype and np.array_equal(arr, np.array(array, dtype)), name
    assert new.fields["test.string"] == "héllo 🙂" and new.fields["test.strings"] == _STRINGS
    assert [a.tolist() for a in new.fields["test.nested"]] == _NESTED

    assert [t.name for t in new.tensors] == [t.name for t in old.tensors] == list(written)
    for t, o in zip(new.tensors, old.tensors):
        assert t.tensor_type == int(o.tensor_type) and t.shape == tuple(int(d) for d in o.shape), t.name
        assert t.data.dtype == o.data.dtype and t.data.shape == o.data.shape, t.name
        np.testing.assert_array_equal(t.data, o.data, err_msg=t.name)
        if t.name == "i32":  # integer tensors are not dequantizable
            np.testing.assert_array_equal(t.data, written["i32"][0])
            continue
        deq = dequantize(t.data, gguf.GGMLQuantizationType(t.tensor_type))
        np.testing.assert_array_equal(deq, dequantize(o.data, o.tensor_type), err_msg=t.name)
        a, qtype = written[t.name]
        assert deq.shape == a.shape, t.name
        if qtype is None:
            np.testing.assert_array_equal(deq, a, err_msg=t.name)


def test_gguf_file_rejects_corrupt_files(tmp_path):
    """Truncation anywhere (header, string arrays, tensor infos, tensor data) and bad headers
    give a one-line SpecjaxError naming the file, never a traceback or a hang."""
    import struct

    from specjax.models.gguf_file import GGUFFile

    good = tmp_path / "good.gguf"
    write_kitchen_sink_gguf(good)
    data = good.read_bytes()
    GGUFFile(str(good))
    bad = {f"cut{n}": data[:n] for n in range(0, len(data) - 64, 23)}  # the last 64 bytes may be padding
    bad["magic"] = b"GGML" + data[4:]
    bad["version1"] = data[:4] + struct.pack("<I", 1) + data[8:]
    bad["big_endian"] = data[:4] + struct.pack(">I", 3) + data[8:]
    bad["kv_count"] = data[:16] + struct.pack("<Q", 2**60) + data[24:]
    for name, content in bad.items():
        p = tmp_path / f"{name}.gguf"
        p.write_bytes(content)
        with pytest.raises(SpecjaxError, match="cannot read .*" + name) as e:
            GGUFFile(str(p))
        assert "\n" not in str(e.value), name


# ---------------------------------------------------------------- bad inputs


def test_unknown_model_name():
    with pytest.raises(SpecjaxError) as e:
        load_model("no-such-model")
    msg = str(e.value)
    assert "no-such-model" in msg and "tiny-random" in msg and "smollm2-135m" in msg


def test_missing_gguf_file():
    with pytest.raises(SpecjaxError, match="not found.*/nonexistent/x.gguf"):
        load_model("/nonexistent/x.gguf")


def test_missing_path():
    with pytest.raises(SpecjaxError, match="not found.*/nonexistent/dir"):
        load_model("/nonexistent/dir")


def test_not_a_gguf_file(tmp_path):
    p = tmp_path / "fake.gguf"
    p.write_bytes(b"this is not a GGUF file at all\n" * 100)
    with pytest.raises(SpecjaxError, match="cannot read .*fake.gguf as GGUF"):
        load_model(str(p))


def test_truncated_gguf_file(tmp_path):
    tokens, merges, types = tiny_bpe_vocab()
    cfg = _gguf_cfg("llama", len(tokens))
    good = tmp_path / "good.gguf"
    write_tiny_gguf(good, cfg, llama.init_random_params(cfg, seed=0), tokens, merges, types)
    data = good.read_bytes()
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(SpecjaxError, match="cannot read .*truncated.gguf as GGUF"):
        load_model(str(bad))


def test_unsupported_gguf_arch(tmp_path):
    import gguf

    p = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(p), "falcon")
    w.add_uint32("falcon.block_count", 1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SpecjaxError, match="unsupported GGUF architecture 'falcon'"):
        load_model(str(p))


def test_shapes_only_config():
    with pytest.raises(SpecjaxError) as e:
        load_model("llama2-7b")
    msg = str(e.value)
    assert "llama2-7b" in msg and "shapes-only" in msg and ".gguf" in msg


def test_bad_dtype():
    with pytest.raises(SpecjaxError, match="unknown dtype 'float16'"):
        load_model("tiny-random", dtype="float16")


def test_random_named_model_loads():
    m = load_model("tiny-random")
    assert m.cfg == TINY
    assert_params_equal(m.params, llama.init_random_params(TINY, seed=TINY.weights.seed))


# ---------------------------------------------------------------- prepared arrays on disk

def _mapped_ranges(path):
    """The address ranges this process maps ``path`` at (/proc/self/maps)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(path):
                lo, hi = line.split()[0].split("-")
                out.append((int(lo, 16), int(hi, 16)))
    return out


def test_a_prepared_model_maps_back_without_copying_and_a_damaged_one_is_prepared_again(tmp_path, monkeypatch, caplog):
    """models.prepared: the second load of a GGUF maps its stored arrays instead of preparing them,
    with the same config, params, tokenizer and rows-kernel packs (both layouts), its params on
    the device aliasing the mapped file (no copy); a flipped byte in the file is one warning and a
    load that prepares the model again (and replaces the entry); a rewritten GGUF is a new entry
    that removes the old one."""
    import logging

    from gguf import GGMLQuantizationType as Q

    from specjax import ondisk
    from specjax.models import prepared

    tokens, merges, types = tiny_bpe_vocab()
    cfg = _gguf_cfg("llama", len(tokens)).replace(hidden_size=64, intermediate_size=128)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, cfg, llama.init_random_params(cfg, seed=5), tokens, merges, types, proj_type=Q.Q4_1)
    root = tmp_path / "models"
    monkeypatch.setattr(prepared, "_DIRECTORY", str(root))
    monkeypatch.setattr(ondisk, "_warned", set())

    def load():
        m = load_model(str(path))
        packs = {pairs: m.native_packs(pairs) for pairs in (False, True)}
        prepared.wait()
        return m, packs

    fresh, fresh_packs = load()
    first_embed = np.array(fresh.params["embed"])  # (a copy: an F32 tensor's params alias the GGUF's own mapping)
    (entry,) = [os.path.join(root, a, b) for a in os.listdir(root) for b in os.listdir(root / a)]
    assert sorted(f for f in os.listdir(entry) if f.endswith((".bin", ".pkl"))) == [
        "model.bin", "model.pkl", "packs0.bin", "packs0.pkl", "packs1.bin", "packs1.pkl"]
    hit, hit_packs = load()
    assert hit.cfg == fresh.cfg and hit_packs.keys() == fresh_packs.keys()
    assert_params_equal(hit.params, fresh.params)
    for pairs in fresh_packs:
        assert_params_equal(hit_packs[pairs], fresh_packs[pairs])
    assert hit.tokenizer.encode("hello the world") == fresh.tokenizer.encode("hello the world")
    assert hit.tokenizer.chat_template == fresh.tokenizer.chat_template
    ranges = _mapped_ranges(os.path.join(entry, "model.bin"))
    assert ranges and all(any(lo <= leaf.unsafe_buffer_pointer() < hi for lo, hi in ranges)
                          for leaf in jax.tree.leaves(hit.params))

    with open(os.path.join(entry, "model.bin"), "r+b") as f:  # one flipped bit
        f.seek(4096)
        byte = f.read(1)
        f.seek(4096)
        f.write(bytes([byte[0] ^ 1]))
    with caplog.at_level(logging.WARNING):
        again, _ = load()
    assert_params_equal(again.params, fresh.params)
    assert [r.getMessage() for r in caplog.records] == [
        f"ignoring {entry}/model.bin: it does not match the size and hash recorded when it was written "
        "(damaged or incomplete)"]
    assert ondisk.mapped(os.path.join(entry, "model.bin")) is not None  # replaced

    write_tiny_gguf(path, cfg, llama.init_random_params(cfg, seed=6), tokens, merges, types, proj_type=Q.Q4_1)
    other, _ = load()
    assert not np.array_equal(np.asarray(other.params["embed"]), first_embed)
    (newer,) = [os.path.join(root, a, b) for a in os.listdir(root) for b in os.listdir(root / a)]
    assert newer != entry
