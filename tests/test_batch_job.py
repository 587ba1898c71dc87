"""launch/batch.py end to end on the tiny model: SIGKILL at a random point of a job over a file of
valid and broken lines, then resume (one line per non-blank input line, no lost or duplicated
ids, resumed greedy outputs equal an uninterrupted run's), error records, one-line flag errors."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "launch", "batch.py")
# Small geometry to keep compilation short; the persistent XLA cache ($SPECJAX_CACHE_DIR, inherited)
# makes every run after the first load its executables instead of compiling them.
GEOM = ["--model", "tiny-random", "--batch_buckets", "1,2", "--k_buckets", "0,1,2", "--num_spec_tokens", "2",
        "--slots", "256", "--max_new_tokens", "150"]


def _env():
    return dict(os.environ, JAX_PLATFORMS="cpu")


def run(*args, timeout=300):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout,
                          env=_env())


def _read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _served(path) -> int:
    """Finished (non-error) records in ``path`` so far (a torn last line is not counted)."""
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for line in f if line.endswith("\n") and '"output_ids"' in line)


def _write_input(path):
    """Valid rows among malformed, mistyped, duplicate, oversized, non-UTF-8, blank and id-less
    lines. Returns (ids served, {id: error fragment}) as JSON texts of the ids."""
    valid = {f"r{i}": f"row {i} {'ab' * (i % 3)}" for i in range(10)}  # <= 16 bytes: one prompt bucket
    lines = [json.dumps({"id": k, "prompt": v}).encode() for k, v in valid.items()]
    lines.insert(2, b"{not json")  # line 3
    lines.insert(5, json.dumps(["not", "an", "object"]).encode())  # line 6
    lines += [json.dumps({"id": "long", "prompt": "x" * 200}).encode(),  # 200 + 150 + 3 > 256 slots
              json.dumps({"id": "short", "prompt": "tiny one", "max_new_tokens": 5}).encode(),
              json.dumps({"id": "badtemp", "prompt": "hello", "temperature": -1}).encode(),
              json.dumps({"id": "r0", "prompt": "a duplicate id"}).encode(),  # line 16
              b"   ",  # line 17: blank, no output line
              b'{"id": "latin1", "prompt": "caf\xe9"}',  # line 18: not UTF-8
              json.dumps({"id": 7, "prompt": "an integer id", "top_k": True}).encode(),
              json.dumps({"prompt": "no id", "max_new_tokens": 3}).encode()]  # line 20
    with open(path, "wb") as f:
        f.write(b"\n".join(lines) + b"\n")
    served = [json.dumps(k) for k in sorted(valid) + ["short", "#20"]]
    errors = {'"#3"': "malformed JSON", '"#6"': "JSON object", '"long"': "KV slots", '"badtemp"': "temperature",
              '"#16"': 'duplicate id "r0" (already on line 1)', '"#18"': "not valid UTF-8", "7": "top_k must be"}
    return served, errors


def test_kill_and_resume(tmp_path):
    inp, ref, out = (str(tmp_path / n) for n in ("in.jsonl", "ref.jsonl", "out.jsonl"))
    served, errors = _write_input(inp)
    args = ["--input_jsonl", inp, *GEOM]

    r = run(*args, "--output_jsonl", ref)  # uninterrupted reference (compiles into the persistent cache)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "compiled" in r.stderr
    want = {json.dumps(x["id"]): x for x in _read(ref)}
    assert sorted(want) == sorted(served + list(errors)) and len(_read(ref)) == len(want)

    seed = random.randrange(2**32)
    threshold = random.Random(seed).randint(1, 6)  # a random point of the job to kill it at
    log = open(tmp_path / "killed.log", "w")
    p = subprocess.Popen([sys.executable, SCRIPT, *args, "--output_jsonl", out], stdout=log, stderr=log, env=_env())
    try:
        deadline = time.time() + 240
        while _served(out) < threshold and p.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        assert p.poll() is None, "the job ended before it could be killed; give it more work"
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        log.close()
    at_kill = _served(out)
    assert threshold <= at_kill < len(served), f"kill did not interrupt the job ({at_kill} of {len(served)} served)"

    r = run(*args, "--output_jsonl", out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"written now: {len(served) - at_kill} results" in r.stderr and "0 errors; 0 left" in r.stderr, \
        (seed, r.stderr[-2000:])
    recs = _read(out)
    ids = [json.dumps(x["id"]) for x in recs]
    assert len(ids) == len(set(ids)), f"duplicated ids: {ids}"
    assert sorted(ids) == sorted(served + list(errors))
    got = {json.dumps(x["id"]): x for x in recs}
    for rid, msg in errors.items():
        assert set(got[rid]) == {"id", "error"} and msg in got[rid]["error"], got[rid]
    assert got['"short"']["num_tokens"] == 5 and got['"r1"']["num_tokens"] == 150
    assert got['"r0"']["prompt"] == "row 0 "  # the first record of a duplicated id is the one served
    assert got['"#20"']["prompt"] == "no id"
    # Greedy decoding is deterministic whatever the batch composition: resumed == uninterrupted.
    assert got == want, f"seed {seed}"


@pytest.mark.parametrize("args, message", [
    (["--input_jsonl", "IN"], "--output_jsonl is required"),
    (["--output_jsonl", "OUT"], "--input_jsonl is required"),
    (["--input_jsonl", "/nonexistent.jsonl", "--output_jsonl", "OUT"], "input file not found"),
    (["--input_jsonl", "IN", "--output_jsonl", "OUT", "--policy", "fast"], "--policy must be auto, smartspec"),
    (["--input_jsonl", "IN", "--output_jsonl", "OUT", "--policy", "7"], "not in --k_buckets"),
    (["--input_jsonl", "IN", "--output_jsonl", "OUT", "--k_buckets", "1,x"], "--k_buckets must be a comma list"),
    (["--input_jsonl", "IN", "--output_jsonl", "OUT", "--k_buckets", "1,2"], "must be non-negative and include 0"),
    (["--input_jsonl", "IN", "--output_jsonl", "OUT", "--drafter", "none", "--policy", "2"], "needs a drafter"),
    (["--input_jsonl", "IN", "--output_jsonl", "OUT", "--temperature", "-1"], "--temperature must be 0 (greedy) or"),
    (["--input_jsonl", "IN", "--output_jsonl", "OUT", "--top_k", "1000000000000"], "--top_k must be an integer in"),
    (["--input_jsonl", "IN", "--output_jsonl", "OUT", "--model", "tiny-random", "--policy", "smartspec",
      "--perf_models", "/nonexistent/perf.json"], "does not exist"),
])
def test_bad_flags_give_one_line_error(tmp_path, args, message):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": "a", "prompt": "hi"}) + "\n")
    out = str(tmp_path / "out.jsonl")
    r = run(*[{"IN": str(inp), "OUT": out}.get(a, a) for a in args], timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, r.stderr[-2000:]
    assert not os.path.exists(out) or not open(out).read()  # nothing served, nothing half-written
