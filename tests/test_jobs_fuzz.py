"""Fuzzing the JSONL job layer (specjax.jobs) in-process with a fake model (tests/fake_job.py).

For every generated input file (malformed, duplicate, oversized, mistyped, non-UTF-8, boundary
and blank lines, injected device failures) the output holds exactly one line per non-blank input
line, each the record an independent oracle expects, no id twice, and the job returns 0. With
kills at random points (and torn, cut or newline-less last lines after them) and re-runs, the
final output equals an uninterrupted run's. Real SIGKILLs of a subprocess driver, Ctrl-C, the
lock and write failures are covered at the end.
"""

from __future__ import annotations

import io
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fake_job import CONTEXT, DEFAULTS, FakeModel, Killed, fake_result, run_job
from specjax.errors import SpecjaxError
from specjax.jobs import Job, is_blank

HERE = os.path.dirname(os.path.abspath(__file__))
# No example database in the work tree; a failure prints the example and how to reproduce it.
SETTINGS = settings(deadline=None, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
EXAMPLES = int(os.environ.get("SPECJAX_FUZZ_EXAMPLES", "400"))  # generated files per property; more: a longer hunt

# ---------------------------------------------------------------- the generator of input lines

# Lines that must each become an error record under the line's derived id "#N" (none carries a
# usable id): every way a line can be malformed, mistyped, out of range or not UTF-8.
RAW_ERRORS = [
    b"{not json", b"[1, 2]", b'"just a string"', b"123", b"null", b"true", b"{}", b"\x00", b"\x0c{}",
    b'{"prompt": "p"} trailing', b"[" * 3000, b'{"prompt": NaN}', b'{"prompt": "p", "temperature": NaN}',
    b'{"prompt": "p", "top_p": Infinity}', b'{"prompt": "p", "seed": -Infinity}',
    b'{"prompt": "p", "temperature": 1e400}', b'{"prompt": "p", "max_new_tokens": 1e300}',
    b'{"prompt": "p", "top_k": 1000000000000}', b'{"prompt": "p", "seed": 1' + b"0" * 5000 + b"}",
    b'{"prompt": "p", "prompt": "q"}', b'{"prompt": "\\ud800"}', b'{"prompt": "a\\udc80b"}', b'{"prompt": ""}',
    b'{"prompt": "   "}', b'{"prompt": 5}', b'{"prompt": ["a"]}', b'{"prompt": null}', b'{"text": "no prompt"}',
    b'{"id": true, "prompt": "p"}', b'{"id": 1.5, "prompt": "p"}', b'{"id": 2.0, "prompt": "p"}',
    b'{"id": null, "prompt": "p"}', b'{"id": [], "prompt": "p"}', b'{"id": "", "prompt": "p"}',
    b'{"id": "#1", "prompt": "p"}', b'{"id": 9223372036854775808, "prompt": "p"}',
    b'{"id": "' + b"i" * 1100 + b'", "prompt": "p"}', b'{"id": "\\udc80", "prompt": "p"}',
    b"\xff\xfe\xfd", b'{"prompt": "caf\xe9"}', b'{"prompt": "\xed\xa0\x80"}', b'{"prompt": "\xc0\xaf"}',
    b'{"prompt": "' + b"y" * (CONTEXT + 10) + b'"}',
]
BLANKS = [b"", b"   ", b"\t", b"\r", b" \t\r "]
POOL_IDS = ["a", "b", "x y", "\u00e9", "0", "5", 0, 5, -3, 2**63 - 1, -(2**63)]  # "5" and 5 are different ids

UNIVERSAL_BAD = [True, False, "1", None, [], {}, -1, -0.5, 10**30, -(10**30), 1e300]
BAD_VALUES = {
    "max_new_tokens": UNIVERSAL_BAD + [0, 2.9, 3.0, 2**31],
    "top_k": UNIVERSAL_BAD + [2.9, 3.0, 2**31],
    "seed": UNIVERSAL_BAD + [2**32, 3.0],
    "temperature": UNIVERSAL_BAD + [1e-5, 1e5, 1e-320],
    "top_p": UNIVERSAL_BAD + [0, 0.0, 1.0000001, 2],
}
GOOD_FIELDS = {
    "max_new_tokens": st.sampled_from([1, 3, 6, 9, 2**31 - 1]),
    "temperature": st.sampled_from([0, 0.0, 1e-4, 0.7, 1, 1e4]),
    "top_k": st.sampled_from([0, 1, 40, 2**31 - 1]),
    "top_p": st.sampled_from([1e-6, 0.9, 1, 1.0]),
    "seed": st.sampled_from([0, 7, 2**32 - 1]),
}
prompts = st.one_of(st.builds(lambda a, b: a + "p" + b, st.text(max_size=12), st.text(max_size=12)),
                    st.sampled_from(["FAIL-ONCE p1", "FAIL-ONCE p2", "FAIL-ALWAYS p", "REJECT p", "x" * (CONTEXT - 1)]))
ids = st.one_of(st.none(), st.sampled_from(POOL_IDS))


@st.composite
def structured(draw):
    """A record with a pool id (or none) and a prompt; sometimes one field out of the schema."""
    obj = {}
    rid = draw(ids)
    if rid is not None:
        obj["id"] = rid
    obj["prompt"] = draw(prompts)
    obj.update(draw(st.fixed_dictionaries({}, optional=GOOD_FIELDS)))
    bad = None
    if draw(st.integers(0, 3)) == 0:
        bad = draw(st.sampled_from(sorted(BAD_VALUES)))
        obj[bad] = draw(st.sampled_from(BAD_VALUES[bad]))
    keys = list(obj)
    draw(st.randoms()).shuffle(keys)
    return ("rec", json.dumps({k: obj[k] for k in keys}, ensure_ascii=draw(st.booleans())).encode(), obj, bad)


lines = st.one_of(
    structured(), structured(),
    st.sampled_from(RAW_ERRORS).map(lambda b: ("raw", b, None, None)),
    st.sampled_from(BLANKS).map(lambda b: ("blank", b, None, None)),
    st.binary(max_size=30).filter(lambda b: b"prompt" not in b and b"\xef\xbb\xbf" not in b)
      .map(lambda b: b.replace(b"\n", b" ")).map(lambda b: ("blank" if is_blank(b) else "raw", b, None, None)),
)


@st.composite
def input_files(draw):
    specs = draw(st.lists(lines, max_size=30))
    crlf = draw(st.booleans())
    data = b"\n".join(b + (b"\r" if crlf else b"") for _, b, _, _ in specs)
    if specs and draw(st.booleans()):
        data += b"\n"  # the last line may or may not end in a newline
    return specs, data


def expected(specs) -> dict:
    """The oracle: id -> ("result", record) or ("error", message fragment), written without the
    job layer's code."""
    want, owner = {}, {}
    for n, (kind, _, obj, bad) in enumerate(specs, 1):
        if kind == "blank":
            continue
        own = f"#{n}"
        if kind == "raw":
            want[own] = ("error", f"line {n}: ")
            continue
        rid = obj.get("id", own)
        key = (type(rid).__name__, rid)
        if key in owner:
            want[own] = ("error", f"line {n}: duplicate id {json.dumps(rid, ensure_ascii=False)} (already on line "
                                  f"{owner[key]})")
            continue
        owner[key] = n
        p = obj["prompt"]
        if bad is not None:
            want[rid] = ("error", f"line {n}: {bad} must be")
        elif "FAIL-ALWAYS" in p:
            want[rid] = ("error", "generation failed, and again when retried alone: RuntimeError: device error")
        elif "REJECT" in p:
            want[rid] = ("error", "rejected by the engine")
        else:
            fields = {k: obj.get(k, DEFAULTS[k]) for k in DEFAULTS}
            fields = {k: (float(v) if k in ("temperature", "top_p") else v) for k, v in fields.items()}
            fields["tag"] = obj.get("tag")  # (a routing label, carried with the request fields)
            want[rid] = ("result", {"id": rid, "prompt": p, **fake_result(p, fields)})
    return want


def read_out(path) -> list[dict]:
    with open(path, "rb") as f:
        data = f.read()
    assert not data or data.endswith(b"\n"), "the output must end with a complete line"
    return [json.loads(line) for line in data.decode("utf-8").split("\n")[:-1]]  # (not splitlines: U+0085 is no newline)


def check_output(recs, specs):
    want = expected(specs)
    got_ids = [r["id"] for r in recs]
    assert len(recs) == sum(1 for s in specs if s[0] != "blank"), "one output line per non-blank input line"
    assert len({json.dumps(i) for i in got_ids}) == len(got_ids), f"an id twice: {got_ids}"
    by = {json.dumps(r["id"]): r for r in recs}
    assert set(by) == {json.dumps(k) for k in want}
    for k, (kind, what) in want.items():
        r = by[json.dumps(k)]
        if kind == "result":
            assert r == what
        else:
            assert set(r) == {"id", "error"} and what in r["error"], (k, r)
            assert r["error"].startswith("line "), r


def _run(inp, out, **kw):
    log = io.StringIO()
    rc = run_job(inp, out, fsync=False, log=log, **kw)
    return rc, log.getvalue()


# ---------------------------------------------------------------- properties


@settings(SETTINGS, max_examples=EXAMPLES)
@given(input_files(), st.integers(1, 5))
def test_every_input_line_gets_exactly_its_record(case, batch):
    specs, data = case
    with tempfile.TemporaryDirectory() as d:
        inp, out = os.path.join(d, "in.jsonl"), os.path.join(d, "out.jsonl")
        with open(inp, "wb") as f:
            f.write(data)
        rc, log = _run(inp, out, batch=batch)
        assert rc == 0, log
        check_output(read_out(out), specs)
        # A re-run finds everything done and writes nothing.
        before = open(out, "rb").read()
        rc, log = _run(inp, out, batch=batch)
        assert rc == 0 and "written now: 0 results" in log and open(out, "rb").read() == before


def _damage_tail(path, how: str, rng: random.Random) -> None:
    """What a SIGKILL can leave: a torn last line, a complete last line without its newline, or a
    partial record after the last complete line."""
    with open(path, "rb") as f:
        data = f.read()
    if how == "no_newline" and data.endswith(b"\n"):
        data = data[:-1]
    elif how == "torn" and data.endswith(b"\n"):
        start = data.rfind(b"\n", 0, len(data) - 1) + 1
        data = data[:rng.randrange(start, len(data) - 1)]
    elif how == "partial":
        data += b'{"id": "zz", "prompt": "half a rec'
    with open(path, "wb") as f:
        f.write(data)


@settings(SETTINGS, max_examples=max(EXAMPLES // 2, 1))
@given(input_files(), st.integers(1, 4), st.data())
def test_kills_and_reruns_end_with_the_uninterrupted_output(case, batch, data):
    specs, raw = case
    rng = random.Random(data.draw(st.integers(0, 2**32 - 1)))
    with tempfile.TemporaryDirectory() as d:
        inp, ref, out = (os.path.join(d, n) for n in ("in.jsonl", "ref.jsonl", "out.jsonl"))
        with open(inp, "wb") as f:
            f.write(raw)
        assert _run(inp, ref, batch=batch)[0] == 0
        for _ in range(data.draw(st.integers(1, 4))):
            try:
                _run(inp, out, batch=batch, model=FakeModel(kill_after=data.draw(st.integers(1, 6))))
            except Killed:
                pass
            if os.path.exists(out):
                _damage_tail(out, data.draw(st.sampled_from(["none", "no_newline", "torn", "partial"])), rng)
        rc, log = _run(inp, out, batch=batch)
        assert rc == 0, log
        got, want = read_out(out), read_out(ref)
        check_output(got, specs)
        assert sorted(map(json.dumps, got)) == sorted(map(json.dumps, want))


@settings(SETTINGS, max_examples=max(EXAMPLES // 4, 1))
@given(input_files(), st.integers(2, 3), st.data())
def test_replicas_killed_and_rerun_merge_to_the_one_process_output(case, n, data):
    """n data-parallel replicas (Job(replica=(k, n))), each killed 0-2 times with a damaged tail
    and then finished, in a random order: merge_replicas refuses while any part is incomplete,
    then writes exactly the one-process records, in input order; merging again: the same bytes."""
    from specjax.jobs import merge_replicas, parse_input, replica_path

    specs, raw = case
    rng = random.Random(data.draw(st.integers(0, 2**32 - 1)))
    with tempfile.TemporaryDirectory() as d:
        inp, ref, out = (os.path.join(d, n_) for n_ in ("in.jsonl", "ref.jsonl", "out.jsonl"))
        with open(inp, "wb") as f:
            f.write(raw)
        assert _run(inp, ref)[0] == 0
        order = data.draw(st.permutations(range(n)))
        for i, k in enumerate(order):
            for _ in range(data.draw(st.integers(0, 2))):
                try:
                    _run(inp, out, replica=(k, n), model=FakeModel(kill_after=data.draw(st.integers(1, 4))))
                except Killed:
                    pass
                if os.path.exists(replica_path(out, (k, n))):
                    _damage_tail(replica_path(out, (k, n)), data.draw(st.sampled_from(["none", "no_newline", "torn"])),
                                 rng)
            assert _run(inp, out, replica=(k, n))[0] == 0
            if i < n - 1 and parse_input(raw, DEFAULTS).records[order[-1]::n]:
                assert merge_replicas(inp, out, n, DEFAULTS) is None and not os.path.exists(out)
        records = parse_input(raw, DEFAULTS).records
        assert merge_replicas(inp, out, n, DEFAULTS) == len(records)
        got = read_out(out)
        check_output(got, specs)
        assert [g["id"] for g in got] == [r.id for r in records]
        assert sorted(map(json.dumps, got)) == sorted(map(json.dumps, read_out(ref)))
        merged = open(out, "rb").read()
        assert merge_replicas(inp, out, n, DEFAULTS) == len(records) and open(out, "rb").read() == merged


def test_explicit_nasty_file(tmp_path):
    """Every raw error line, every blank form and each injected failure in one file, with a BOM
    (not part of line 1) and CRLF endings."""
    specs = [("rec", json.dumps({"id": "first", "prompt": "p0"}).encode(), {"id": "first", "prompt": "p0"}, None)]
    specs += [("raw", b, None, None) for b in RAW_ERRORS] + [("blank", b, None, None) for b in BLANKS]
    for p in ("FAIL-ONCE q", "FAIL-ALWAYS q", "REJECT q", "ok q"):
        specs.append(("rec", json.dumps({"prompt": p}).encode(), {"prompt": p}, None))
    specs.append(("rec", json.dumps({"id": "first", "prompt": "again"}).encode(), {"id": "first", "prompt": "again"},
                  None))
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes(b"\xef\xbb\xbf" + b"\r\n".join(b for _, b, _, _ in specs) + b"\r\n")
    rc, log = _run(str(inp), str(out), batch=2)
    assert rc == 0, log
    recs = read_out(out)
    check_output(recs, specs)
    errors = {r["id"]: r["error"] for r in recs if "error" in r}
    n0 = 2  # RAW_ERRORS[i] is on line i + 2
    for i, raw in enumerate(RAW_ERRORS):
        assert f"#{i + n0}" in errors, raw[:40]
    msg = {b: errors[f"#{i + n0}"] for i, b in enumerate(RAW_ERRORS)}
    assert "not valid UTF-8" in msg[b"\xff\xfe\xfd"] and "not valid UTF-8" in msg[b'{"prompt": "caf\xe9"}']
    assert "NaN is not a JSON number" in msg[b'{"prompt": "p", "temperature": NaN}']
    assert "max_new_tokens must be an integer, got 1e+300" in msg[b'{"prompt": "p", "max_new_tokens": 1e300}']
    assert "top_k must be an integer in [0, 2147483647]" in msg[b'{"prompt": "p", "top_k": 1000000000000}']
    assert "temperature must be" in msg[b'{"prompt": "p", "temperature": 1e400}']
    assert "appears twice" in msg[b'{"prompt": "p", "prompt": "q"}']
    assert "prompt is not valid UTF-8 text" in msg[b'{"prompt": "\\ud800"}']
    assert "nested too deeply" in msg[b"[" * 3000]
    assert "reserved" in msg[b'{"id": "#1", "prompt": "p"}']
    assert "context" in msg[b'{"prompt": "' + b"y" * (CONTEXT + 10) + b'"}']
    assert "errors; 0 left" in log


# ---------------------------------------------------------------- real kills, Ctrl-C, lock, failures


def _input(path, n=40):
    rows = [json.dumps({"id": f"r{i}", "prompt": f"prompt {i}", "max_new_tokens": 1 + i % 7}).encode() for i in range(n)]
    for i, row in ((5, json.dumps({"id": "r1", "prompt": "duplicate"}).encode()), (9, b'{"id": "bad", "prompt": "caf\xe9"}'),
                   (13, json.dumps({"prompt": "FAIL-ONCE x"}).encode())):
        if i < n:
            rows[i] = row
    with open(path, "wb") as f:
        f.write(b"\n".join(rows) + b"\n")


def test_sigkill_at_random_points_then_rerun_equals_uninterrupted(tmp_path, seed):
    """The fake job in a subprocess, killed with SIGKILL after a random delay, again and again,
    until a run finishes: the output equals an uninterrupted run's."""
    inp, ref, out = (str(tmp_path / n) for n in ("in.jsonl", "ref.jsonl", "out.jsonl"))
    _input(inp)
    assert _run(inp, ref)[0] == 0
    rng = random.Random(seed)
    kills = 0
    for attempt in range(40):
        p = subprocess.Popen([sys.executable, os.path.join(HERE, "fake_job.py"), inp, out, "--sleep", "0.004"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        # (the first kill comes before the job can have started its records: a fast machine
        # once finished all 40 within the first random delay, and the test then proved nothing)
        time.sleep(rng.uniform(0.0, 0.05) if attempt == 0 else rng.uniform(0.0, 0.25) if attempt < 30 else 5.0)
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            kills += 1
        _, err = p.communicate(timeout=60)
        if p.returncode == 0:
            break
        assert p.returncode == -signal.SIGKILL, (seed, err.decode()[-2000:])
    else:
        pytest.fail(f"never finished (seed {seed})")
    assert kills >= 1, f"no run was killed (seed {seed}); the job is too quick for this test"
    assert sorted(map(json.dumps, read_out(out))) == sorted(map(json.dumps, read_out(ref))), f"seed {seed}"


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_stops_after_the_current_batch_and_resumes(tmp_path, sig, status):
    """SIGTERM (a pod scheduler's preemption) is handled as Ctrl-C, with exit status 143."""
    inp, ref, out = (str(tmp_path / n) for n in ("in.jsonl", "ref.jsonl", "out.jsonl"))
    _input(inp, n=12)
    assert _run(inp, ref, batch=3)[0] == 0
    before = signal.getsignal(sig)
    stop = lambda n: os.kill(os.getpid(), sig) if n == 2 else None  # noqa: E731
    rc, log = _run(inp, out, batch=3, model=FakeModel(on_emit=stop))
    assert rc == status and log.strip().splitlines()[-1].startswith("interrupted: "), log
    got = read_out(out)
    served = [r for r in got if "output" in r]
    assert len(served) == 3, "the batch under way when the signal came is finished, then the job stops"
    assert signal.getsignal(sig) is before  # the handler is put back
    rc, log = _run(inp, out, batch=3)
    assert rc == 0, log
    assert sorted(map(json.dumps, read_out(out))) == sorted(map(json.dumps, read_out(ref)))


def test_second_ctrl_c_stops_at_once_but_not_inside_a_line(tmp_path):
    inp, out = str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl")
    _input(inp, n=12)
    sigint = lambda n: os.kill(os.getpid(), signal.SIGINT) if n in (1, 2) else None  # noqa: E731
    rc, log = _run(inp, out, batch=6, model=FakeModel(on_emit=sigint))
    assert rc == 130
    assert len([r for r in read_out(out) if "output" in r]) == 2  # the second Ctrl-C did not wait for the batch

    # A second Ctrl-C that arrives while a line is being written lets the line finish first.
    out2 = str(tmp_path / "out2.jsonl")
    with Job(inp, out2, DEFAULTS, fsync=False, log=io.StringIO(), progress=False) as job:
        real = job.out._write_bytes
        calls = []

        def interrupted_write(data):
            calls.append(1)
            if len(calls) == 3:
                os.kill(os.getpid(), signal.SIGINT)  # the first: stop after this step
                os.kill(os.getpid(), signal.SIGINT)  # the second, mid-line
            real(data[:10])
            real(data[10:])

        job.out._write_bytes = interrupted_write
        from fake_job import prepare

        assert job.serve(prepare, FakeModel().generate, batch=6) == 130
    recs = read_out(out2)
    assert len(recs) == 3


def test_generation_failures_are_retried_alone_then_reported(tmp_path):
    inp, out = str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl")
    rows = [{"id": "a", "prompt": "FAIL-ALWAYS 1"}, {"id": "b", "prompt": "fine"},
            {"id": "c", "prompt": "FAIL-ONCE 2"}, {"id": "d", "prompt": "fine too"}]
    with open(inp, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    model = FakeModel()
    rc, log = _run(inp, out, batch=4, model=model)
    assert rc == 0
    got = {r["id"]: r for r in read_out(out)}
    assert got["a"]["error"] == ("line 1: generation failed, and again when retried alone: RuntimeError: device "
                                 "error (injected)")
    assert {"b", "c", "d"} == {k for k, r in got.items() if "output" in r}
    assert model.calls == 1 + 4  # the batch (c's transient error), then each of its records alone
    assert "written now: 3 results" in log and "1 errors; 0 left" in log


def test_output_lock_same_file_and_unwritable_output(tmp_path):
    inp, out = str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl")
    _input(inp, n=4)
    with Job(inp, out, DEFAULTS, log=io.StringIO(), progress=False):
        with pytest.raises(SpecjaxError, match="another job is writing .*out.jsonl"):
            Job(inp, out, DEFAULTS)
    assert _run(inp, out)[0] == 0  # released on close
    link = str(tmp_path / "link.jsonl")
    os.symlink(inp, link)
    hard = str(tmp_path / "hard.jsonl")
    os.link(inp, hard)
    before = open(inp, "rb").read()
    for same in (inp, link, hard):
        with pytest.raises(SpecjaxError, match="is the input file"):
            Job(inp, same, DEFAULTS)
    assert open(inp, "rb").read() == before
    with pytest.raises(SpecjaxError, match="cannot write the output"):
        Job(inp, os.path.join(inp, "out.jsonl"), DEFAULTS)  # a path under a regular file
    with pytest.raises(SpecjaxError, match="cannot write the output"):
        Job(inp, str(tmp_path), DEFAULTS)  # a directory


def test_a_write_failure_stops_the_job_with_one_error(tmp_path):
    inp, out = str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl")
    _input(inp, n=6)
    from fake_job import prepare

    log = io.StringIO()
    with Job(inp, out, DEFAULTS, fsync=False, log=log, progress=False) as job:
        def full(data):
            raise OSError(28, "No space left on device")

        job.out._write_bytes = full
        with pytest.raises(SpecjaxError, match="cannot write to the output .*No space left"):
            job.serve(prepare, FakeModel().generate)
