"""A GGUF model as the loader prepares it, kept on disk and mapped back without copying.

Preparing SmolLM2 for the engine takes about two seconds of a warm first answer of five on a
2-core CPU: parsing the file's metadata, dequantizing and transposing 540 MB of float32 copies
(most of it the page faults of fresh memory), building the tokenizer and packing the weights for
the rows kernel. A store keeps each part's arrays in one file (``specjax.ondisk.write_mapped``)
beside a pickle of the rest of it (config, tokenizer, tree structure). Loading maps the file and
hands its pages to jax, which aliases host memory on the CPU rather than copying it: the pages are
read from the page cache when a program first touches them. The parts are the model (config,
tokenizer, params) and each layout of the rows kernel's packs; an EAGLE head's restored arrays
are kept the same way (drafters.eagle.load_head: orbax's import and restore took a second).

An entry is keyed by the file (absolute path, size, change and modification times, inode), the model name and dtype
asked for, and the digest of specjax's code; a new entry for the same file, name and dtype removes
the older ones (a code change would otherwise leave 600 MB behind each time). Entries are written
in a background thread (not a daemon: the process finishes the write before it exits) and read
back only if they verify. Launch scripts turn the store on with the executable cache
(``runtime.enable_compilation_cache``); a library caller that does not gets no store.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import threading
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax import ondisk
from specjax.device_arrays import to_device

_DIRECTORY: str | None = None
_writes: list[threading.Thread] = []


def set_directory(path: str | None) -> None:
    """Where model loads from now on keep their prepared arrays (None: nowhere)."""
    global _DIRECTORY
    _DIRECTORY = path


@dataclass(frozen=True)
class _Slot:
    """Where one array of a stored part lies in its file."""

    index: int
    dtype: str
    shape: tuple


def _is_array(x) -> bool:
    return isinstance(x, (np.ndarray, jax.Array))


class Store:
    """The prepared parts of one model file (``for_file``)."""

    def __init__(self, path: str):
        self.path = path

    @classmethod
    def for_source(cls, source: str, version: str) -> "Store | None":
        """The store of what ``source`` names (a stable description) at ``version`` (what its
        content depends on; specjax's code digest is added); None without a directory."""
        if _DIRECTORY is None:
            return None
        from specjax.engine.exe_cache import code_digest

        key = [hashlib.sha256(s.encode()).hexdigest()[:32] for s in (source, f"{version}\n{code_digest()}")]
        return cls(os.path.join(_DIRECTORY, *key))

    @classmethod
    def for_file(cls, gguf_path: str, name: str, dtype) -> "Store | None":
        """The store of ``gguf_path`` loaded as ``name`` in ``dtype``; None without a directory."""
        if _DIRECTORY is None:
            return None
        st = os.stat(gguf_path)  # (a rewrite changes the change time; in place, same size, within one tick would not)
        return cls.for_source(f"{os.path.abspath(gguf_path)}\n{name}\n{jnp.dtype(dtype).name}",
                              f"{st.st_size} {st.st_mtime_ns} {st.st_ctime_ns} {st.st_ino}")

    @classmethod
    def for_directory(cls, directory: str, what: str) -> "Store | None":
        """The store of ``what`` (a description) made from ``directory``'s files, versioned by the
        records beside them (specjax.ondisk: every file's size and SHA-256, so new contents are a
        new version); None without a directory."""
        if _DIRECTORY is None:
            return None
        records = []
        for f in sorted(os.listdir(directory)):
            if f.endswith(ondisk.RECORD):
                with open(os.path.join(directory, f), "rb") as fh:
                    records.append(f"{f}:{fh.read().hex()}")
        return cls.for_source(f"{what}\n{os.path.abspath(directory)}", "\n".join(records))

    def load(self, part: str) -> Any | None:
        """The stored ``part`` with its arrays on the device (aliasing the mapped file), or None
        if it is absent or does not verify."""
        blob = ondisk.read(os.path.join(self.path, part + ".pkl"))
        data = ondisk.mapped(os.path.join(self.path, part + ".bin")) if blob is not None else None
        if data is None:
            return None
        skeleton, offsets = pickle.loads(blob)

        def array(s: _Slot):
            return to_device(np.ndarray(s.shape, jnp.dtype(s.dtype), buffer=data, offset=offsets[s.index]))

        return jax.tree_util.tree_map(lambda x: array(x) if isinstance(x, _Slot) else x, skeleton)

    def save(self, part: str, tree: Any) -> None:
        """Store ``tree`` (arrays, and picklable values) as ``part``, in a background thread."""
        leaves: list = []

        def slot(x):
            leaves.append(np.asarray(x))
            return _Slot(len(leaves) - 1, leaves[-1].dtype.name, tuple(leaves[-1].shape))

        skeleton = jax.tree_util.tree_map(lambda x: slot(x) if _is_array(x) else x, tree)

        def write():
            try:
                os.makedirs(self.path, exist_ok=True)
            except OSError as e:
                ondisk.warn_once("write:" + self.path, "could not write %s (%s); going on without it", self.path, e)
                return
            offsets = ondisk.write_mapped(os.path.join(self.path, part + ".bin"), leaves)
            if offsets is not None and ondisk.write(os.path.join(self.path, part + ".pkl"),
                                                    pickle.dumps((skeleton, offsets))):
                self._forget_older()

        t = threading.Thread(target=write, name=f"specjax-store-{part}")
        t.start()
        _writes.append(t)

    def cached(self, part: str, build: Callable[[], Any]) -> Any:
        """The stored ``part``, else ``build()`` (stored now)."""
        hit = self.load(part)
        if hit is None:
            hit = build()
            self.save(part, hit)
        return hit

    def _forget_older(self) -> None:
        """Remove the file's entries for other versions (their mapped pages stay valid for a
        process that still maps them)."""
        parent, mine = os.path.split(self.path)
        for other in os.listdir(parent):
            if other != mine:
                shutil.rmtree(os.path.join(parent, other), ignore_errors=True)


def wait() -> None:
    """Until the writes started so far are done."""
    while _writes:
        _writes.pop().join()
