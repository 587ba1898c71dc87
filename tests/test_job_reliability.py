"""The launch scripts' JSONL jobs end to end on the tiny model: one test per way issue 17 found
them losing, duplicating or altering a record, or ending in a traceback. Each of these failed
before the job layer (specjax.jobs) existed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GEN = os.path.join(ROOT, "launch", "generate.py")
BATCH = os.path.join(ROOT, "launch", "batch.py")
SCRIPTS = {
    "generate": (GEN, ["--model", "tiny-random", "--max_new_tokens", "8", "--batch_buckets", "1,2"]),
    "batch": (BATCH, ["--model", "tiny-random", "--batch_buckets", "1,2", "--k_buckets", "0,1,2",
                      "--num_spec_tokens", "2", "--slots", "256", "--max_new_tokens", "8"]),
}
ENV = dict(os.environ, JAX_PLATFORMS="cpu")


def run(script, *args, timeout=300):
    return subprocess.run([sys.executable, script, *args], capture_output=True, timeout=timeout, env=ENV)


def job(name, inp, out, *extra, timeout=300):
    script, geom = SCRIPTS[name]
    return run(script, "--input_jsonl", str(inp), "--output_jsonl", str(out), *geom, *extra, timeout=timeout)


def err(r) -> str:
    return r.stderr.decode("utf-8", "replace")


def assert_one_line_error(r, needle):
    assert r.returncode == 2, err(r)[-3000:]
    assert "Traceback" not in err(r), err(r)[-3000:]
    last = err(r).strip().splitlines()[-1]
    assert last.startswith("error: ") and needle in last, err(r)[-3000:]


def write_lines(path, rows):
    path.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows))


def read(path) -> list[dict]:
    data = path.read_bytes()
    assert not data or data.endswith(b"\n")
    return [json.loads(x) for x in data.split(b"\n")[:-1]]


ABC = [{"id": "a", "prompt": "first"}, {"id": "b", "prompt": "second"}, {"id": "c", "prompt": "third"}]


@pytest.mark.parametrize("script", ["generate", "batch"])
def test_complete_last_line_without_newline_is_kept(tmp_path, script):
    """Was: counted as done, then cut away by the writer: record "a" silently missing."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, ABC)
    seeded = {"id": "a", "prompt": "first", "output": "kept", "output_ids": [1], "num_prompt_tokens": 5,
              "num_tokens": 1, "finish_reason": "length"}
    out.write_bytes(json.dumps(seeded).encode())  # a complete record, killed before its newline
    r = job(script, inp, out)
    assert r.returncode == 0, err(r)[-3000:]
    recs = read(out)
    assert recs[0] == seeded and sorted(x["id"] for x in recs) == ["a", "b", "c"]
    assert "added the missing newline" in err(r)


def test_duplicate_id_is_served_once_and_reported(tmp_path):
    """Was: launch/generate.py served both lines of a duplicated id."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, ABC + [{"id": "a", "prompt": "again"}])
    r = job("generate", inp, out)
    assert r.returncode == 0, err(r)[-3000:]
    by = {x["id"]: x for x in read(out)}
    assert len(read(out)) == 4 and set(by) == {"a", "b", "c", "#4"}
    assert by["a"]["prompt"] == "first"
    assert by["#4"] == {"id": "#4", "error": 'line 4: duplicate id "a" (already on line 1)'}


@pytest.mark.parametrize("script", ["generate", "batch"])
def test_out_of_range_numbers_are_error_records(tmp_path, script):
    """Was: max_new_tokens 1e300 or top_k 10**12 raised outside the per-record handling; the job
    died with the good records unwritten, on every re-run."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, [ABC[0], b'{"id": "m", "prompt": "x", "max_new_tokens": 1e300}',
                      {"id": "k", "prompt": "x", "top_k": 10**12}, {"id": "s", "prompt": "x", "seed": 2**40},
                      {"id": "t", "prompt": "x", "temperature": True}, ABC[1]])
    r = job(script, inp, out)
    assert r.returncode == 0, err(r)[-3000:]
    by = {x["id"]: x for x in read(out)}
    assert len(by) == 6 and by["a"]["num_tokens"] == 8 and by["b"]["num_tokens"] == 8
    assert by["m"]["error"] == "line 2: max_new_tokens must be an integer, got 1e+300 (float)"
    assert by["k"]["error"] == "line 3: top_k must be an integer in [0, 2147483647], got 1000000000000"
    assert by["s"]["error"].startswith("line 4: seed must be an integer in [0, 4294967295]")
    assert by["t"]["error"] == "line 5: temperature must be a number, got True (bool)"
    assert "4 errors; 0 left" in err(r)


@pytest.mark.parametrize("script, link", [("generate", None), ("batch", "symlink")])
def test_output_that_is_the_input_is_refused(tmp_path, script, link):
    """Was: launch/generate.py appended its output into its input (batch.py compared paths
    without resolving links)."""
    inp = tmp_path / "in.jsonl"
    write_lines(inp, ABC)
    before = inp.read_bytes()
    out = inp
    if link:
        out = tmp_path / "alias.jsonl"
        os.symlink(inp, out)
    r = job(script, inp, out)
    assert_one_line_error(r, "is the input file")
    assert inp.read_bytes() == before


def test_a_second_job_on_a_locked_output_is_refused(tmp_path):
    """Was: no lock, so a second job served every record again into the same file."""
    import fcntl

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, ABC)
    with open(out, "ab") as held:  # another job's lock, as specjax.jobs takes it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        r = job("generate", inp, out)
    assert_one_line_error(r, "another job is writing")
    assert "[loaded" not in err(r) and out.read_bytes() == b""


def test_two_jobs_started_together_on_one_output(tmp_path):
    """Two batch jobs race for one output: one serves everything, the other is refused."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, [{"id": f"r{i}", "prompt": f"row {i}"} for i in range(8)])
    script, geom = SCRIPTS["batch"]
    cmd = [sys.executable, script, "--input_jsonl", str(inp), "--output_jsonl", str(out), *geom]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV) for _ in range(2)]
    res = [(p.wait(timeout=300), p.stderr.read().decode()) for p in procs]
    codes = sorted(c for c, _ in res)
    assert codes == [0, 2], res
    loser = next(e for c, e in res if c == 2)
    assert loser.strip().splitlines()[-1].startswith("error: another job is writing") and "Traceback" not in loser
    ids = [x["id"] for x in read(out)]
    assert sorted(ids) == sorted(f"r{i}" for i in range(8)), "every record exactly once"


def test_non_utf8_input_line_is_an_error_record(tmp_path):
    """Was: decoded with errors='replace', so the model saw, and the output stored, a prompt
    that is not the one in the file."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, [ABC[0], b'{"id": "latin1", "prompt": "caf\xe9"}', ABC[1]])
    r = job("generate", inp, out)
    assert r.returncode == 0, err(r)[-3000:]
    by = {x["id"]: x for x in read(out)}
    assert set(by) == {"a", "#2", "b"}
    assert by["#2"]["error"] == "line 2: not valid UTF-8 (byte 0xe9 at column 32)"


def test_nan_request_rate_is_a_flag_error():
    """Was: serve_sim hung on --rates nan."""
    r = run(os.path.join(ROOT, "launch", "serve_sim.py"), "--mode", "sim", "--scale", "7b", "--num_requests", "3",
            "--rates", "1,nan", timeout=60)
    assert_one_line_error(r, "--rates must be finite numbers")


def test_unwritable_output_is_an_error_before_the_model_loads(tmp_path):
    """Was: a traceback after the model load."""
    inp = tmp_path / "in.jsonl"
    write_lines(inp, ABC)
    r = job("generate", inp, inp / "out.jsonl")  # a path under a regular file
    assert_one_line_error(r, "cannot write the output")
    assert "[loaded" not in err(r)


@pytest.mark.parametrize("args, needle", [
    ([b"--prompt", b"caf\xe9", b"--model", b"tiny-random"], "--prompt is not valid UTF-8 text"),
    # (the system message needs a chat template: SmolLM2's, which the check spares loading)
    ([b"--prompt", b"hi", b"--chat", b"--system", b"\xff", b"--model", b"smollm2-135m"],
     "--system is not valid UTF-8 text"),
    ([b"--prompt", b"hi", b"--drafter", b"suffix", b"--suffix_history_jsonl", b"HIST", b"--model", b"tiny-random"],
     ":2: not valid UTF-8"),
], ids=["prompt", "system", "history"])
def test_non_utf8_text_is_an_error_before_the_model_loads(tmp_path, args, needle):
    """Was: a traceback after the model load (invalid UTF-8 in --prompt or in a history file)."""
    hist = tmp_path / "hist.jsonl"
    hist.write_bytes(b'{"output": "fine"}\n{"output": "caf\xe9"}\n')
    args = [str(hist).encode() if a == b"HIST" else a for a in args]
    r = run(GEN, *args, timeout=120)
    assert_one_line_error(r, needle)
    assert "[loaded" not in err(r)


def test_ctrl_c_writes_what_finished_and_exits_130(tmp_path):
    """Was: Ctrl-C in launch/generate.py ended in a traceback."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    n = 40
    write_lines(inp, [{"id": f"r{i}", "prompt": f"row {i}"} for i in range(n)])
    script, geom = SCRIPTS["generate"]
    p = subprocess.Popen([sys.executable, script, "--input_jsonl", str(inp), "--output_jsonl", str(out), *geom,
                          "--max_new_tokens", "120"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    try:
        deadline = time.time() + 240
        while (not out.exists() or out.read_bytes().count(b"\n") < 2) and p.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        assert p.poll() is None, "the job ended before Ctrl-C; give it more work"
        p.send_signal(signal.SIGINT)
        code = p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    stderr = p.stderr.read().decode()
    assert code == 130 and "Traceback" not in stderr, stderr[-3000:]
    assert "interrupted: " in stderr and "run the same command again" in stderr
    done = read(out)  # every line complete
    assert 2 <= len(done) < n and all(x["num_tokens"] == 120 for x in done)
    r = job("generate", inp, out, "--max_new_tokens", "120")
    assert r.returncode == 0, err(r)[-3000:]
    assert sorted(x["id"] for x in read(out)) == sorted(f"r{i}" for i in range(n))
