"""State specjax writes to disk and reads back itself, verified before use.

Every such file (or directory tree, e.g. a checkpoint step) has a record beside it,
``<path>.sha256``: a header naming what it describes, then ``<size> <sha256> <relative path>``
per file (``.`` for a single file). Writers go through ``write`` (the data, then the record, each
to a temporary name and renamed into place) or ``seal`` (a record for a tree another library
wrote); readers through ``read`` / ``verified``, which accept a file only if every byte matches
its record. So a truncated, flipped, swapped (the record names its file) or half-written file is
never loaded; a file that exists but does not verify is logged once (one warning line per path
and process), and the caller rebuilds it (its ``write`` replaces the file) or, for a checkpoint,
takes an older one.

Large arrays that are mapped back rather than read (``write_mapped`` / ``mapped``: a model's
prepared weights) carry a cheaper digest in the same record, ``sum64:``: SHA-256 over the sums
(mod 2**64) of each MiB's 64-bit words. It catches truncation, a damaged or zeroed sector and any
flipped bit as SHA-256 does, in a fifth of the time (a pass at memory speed); what it misses,
words swapped within one MiB, is not a way disks fail. These files are the user's own cache,
never input from elsewhere.

``cache_dir`` is where caches live (``$SPECJAX_CACHE_DIR``, default ``~/.cache/specjax``); a
location that cannot be created or written is one warning, and callers go on without a cache.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile

import numpy as np

log = logging.getLogger(__name__)

RECORD = ".sha256"
_HEADER = "specjax-record 1 "
_warned: set = set()


def warn_once(key: str, msg: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


def _digest(path: str) -> tuple[int, str]:
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            n += len(block)
    return n, h.hexdigest()


def _files(path: str) -> list[str]:
    """The files of a tree, relative to it, sorted (``.`` for a plain file)."""
    if not os.path.isdir(path):
        return ["."]
    out = []
    for dirpath, dirnames, files in os.walk(path):
        dirnames.sort()
        out += [os.path.relpath(os.path.join(dirpath, f), path) for f in sorted(files)]
    return out


def _record(path: str, entries) -> str:
    """The record of ``path`` whose files are ``entries`` ((size, sha256, relative path), ...)."""
    return "".join([_HEADER + os.path.basename(path) + "\n"] + [f"{n} {sha} {rel}\n" for n, sha, rel in entries])


def _record_text(path: str) -> str:
    return _record(path, [(*_digest(os.path.normpath(os.path.join(path, rel))), rel) for rel in _files(path)])


def _replace(path: str, data) -> None:
    """``data`` (bytes, or an iterable of buffers written one after another) into ``path`` through
    a temporary file in its directory (readers see the old file or the whole new one), flushed to
    disk before the rename."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in (data,) if isinstance(data, bytes) else data:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write(path: str, data: bytes) -> bool:
    """Write ``data`` to ``path`` and its record; False if the disk refuses (one warning per
    directory: a full disk is one line, not one per entry)."""
    try:
        _replace(path, data)
        _replace(path + RECORD, _record_text(path).encode())
        return True
    except OSError as e:
        warn_once("write:" + os.path.dirname(path), "could not write %s (%s); going on without it", path, e)
        return False


def seal(path: str) -> bool:
    """Record a file or tree as it is now (one written by another library, complete); False
    (one warning) if the record cannot be written."""
    try:
        _replace(path + RECORD, _record_text(path).encode())
        return True
    except OSError as e:
        warn_once("write:" + os.path.dirname(path), "could not record %s (%s); it will not be reused", path, e)
        return False


def _check(path: str, actual) -> bool:
    """Whether the record beside ``path`` equals ``actual()`` (the record its contents give now);
    a mismatch is logged once."""
    try:
        with open(path + RECORD, encoding="ascii") as f:
            ok = f.read() == actual()
    except (OSError, ValueError):  # no record, one that is not text, or the file vanished
        ok = False
    if not ok:
        warn_once("verify:" + path, "ignoring %s: it does not match the size and hash recorded when it was "
                  "written (damaged or incomplete)", path)
    return ok


def verified(path: str) -> bool:
    """Whether ``path`` (a file or a tree) exists and matches its record byte for byte. One that
    exists but does not match is logged once."""
    return os.path.exists(path) and _check(path, lambda: _record_text(path))


def read(path: str) -> bytes | None:
    """The bytes of ``path`` if they match its record, else None (logged once if it exists).
    The bytes checked are the bytes returned (one read)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data if _check(path, lambda: _record(path, [(len(data), hashlib.sha256(data).hexdigest(), ".")])) else None


MAP_ALIGN = 64  # jax aliases host memory aligned to this on the CPU instead of copying it
_SUM_WORDS = 1 << 17  # 64-bit words per summed MiB


def _sum64(data: np.ndarray) -> str:
    """The ``sum64:`` digest of a byte array (see the module's note)."""
    whole = len(data) // (8 * _SUM_WORDS) * 8 * _SUM_WORDS
    sums = data[:whole].view(np.uint64).reshape(-1, _SUM_WORDS).sum(axis=1, dtype=np.uint64)  # wraps
    return "sum64:" + hashlib.sha256(sums.tobytes() + data[whole:].tobytes()).hexdigest()


def write_mapped(path: str, arrays) -> list[int] | None:
    """``arrays`` (numpy, C-contiguous) end to end in ``path``, each at an offset that is a multiple
    of MAP_ALIGN (returned, for ``mapped``'s reader to view them), and its record (a ``sum64:``
    digest); None, with one warning per directory, if the disk refuses."""
    views = [memoryview(np.ascontiguousarray(a)).cast("B") for a in arrays]
    offsets, at = [], 0
    for v in views:
        at += -at % MAP_ALIGN
        offsets.append(at)
        at += len(v)

    def chunks():
        end = 0
        for off, v in zip(offsets, views):
            yield b"\0" * (off - end)
            yield v
            end = off + len(v)

    try:
        _replace(path, chunks())
        data = np.memmap(path, np.uint8, "r") if at else np.zeros(0, np.uint8)
        _replace(path + RECORD, _record(path, [(at, _sum64(data), ".")]).encode())
        return offsets
    except OSError as e:
        warn_once("write:" + os.path.dirname(path), "could not write %s (%s); going on without it", path, e)
        return None


def mapped(path: str) -> np.ndarray | None:
    """``path`` mapped read-only as bytes if it matches its record (written by ``write_mapped``),
    else None (logged once if it exists). The pages checked are the pages returned."""
    try:
        data = np.memmap(path, np.uint8, "r") if os.path.getsize(path) else np.zeros(0, np.uint8)
    except (OSError, ValueError):
        return None
    return data if _check(path, lambda: _record(path, [(len(data), _sum64(data), ".")])) else None


def cache_dir(sub: str, root: str | None = None) -> str | None:
    """``<root>/<sub>`` (root: ``$SPECJAX_CACHE_DIR``, default ``~/.cache/specjax``), created and
    writable; None, with one warning per location, where it cannot be."""
    root = root or os.environ.get("SPECJAX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "specjax")
    path = os.path.join(root, sub)
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".probe-")
        os.close(fd)
        os.unlink(probe)
        return path
    except OSError as e:
        warn_once("dir:" + root, "cache location %s cannot be used (%s: %s); running without the cache",
                  path, type(e).__name__, e.strerror or e)
        return None
