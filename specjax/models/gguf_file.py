"""A fast GGUF (llama.cpp model file) reader.

``gguf.GGUFReader`` builds numpy views for every element of every metadata
array, which costs seconds for a 50k-150k token vocabulary. Here the header is
walked once with ``struct.unpack_from`` over a memory map, each string is
decoded once, and tensor data stays memory-mapped in the layout that
``gguf.quants.dequantize`` expects.

File layout (little-endian, GGUF v2/v3):
  "GGUF", u32 version, u64 tensor count, u64 KV count,
  KVs: string key, u32 value type, value,
  tensor infos: string name, u32 n_dims, u64 dims[n_dims] (ne[0] first), u32 ggml type, u64 offset,
  padding to ``general.alignment`` (default 32), then tensor data (offsets are relative to its start).
A string is a u64 byte length and UTF-8 bytes; an array is a u32 element type, a u64 count and the elements.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np

from specjax.errors import SpecjaxError

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4  # GGML_MAX_DIMS

_STRING, _ARRAY = 8, 9
# Fixed-size value types by GGUF type id, as struct/numpy format characters.
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_FIXED_STRUCTS = {t: struct.Struct("<" + c) for t, c in _FIXED.items()}
_FIXED_DTYPES = {t: np.dtype("<" + c) for t, c in _FIXED.items()}

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_HEADER = struct.Struct("<4sIQQ")
_TYPE_COUNT = struct.Struct("<IQ")  # array header; also a tensor info's (type, offset) tail

# ggml types whose tensors GGUFReader (and so dequantize) hands over as typed elements;
# every other type is handed over as raw block bytes.
_ELEMENT_DTYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64,
                   28: np.float64}


class _Corrupt(Exception):
    """Raised while parsing; GGUFFile turns it into a SpecjaxError naming the file."""


@dataclass(frozen=True, eq=False)
class GGUFTensor:
    name: str
    tensor_type: int  # ggml type id (gguf.GGMLQuantizationType value)
    shape: tuple[int, ...]  # GGUF dims order: ne[0] (the contiguous one) first
    data: np.ndarray  # memory-mapped; numpy shape reversed(shape), last dim in bytes for block types


class GGUFFile:
    """Metadata (``fields``: name -> python value; numeric arrays as numpy arrays, string arrays
    as list[str]) and tensors of a GGUF file. Any defect raises SpecjaxError naming the file."""

    def __init__(self, path: str):
        self.path = path
        try:
            if os.path.getsize(path) < _HEADER.size:
                raise _Corrupt("file too short")
            self._map = np.memmap(path, np.uint8, mode="r")
            self.version, self.fields, infos, data_start = _parse_header(memoryview(self._map))
            self.tensors = [_tensor(self._map, data_start, *info) for info in infos]
        except OSError as e:
            raise SpecjaxError(f"cannot read {path}: {e.strerror or e}") from None
        except struct.error:
            raise SpecjaxError(f"cannot read {path} as GGUF: header is truncated") from None
        except _Corrupt as e:
            raise SpecjaxError(f"cannot read {path} as GGUF: {e}") from None


def _parse_header(buf: memoryview):
    """(version, fields, tensor infos, absolute offset of the tensor data)."""
    magic, version, n_tensors, n_kv = _HEADER.unpack_from(buf, 0)
    if magic != _MAGIC:
        raise _Corrupt("not a GGUF file (bad magic)")
    if version not in _VERSIONS:
        if version & 0xFFFF == 0:  # the version reads byte-swapped
            raise _Corrupt("big-endian GGUF files are not supported")
        raise _Corrupt(f"unsupported GGUF version {version} (supported: 2, 3)")
    off = _HEADER.size
    fields = {}
    for _ in range(_bounded(n_kv, buf, off, "KV count")):
        key, off = _string(buf, off)
        vtype, = _U32.unpack_from(buf, off)
        value, off = _value(buf, off + 4, vtype)
        if key in fields:
            raise _Corrupt(f"duplicate metadata key {key!r}")
        fields[key] = value
    infos = []
    for _ in range(_bounded(n_tensors, buf, off, "tensor count")):
        info, off = _tensor_info(buf, off)
        infos.append(info)
    if len({info[0] for info in infos}) != len(infos):
        raise _Corrupt("duplicate tensor names")
    alignment = fields.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise _Corrupt(f"general.alignment {alignment!r} is not a power of two")
    return version, fields, infos, -(-off // alignment) * alignment


def _bounded(count: int, buf: memoryview, off: int, what: str) -> int:
    # Each item takes at least 8 bytes, so a larger count is corruption, not a long loop.
    if count > (len(buf) - off) // 8:
        raise _Corrupt(f"{what} {count} exceeds the file size")
    return count


def _string(buf: memoryview, off: int) -> tuple[str, int]:
    n, = _U64.unpack_from(buf, off)
    end = off + 8 + n
    if end > len(buf):
        raise _Corrupt("string runs past the end of the file")
    return str(buf[off + 8:end], "utf-8", "replace"), end


def _value(buf: memoryview, off: int, vtype: int):
    """(python value, offset after it)."""
    if vtype == _STRING:
        return _string(buf, off)
    if vtype == _ARRAY:
        etype, n = _TYPE_COUNT.unpack_from(buf, off)
        return _array(buf, off + _TYPE_COUNT.size, etype, n)
    s = _FIXED_STRUCTS.get(vtype)
    if s is None:
        raise _Corrupt(f"unknown metadata value type {vtype}")
    return s.unpack_from(buf, off)[0], off + s.size


def _array(buf: memoryview, off: int, etype: int, n: int):
    if etype == _STRING:
        return _string_array(buf, off, n)
    if etype in _FIXED_DTYPES:
        dt = _FIXED_DTYPES[etype]
        if n > (len(buf) - off) // dt.itemsize:
            raise _Corrupt("array runs past the end of the file")
        # A copy, so metadata does not pin the memory map.
        return np.frombuffer(buf, dt, n, off).copy(), off + n * dt.itemsize
    if etype == _ARRAY:
        items = []
        for _ in range(_bounded(n, buf, off, "nested array length")):
            sub_type, sub_n = _TYPE_COUNT.unpack_from(buf, off)
            item, off = _array(buf, off + _TYPE_COUNT.size, sub_type, sub_n)
            items.append(item)
        return items, off
    raise _Corrupt(f"unknown array element type {etype}")


def _string_array(buf: memoryview, off: int, n: int) -> tuple[list[str], int]:
    # The hot loop for tokenizer.ggml.tokens / merges: no per-string bounds check (a slice
    # past the end just comes back short; the final check catches it).
    unpack = _U64.unpack_from
    out = []
    for _ in range(_bounded(n, buf, off, "string array length")):
        k, = unpack(buf, off)
        off += 8
        out.append(str(buf[off:off + k], "utf-8", "replace"))
        off += k
    if off > len(buf):
        raise _Corrupt("string array runs past the end of the file")
    return out, off


def _tensor_info(buf: memoryview, off: int):
    """((name, dims, ggml type, relative data offset), offset after it)."""
    name, off = _string(buf, off)
    n_dims, = _U32.unpack_from(buf, off)
    if not 1 <= n_dims <= _MAX_DIMS:
        raise _Corrupt(f"tensor {name!r} has {n_dims} dims")
    dims = struct.unpack_from(f"<{n_dims}Q", buf, off + 4)
    off += 4 + 8 * n_dims
    ttype, rel = _TYPE_COUNT.unpack_from(buf, off)
    return (name, dims, ttype, rel), off + _TYPE_COUNT.size


def _tensor(mm: np.memmap, data_start: int, name: str, dims: tuple[int, ...], ttype: int, rel: int) -> GGUFTensor:
    from gguf.constants import GGML_QUANT_SIZES

    sizes = GGML_QUANT_SIZES.get(ttype)
    if sizes is None:
        raise _Corrupt(f"tensor {name!r} has unknown ggml type {ttype}")
    block, block_bytes = sizes
    if dims[0] % block:
        raise _Corrupt(f"tensor {name!r}: row length {dims[0]} is not a multiple of the block size {block}")
    n_bytes = int(np.prod(dims, dtype=np.uint64)) // block * block_bytes
    start = data_start + rel
    if start + n_bytes > len(mm):
        raise _Corrupt(f"tensor {name!r} runs past the end of the file (truncated?)")
    raw = mm[start:start + n_bytes]
    shape = tuple(reversed(dims))
    if ttype in _ELEMENT_DTYPES:
        data = raw.view(_ELEMENT_DTYPES[ttype]).reshape(shape)
    else:
        data = raw.reshape(shape[:-1] + (dims[0] // block * block_bytes,))
    return GGUFTensor(name=name, tensor_type=ttype, shape=tuple(dims), data=data)
