"""JSONL job input/output: validation per line, resumable output.

Input lines are objects with a ``prompt`` (string) and an optional ``id`` (else the
1-based line number is the id) and optional per-record overrides
(``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``). A bad line
becomes an ``{"id", "error"}`` record in the output; the job goes on.
Output is appended and flushed per record, so a killed job resumes by skipping ids
already present (``done_ids``), never duplicating one.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterator

from specjax.errors import SpecjaxError

_OVERRIDES = ("max_new_tokens", "temperature", "top_k", "top_p", "seed")


@dataclasses.dataclass
class Record:
    id: str
    prompt: str | None = None
    overrides: dict = dataclasses.field(default_factory=dict)
    error: str | None = None


def read_records(path: str) -> Iterator[Record]:
    if not os.path.isfile(path):
        raise SpecjaxError(f"input file not found: {path}")
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            yield parse_line(line, lineno)


def parse_line(line: str, lineno: int) -> Record:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return Record(id=str(lineno), error=f"line {lineno}: malformed JSON ({e.msg} at column {e.colno})")
    if not isinstance(obj, dict):
        return Record(id=str(lineno), error=f"line {lineno}: expected a JSON object, got {type(obj).__name__}")
    rid = str(obj.get("id", lineno))
    prompt = obj.get("prompt")
    if not isinstance(prompt, str):
        return Record(id=rid, error=f"line {lineno}: missing or non-string 'prompt'")
    if not prompt.strip():
        return Record(id=rid, error=f"line {lineno}: empty prompt")
    overrides = {k: obj[k] for k in _OVERRIDES if k in obj}
    return Record(id=rid, prompt=prompt, overrides=overrides)


def read_outputs(path: str, *, flag: str, limit: int = 0, field: str | None = None) -> list:
    """Model outputs from a JSONL file, in order: a list of token ids per line ('output_ids') or
    its text ('output', or the text field ``field``) for the caller to tokenize. Unlike job
    input, a bad line here is fatal: a SpecjaxError naming ``path:line``. ``limit`` > 0 stops
    after that many outputs; ``flag`` names the file in the not-found message."""
    if not os.path.isfile(path):
        raise SpecjaxError(f"{flag} {path} does not exist")
    items: list = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit and len(items) >= limit:
                break
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise SpecjaxError(f"{path}:{i}: not JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise SpecjaxError(f"{path}:{i}: expected a JSON object")
            if field:
                if not isinstance(rec.get(field), str):
                    raise SpecjaxError(f"{path}:{i}: no text field {field!r}")
                items.append(rec[field])
                continue
            ids = rec.get("output_ids")
            if isinstance(ids, list) and all(isinstance(t, int) and t >= 0 for t in ids):
                items.append(ids)
            elif ids is None and isinstance(rec.get("output"), str):
                items.append(rec["output"])
            else:
                raise SpecjaxError(f"{path}:{i}: needs 'output_ids' (non-negative ints) or 'output' (text)")
    return items


def done_ids(path: str) -> set[str]:
    """Ids already written to an output file (a torn last line from a kill is ignored)."""
    ids: set[str] = set()
    if not os.path.isfile(path):
        return ids
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                ids.add(str(json.loads(line)["id"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return ids


class ResumableWriter:
    """Appends one JSON object per line and flushes + fsyncs it."""

    def __init__(self, path: str):
        self.path = path
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        self._repair_torn_tail()
        self._f = open(path, "a", encoding="utf-8")

    def _repair_torn_tail(self):
        # A job killed mid-write can leave a partial last line; drop it so the
        # file stays valid JSONL (that id was not done and will be redone).
        if not os.path.isfile(self.path) or os.path.getsize(self.path) == 0:
            return
        with open(self.path, "rb+") as f:
            data = f.read()
            if data.endswith(b"\n"):
                return
            cut = data.rfind(b"\n") + 1
            f.truncate(cut)

    def write(self, obj: dict) -> None:
        self._f.write(json.dumps(obj, ensure_ascii=False) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self):
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
