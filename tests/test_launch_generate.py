"""launch/generate.py end to end on the tiny model: clear errors, JSONL error records, resume."""

import json
import os
import random
import subprocess
import sys

import pytest
from flag_errors import assert_one_line_error

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "launch", "generate.py")


def run(*args, timeout=300):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout, env=env)


BAD_INPUT = [
    (["--prompt", ""], "empty prompt"),
    (["--prompt", "   "], "empty prompt"),
    (["--prompt", "hi", "--temperature", "-1"], "--temperature must be 0 (greedy) or in [0.0001, 10000]"),
    (["--prompt", "hi", "--top_p", "1.5"], "top_p must be in (0, 1]"),
    (["--prompt", "hi", "--top_p", "0"], "top_p must be in (0, 1]"),
    (["--prompt", "hi", "--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--prompt", "hi", "--model", "/nonexistent/m.gguf"], "GGUF file not found"),
    (["--prompt", "hi", "--model", "llama2-7b"], "shapes-only config"),
    (["--prompt", "x" * 1100, "--model", "tiny-random"], "context is 1024"),
    (["--model", "tiny-random"], "exactly one of --prompt or --input_jsonl"),
    (["--input_jsonl", "/nonexistent.jsonl", "--output_jsonl", "/tmp/x.jsonl", "--model", "tiny-random"],
     "input file not found"),
    (["--prompt", "hi", "--model", "tiny-random", "--mesh", "1x2"], "--mesh is served by launch/batch.py"),
    (["--prompt", "hi", "--model", "tiny-random", "--scan_layers", "-2"], "--scan_layers must be -1"),
    (["--prompt", "hi", "--model", "tiny-random", "--num_processes", "2"], "splits a JSONL job (--input_jsonl)"),
]


@pytest.fixture(scope="module")
def bad_input_runs():
    """Every BAD_INPUT case run by generate.py's main in one process (tests/flag_errors.py: one
    start-up for the file, not one per case): [(exit status, stderr)]."""
    from flag_errors import run_cases

    return run_cases(SCRIPT, [args for args, _ in BAD_INPUT])


@pytest.mark.parametrize("case", range(len(BAD_INPUT)), ids=[m for _, m in BAD_INPUT])
def test_bad_input_gives_one_line_error(bad_input_runs, case):
    message = BAD_INPUT[case][1]
    code, err = bad_input_runs[case]
    assert_one_line_error(code, err, message)


def test_prompt_runs_on_tiny_model():
    r = run("--prompt", "hello", "--model", "tiny-random", "--max_new_tokens", "5")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "5 tokens (length)" in r.stderr


def _write_input(path):
    lines = [
        json.dumps({"id": "a", "prompt": "hello world"}),
        "{not json",
        json.dumps({"id": "c", "text": "no prompt field"}),
        json.dumps({"id": "d", "prompt": ""}),
        json.dumps({"id": "e", "prompt": "y" * 1100}),
        json.dumps({"id": "f", "prompt": "sampled", "temperature": 0.8, "seed": 3, "max_new_tokens": 4}),
        json.dumps({"id": "g", "prompt": "bad temperature", "temperature": -2}),
        json.dumps(["not", "an", "object"]),
    ] + [json.dumps({"id": f"r{i}", "prompt": f"row {i} " * (i + 1)}) for i in range(6)]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return 14


def _read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_jsonl_records_errors_and_resumes(tmp_path, seed):
    inp, out = str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl")
    n = _write_input(inp)
    args = ["--input_jsonl", inp, "--output_jsonl", out, "--model", "tiny-random", "--max_new_tokens", "6",
            "--batch_buckets", "1,3"]
    r = run(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = _read(out)
    ids = [x["id"] for x in recs]
    assert sorted(ids) == sorted(set(ids)) and len(ids) == n
    by_id = {x["id"]: x for x in recs}
    assert "malformed JSON" in by_id["#2"]["error"]
    assert by_id["c"]["error"] == "line 3: missing 'prompt' (the text to continue)"
    assert "empty prompt" in by_id["d"]["error"]
    assert "context" in by_id["e"]["error"]
    assert "temperature" in by_id["g"]["error"]
    assert "JSON object" in by_id["#8"]["error"]
    assert by_id["f"]["num_tokens"] == 4 and by_id["a"]["num_tokens"] == 6
    first = {k: v for k, v in by_id.items()}

    # Simulate a kill at a random point: drop some records and leave a torn part of the next.
    rng = random.Random(seed)
    with open(out, "rb") as f:
        lines = f.readlines()
    k = rng.randint(1, len(lines) - 1)
    with open(out, "wb") as f:
        f.writelines(lines[:k])
        f.write(lines[k][: rng.randrange(len(lines[k]) - 1)])
    r = run(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{k} already done" in r.stderr, (seed, r.stderr[-2000:])
    recs = _read(out)
    ids = [x["id"] for x in recs]
    assert len(ids) == n and len(set(ids)) == n, (seed, ids)
    # Deterministic generation: resumed records equal the first run's.
    assert {x["id"]: x for x in recs} == first, seed


@pytest.mark.slow
def test_two_processes_split_a_jsonl_job(tmp_path):
    """--num_processes 2 (jax.distributed over a local coordinator): each process serves its share
    of the records and the last to finish writes the output, in input order, with the records
    one process writes. (Slow: the job layer it runs, specjax.jobs, is batch.py's too, and the
    default suite runs it in two processes there, on a mesh: test_sharding's two-process job.)"""
    import socket

    inp, one, two = tmp_path / "in.jsonl", tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": f"p{i} " * (1 + i), "max_new_tokens": 5}) + "\n"
                           for i in range(5)))
    base = ["--model", "tiny-random", "--input_jsonl", str(inp)]
    assert run(*base, "--output_jsonl", str(one)).returncode == 0
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, SCRIPT, *base, "--output_jsonl", str(two), "--num_processes", "2",
                               "--process_id", str(k), "--coordinator_address", f"localhost:{port}"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for k in (0, 1)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for e in errs]
    lines = two.read_text().splitlines()
    assert [json.loads(x)["id"] for x in lines] == list(range(5))
    assert sorted(lines) == sorted(one.read_text().splitlines())
