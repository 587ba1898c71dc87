"""JSONL batch jobs: the one layer every JSONL-reading script uses.

Input. The file is read as bytes and split on b"\\n" only. A line of nothing but spaces, tabs
and carriage returns is not a record: it is skipped and gets no output line. Every other line
gets exactly one output line, a result or an ``{"id", "error"}`` record. A line is decoded as
strict UTF-8, so bytes that are not UTF-8 are an error record for that line, never a silent
replacement. It is parsed as strict JSON: no NaN or Infinity, no repeated key. It must be an
object with a non-blank string ``prompt`` and may set ``id`` and the request fields of
``specjax.results.REQUEST_FIELDS``, each checked by the shared schema there, and a ``tag``
(a label a draft router may use). Other keys are ignored.

Ids. An id is a string or an integer, compared by JSON type and value, so 5 and "5" are
different ids. A line without an id, or whose own id cannot be used (wrong type, a duplicate, a
line that does not parse), is identified by ``#<line number>``. User ids may not start with
``#``, so derived ids can never collide with them. When an id repeats, its first line is
served and each later line gets an error record that names both line numbers.

Output. One JSON object per line, appended, flushed and fsynced per record. So a kill at any
moment leaves at most one torn last line. The output is held under an exclusive ``flock`` for
the whole job, and a second job on the same file stops with a one-line error. Input and output
may not be the same file, which is checked after resolving links.

Resume. When the output is opened, a last line without a newline is repaired first: if it
parses, it is a complete record whose newline was lost, and the newline is added; if it does
not, it is a torn write and is cut. Only then are the ids in the output read as the done set.
Records whose id is done are skipped; error records count as done, and deleting an error line
retries that record.

Serving (``Job.serve``). The script gives ``prepare(record)``, which tokenizes and checks the
record against the model, and ``generate(items, emit)``, which generates a batch and calls
``emit(i, result=...)`` or ``emit(i, error=...)`` per item as each finishes. A record whose
``prepare`` fails gets an error record. If ``generate`` raises, each record of the batch that
it did not finish is retried alone, once. A record that fails again gets an error record,
naming both failures, so nothing is lost. The first Ctrl-C stops the job after the current
step: what finished is written, the counts are printed, and the exit status is 130. A second
Ctrl-C stops it at once, but never in the middle of writing a line. SIGTERM (a scheduler's
preemption) does the same with exit status 143.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import fcntl
import json
import os
import signal
import stat
import sys
import threading
from typing import Callable, Iterator, Mapping, Sequence

from specjax.errors import SpecjaxError
from specjax.results import check_tag, check_text, is_int, request_fields

DERIVED = "#"  # prefix of the ids derived from line numbers; reserved
MAX_ID_CHARS = 1024
ID_RANGE = (-(2**63), 2**63 - 1)
_BLANK = b" \t\r"
_BOM = b"\xef\xbb\xbf"
INTERRUPTED = 130  # the exit status of a job stopped by Ctrl-C
TERMINATED = 143  # ... and by SIGTERM (a scheduler's preemption: 128 + 15)


class Terminated(KeyboardInterrupt):
    """SIGTERM outside a job's serving loop (cli.run_job turns it into exit status 143)."""


def raise_terminated(signum, frame):
    raise Terminated


class LineError(ValueError):
    """A line that is not a usable JSON object (the message says why, without the line number)."""


class OutputError(SpecjaxError):
    """The output file could not be written: the job stops (nothing can be recorded)."""


# ---------------------------------------------------------------- lines and strict JSON


def split_lines(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line without its newline). A UTF-8 byte-order mark at the start is
    not part of the first line; the empty string after a final newline is not a line."""
    if data.startswith(_BOM):
        data = data[len(_BOM):]
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    return enumerate(lines, 1)


def is_blank(raw: bytes) -> bool:
    return not raw.strip(_BLANK)


def decode_line(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LineError(f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None


def _no_constant(name):
    raise ValueError(f"{name} is not a JSON number")


def _unique_keys(pairs):
    obj = {}
    for k, v in pairs:
        if k in obj:
            raise ValueError(f"key {k!r} appears twice")
        obj[k] = v
    return obj


def loads_strict(text: str):
    """json.loads without Python's extensions (NaN, Infinity) and without a repeated key silently
    overriding an earlier one. Raises LineError."""
    try:
        return json.loads(text, parse_constant=_no_constant, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as e:
        raise LineError(f"malformed JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise LineError("malformed JSON (nested too deeply)") from None
    except ValueError as e:  # the hooks above, or an integer with more digits than Python converts
        raise LineError(f"malformed JSON ({str(e).split(';')[0]})") from None


def _json_kind(obj) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(obj), "a number")


def _read_bytes(path: str, what: str) -> bytes:
    if not os.path.exists(path):
        raise SpecjaxError(f"{what} not found: {path}")
    if os.path.isdir(path):
        raise SpecjaxError(f"{what} is a directory: {path}")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise SpecjaxError(f"cannot read {what} {path}: {e.strerror}") from None


# ---------------------------------------------------------------- records


def id_key(value) -> tuple:
    """Ids compare by JSON type and value: 5 and "5" are different ids."""
    return ("int", int(value)) if is_int(value) else ("str", value)


def derived_id(line: int) -> str:
    return f"{DERIVED}{line}"


def show_id(value) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def check_id(value):
    """A user id: a non-empty string (not starting with '#', at most 1024 characters, valid
    Unicode) or an integer in the int64 range. Raises LineError."""
    if is_int(value):
        if not ID_RANGE[0] <= int(value) <= ID_RANGE[1]:
            raise LineError(f"'id' must be a string or an integer in [-2**63, 2**63 - 1], got {show_id(int(value))}")
        return int(value)
    if not isinstance(value, str):
        raise LineError(f"'id' must be a string or an integer, got {show_id(value)} ({_json_kind(value)})")
    if not value:
        raise LineError("'id' must not be empty")
    if len(value) > MAX_ID_CHARS:
        raise LineError(f"'id' must be at most {MAX_ID_CHARS} characters, got {len(value)}")
    if value.startswith(DERIVED):
        raise LineError(f"'id' {show_id(value)} starts with '{DERIVED}', which is reserved for the ids of lines "
                        "without one")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise LineError("'id' is not valid UTF-8 text (it holds an unpaired surrogate escape)") from None
    return value


@dataclasses.dataclass
class Record:
    """One non-blank input line. ``error`` set: the line cannot be served (its output is the
    error record). ``fields``: the checked request fields, defaults filled in."""

    line: int
    id: str | int
    prompt: str | None = None
    fields: dict | None = None
    error: str | None = None

    @property
    def key(self) -> tuple:
        return id_key(self.id)


def parse_line(raw: bytes, line: int, defaults: Mapping) -> Record:
    own = derived_id(line)
    try:
        obj = loads_strict(decode_line(raw))
        if not isinstance(obj, dict):
            raise LineError(f"expected a JSON object, got {_json_kind(obj)}")
        rid = check_id(obj["id"]) if "id" in obj else own
    except LineError as e:
        return Record(line, own, error=f"line {line}: {e}")
    try:
        if "prompt" not in obj:
            raise SpecjaxError("missing 'prompt' (the text to continue)")
        prompt = check_text("prompt", obj["prompt"])
        fields = request_fields(obj, defaults) | {"tag": check_tag(obj.get("tag"))}
    except SpecjaxError as e:
        return Record(line, rid, error=f"line {line}: {e}")
    return Record(line, rid, prompt, fields)


@dataclasses.dataclass
class JobInput:
    records: list[Record]
    blank: int  # blank lines (skipped, no output line)


def parse_input(data: bytes, defaults: Mapping) -> JobInput:
    """Every non-blank line as a Record; a repeated id's later lines become error records under
    their derived ids (never served twice, never dropped)."""
    records: list[Record] = []
    first: dict[tuple, int] = {}
    blank = 0
    for line, raw in split_lines(data):
        if is_blank(raw):
            blank += 1
            continue
        rec = parse_line(raw, line, defaults)
        if rec.key in first:
            rec = Record(line, derived_id(line), error=f"line {line}: duplicate id {show_id(rec.id)} "
                                                       f"(already on line {first[rec.key]})")
        first.setdefault(rec.key, line)
        records.append(rec)
    return JobInput(records, blank)


def read_outputs(path: str, *, flag: str, limit: int = 0, field: str | None = None) -> list:
    """Model outputs from a JSONL file, in order: a list of token ids per line ('output_ids') or
    its text ('output', or the text field ``field``) for the caller to tokenize. Unlike job
    input, a bad line here is fatal: a SpecjaxError naming ``path:line``. ``limit`` > 0 stops
    after that many outputs; ``flag`` names the file in the not-found message."""
    if not os.path.exists(path):
        raise SpecjaxError(f"{flag} {path} does not exist")
    data = _read_bytes(path, flag)
    items: list = []
    for i, raw in split_lines(data):
        if is_blank(raw):
            continue
        if limit and len(items) >= limit:
            break
        try:
            rec = loads_strict(decode_line(raw))
        except LineError as e:
            raise SpecjaxError(f"{path}:{i}: {e}") from None
        if not isinstance(rec, dict):
            raise SpecjaxError(f"{path}:{i}: expected a JSON object")
        if field:
            try:
                items.append(check_text(field, rec.get(field), blank_ok=True))
            except SpecjaxError as e:
                raise SpecjaxError(f"{path}:{i}: no usable text field {field!r} ({e})") from None
            continue
        ids = rec.get("output_ids")
        if isinstance(ids, list) and all(is_int(t) and 0 <= t < 2**31 for t in ids):
            items.append(ids)
        elif ids is None and isinstance(rec.get("output"), str):
            try:
                items.append(check_text("output", rec["output"], blank_ok=True))
            except SpecjaxError as e:
                raise SpecjaxError(f"{path}:{i}: {e}") from None
        else:
            raise SpecjaxError(f"{path}:{i}: needs 'output_ids' (non-negative ints) or 'output' (text)")
    return items


# ---------------------------------------------------------------- the output file


def same_file(a: str, b: str) -> bool:
    """Whether two paths name one file: after resolving links (symbolic or hard)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _record_key(raw: bytes):
    """(id key, status) of a complete output line, or None if it is not a record."""
    try:
        obj = loads_strict(decode_line(raw))
    except LineError:
        return None
    if not isinstance(obj, dict) or not (is_int(obj.get("id")) or (isinstance(obj.get("id"), str) and obj["id"])):
        return None
    return id_key(obj["id"]), ("error" if "error" in obj else "ok")


class JobOutput:
    """The output file of a job, locked for its life. ``done``: id key -> "ok" | "error" of every
    record in it (read after the tail is repaired); ``repair``: what was done to the tail."""

    def __init__(self, path: str, *, input_path: str | None = None, fsync: bool = True):
        self.path = path
        self.fsync = fsync
        self.writing = False
        if input_path is not None and os.path.exists(path) and same_file(path, input_path):
            raise SpecjaxError(f"the output {path} is the input file: give another --output_jsonl")
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise SpecjaxError(f"cannot write the output {path}: {e.strerror}") from None
        if not stat.S_ISREG(os.fstat(self.fd).st_mode):  # a FIFO or device: no resume, no repair
            os.close(self.fd)
            raise SpecjaxError(f"the output {path} is not a regular file")
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self.fd)
            if isinstance(e, BlockingIOError):
                raise SpecjaxError(f"another job is writing {path} (it holds the file's lock); wait for it to finish "
                                   "or give another --output_jsonl") from None
            raise SpecjaxError(f"cannot lock the output {path}: {e.strerror}") from None
        self.done: dict[tuple, str] = {}
        self.bad_lines: list[int] = []
        try:
            self.repair = self._scan()
        except OSError as e:
            self.close()
            raise SpecjaxError(f"cannot read the output {path}: {e.strerror}") from None

    def _scan(self) -> str | None:
        offset, tail = 0, None
        with os.fdopen(os.dup(self.fd), "rb") as f:
            f.seek(0)
            for lineno, raw in enumerate(f, 1):
                if raw.endswith(b"\n"):
                    self._note(raw[:-1], lineno)
                else:
                    tail = (offset, raw, lineno)
                offset += len(raw)
        if tail is None:
            return None
        start, raw, lineno = tail
        try:
            loads_strict(decode_line(raw))
        except LineError:
            # A torn write: a proper prefix of a JSON object never parses. Cut it; its record
            # was not done and is served again.
            os.ftruncate(self.fd, start)
            what = f"cut a torn last line ({len(raw)} bytes) left by an interrupted write"
        else:
            # Complete, only its newline was lost: keep it.
            self._write_bytes(b"\n")
            self._note(raw, lineno)
            what = "added the missing newline after the last line (a complete record)"
        if self.fsync:
            os.fsync(self.fd)
        return what

    def _note(self, raw: bytes, lineno: int) -> None:
        if is_blank(raw):
            return
        kv = _record_key(raw)
        if kv is None:
            self.bad_lines.append(lineno)
        else:
            self.done[kv[0]] = kv[1]

    def _write_bytes(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]

    def write(self, obj: dict, status: str) -> None:
        """Append one record as one line, flushed and (``fsync``) synced before returning."""
        try:
            text = json.dumps(obj, ensure_ascii=False, allow_nan=False)
            data = (text + "\n").encode("utf-8")
        except UnicodeEncodeError:  # an unpaired surrogate: \\u-escape it rather than fail
            data = (json.dumps(obj, allow_nan=False) + "\n").encode("ascii")
        self.writing = True
        try:
            self._write_bytes(data)
            if self.fsync:
                os.fsync(self.fd)
        except OSError as e:
            raise OutputError(f"cannot write to the output {self.path}: {e.strerror}") from None
        finally:
            self.writing = False
        self.done[id_key(obj["id"])] = status

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # releases the lock
            self.fd = -1


# ---------------------------------------------------------------- data-parallel replicas


def replica_path(output_path: str, replica: tuple[int, int]) -> str:
    """The part file replica (k, n) writes (the output itself when n == 1)."""
    k, n = replica
    return output_path if n == 1 else f"{output_path}.replica{k}of{n}"


def replica_records(inp: JobInput, replica: tuple[int, int]) -> list[Record]:
    k, n = replica
    if not (isinstance(n, int) and n >= 1 and 0 <= k < n):
        raise SpecjaxError(f"replica {k} of {n}: need 0 <= replica < replicas")
    return inp.records[k::n]


def merge_replicas(input_path: str, output_path: str, replicas: int, defaults: Mapping, *, fsync: bool = True):
    """Once every replica's part file holds all of its records: write ``output_path`` as those
    lines, byte for byte, in input order (deterministic whatever the replicas' timing), atomically
    (a temporary file renamed over it), and return the number of records; else None (a replica is
    not done: the last one to finish merges). Parts are kept: a replica run again finds its work
    done and merges again, to the same bytes."""
    inp = parse_input(_read_bytes(input_path, "input file"), defaults)
    lines: dict[tuple, bytes] = {}
    for k in range(replicas):
        path = replica_path(output_path, (k, replicas))
        try:
            with open(path, "rb") as f:
                for raw in f:
                    kv = _record_key(raw[:-1]) if raw.endswith(b"\n") else None
                    if kv is not None:
                        lines.setdefault(kv[0], raw)
        except FileNotFoundError:
            return None
        if any(r.key not in lines for r in replica_records(inp, (k, replicas))):
            return None
    lock = os.open(output_path + ".merge-lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two replicas finishing together merge one after the other
        tmp = f"{output_path}.merging-{os.getpid()}"
        with open(tmp, "wb") as f:
            for r in inp.records:
                f.write(lines[r.key])
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, output_path)
    finally:
        os.close(lock)
    return len(inp.records)


# ---------------------------------------------------------------- the job


def _describe(e: BaseException | None) -> str:
    if e is None:
        return "no result"
    if isinstance(e, SpecjaxError):
        return str(e)
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:300]}" if msg else type(e).__name__


class Job:
    """One JSONL job: ``Job(input, output, defaults)`` reads and checks the input and opens
    (locks, repairs, scans) the output, all before any model is loaded; ``todo`` is what is left
    to serve; ``serve`` serves it; ``close`` (or the context manager) releases the output.
    ``defaults``: the checked request fields records do not set (``cli.request_defaults``)."""

    def __init__(self, input_path: str, output_path: str, defaults: Mapping, *, fsync: bool = True,
                 log=None, progress: bool = True, replica: tuple[int, int] = (0, 1)):
        """``replica`` (k, n): serve the k-th of n data-parallel replicas' share of the input (its
        records i with i % n == k, ids and duplicates checked over the whole input) into its own
        part file (``replica_path``); ``merge_replicas`` makes the output once every part is done."""
        self.log = log if log is not None else sys.stderr
        self.progress = progress
        self.input_path = input_path
        self.replica = replica
        data = _read_bytes(input_path, "input file")
        self.input = parse_input(data, defaults)
        mine = replica_records(self.input, replica)
        self.out = JobOutput(replica_path(output_path, replica), input_path=input_path, fsync=fsync)
        self.todo = [r for r in mine if r.key not in self.out.done]
        keys = {r.key for r in mine}
        self.stale = sum(1 for k in self.out.done if k not in keys)
        self.already = len(mine) - len(self.todo)
        self.written: collections.Counter = collections.Counter()  # status -> records written now
        self.stopping = False  # Ctrl-C: finish the current step, then stop
        self.interrupted = False
        self.stop_signal = None  # the signal that stopped serving (SIGINT or SIGTERM)
        self._abort = False  # a second Ctrl-C arrived while a line was being written
        self._bar = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self.out.close()

    # ------------------------------------------------------------ reporting

    def note(self, text: str) -> None:
        """A line on the log that does not break the progress bar."""
        if self._bar is not None:
            self._bar.clear()
        print(text, file=self.log, flush=True)
        if self._bar is not None:
            self._bar.refresh()

    def notes(self) -> None:
        """What opening the output found (said before serving)."""
        if self.out.repair:
            self.note(f"note: {self.out.path}: {self.out.repair}")
        if self.out.bad_lines:
            shown = ", ".join(map(str, self.out.bad_lines[:5])) + (", ..." if len(self.out.bad_lines) > 5 else "")
            self.note(f"note: {self.out.path}: line(s) {shown} are not records; left as they are")
        if self.stale:
            self.note(f"note: {self.stale} record(s) in {self.out.path} match no line of {self.input_path}")

    @property
    def left(self) -> int:
        return len(self.todo) - sum(self.written.values())

    def summary(self) -> str:
        ok = {k: v for k, v in sorted(self.written.items()) if k != "error"}
        blank = f", {self.input.blank} blank line(s) skipped" if self.input.blank else ""
        k, n = self.replica
        mine = f" (replica {k} of {n}: {self.already + len(self.todo)})" if n > 1 else ""
        text = (f"{len(self.input.records)} records{mine} ({self.already} already done{blank}); written now: "
                f"{sum(ok.values())} results")
        if ok:
            text += " (" + ", ".join(f"{k} {v}" for k, v in ok.items()) + ")"
        text += f", {self.written['error']} errors; {self.left} left"
        if self.interrupted:
            text = "interrupted: " + text + "; run the same command again to finish"
        return text

    # ------------------------------------------------------------ writing

    def _write(self, rec: Record, result: Mapping | None = None, error: str | None = None) -> None:
        if error is not None:
            obj, status = {"id": rec.id, "error": error}, "error"
        else:
            obj = {"id": rec.id, "prompt": rec.prompt}
            obj.update((k, v) for k, v in result.items() if k not in ("id", "prompt", "error"))
            status = str(result.get("finish_reason", "ok"))
        try:
            self.out.write(obj, status)
        except (TypeError, ValueError):  # a result JSON cannot hold (a NaN, a NumPy scalar): say so
            obj, status = {"id": rec.id, "error": f"line {rec.line}: the result is not valid JSON"}, "error"
            self.out.write(obj, status)
        self.written[status] += 1
        if self._bar is not None:
            self._bar.update(1)
        if self._abort:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def _sigint(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            if not self.stopping:
                self.stopping = True  # polled between steps (should_stop) and between batches
                self.stop_signal = signum
                if self.log is sys.stderr:  # os.write: print() is not safe inside a signal handler
                    with contextlib.suppress(OSError):
                        os.write(2, f"\n{_signal_name(signum)}: stopping after the current step (again: stop "
                                    "now)\n".encode())
            elif self.out.writing:
                self._abort = True  # let the line finish; _write raises right after
            else:
                raise KeyboardInterrupt

        # SIGTERM (preemption on a pod) is handled as Ctrl-C: the current step finishes, what
        # finished is written, the caller checkpoints, and the status says which signal it was.
        old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, h in old.items():
                signal.signal(sig, h)

    # ------------------------------------------------------------ serving

    def should_stop(self) -> bool:
        return self.stopping

    def serve(self, prepare: Callable[[Record], object],
              generate: Callable[[Sequence, Callable], None], *, batch: int = 0) -> int:
        """Serve ``todo`` (see the module docstring); ``batch``: items per ``generate`` call (0 = all
        in one). Returns the exit status: 0, or 130 / 143 when stopped by Ctrl-C / SIGTERM. Prints
        the summary."""
        from tqdm import tqdm

        self.notes()
        try:
            with self._sigint(), tqdm(total=len(self.todo), unit="rec", disable=None if self.progress else True,
                                      file=self.log) as self._bar:
                items = []
                for rec in self.todo:
                    if self.stopping:
                        break
                    if rec.error is not None:
                        self._write(rec, error=rec.error)
                        continue
                    try:
                        items.append((rec, prepare(rec)))
                    except OutputError:
                        raise
                    except Exception as e:  # this record's own failure (tokenizer, context, slots)
                        self._write(rec, error=f"line {rec.line}: {_describe(e)}")
                size = batch if batch > 0 else max(len(items), 1)
                for i in range(0, len(items), size):
                    if self.stopping:
                        break
                    self._serve_batch(items[i:i + size], generate)
        except KeyboardInterrupt:
            self.stopping = True
        except OutputError:
            self._bar = None
            print(self.summary(), file=self.log, flush=True)
            raise
        finally:
            self._bar = None
        self.interrupted = self.stopping
        print(self.summary(), file=self.log, flush=True)
        if not self.interrupted:
            return 0
        return TERMINATED if self.stop_signal == signal.SIGTERM else INTERRUPTED

    def _run(self, batch: Sequence, generate) -> tuple[BaseException | None, list]:
        """One generate call; returns (the exception it raised or None, the items not written)."""
        written: set[int] = set()

        def emit(i: int, result: Mapping | None = None, error: str | None = None) -> None:
            if i in written:
                return
            written.add(i)
            rec = batch[i][0]
            self._write(rec, result, None if error is None else f"line {rec.line}: {error}")

        exc = None
        try:
            generate([item for _, item in batch], emit)
        except OutputError:
            raise
        except Exception as e:  # noqa: BLE001 - a failure outside the record: retried below
            exc = e
        return exc, [b for j, b in enumerate(batch) if j not in written]

    def _serve_batch(self, batch: Sequence, generate) -> None:
        exc, left = self._run(batch, generate)
        if not left or self.stopping:
            return
        # Something outside a single record failed (or a record's error took its batch down):
        # retry each unfinished record alone, once; a second failure is its error record.
        for item in left:
            if self.stopping:
                return
            exc2, still = self._run([item], generate)
            if still and not self.stopping:
                rec = item[0]
                if isinstance(exc2, SpecjaxError):
                    msg = _describe(exc2)  # the record's own problem, now isolated
                else:
                    # (the first failure is not named: it may have been another record's)
                    msg = f"generation failed, and again when retried alone: {_describe(exc2)}"
                self._write(rec, error=f"line {rec.line}: {msg}")


def _signal_name(signum) -> str:
    return "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C"
