"""launch/batch.py end to end on the tiny model: SIGKILL at a random point of a job over a file of
valid and broken lines, then resume (one line per non-blank input line, no lost or duplicated
ids, resumed greedy outputs equal an uninterrupted run's), error records, one-line flag errors."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
from flag_errors import assert_one_line_error

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "launch", "batch.py")
# Small geometry to keep compilation short; the persistent XLA cache ($SPECJAX_CACHE_DIR, inherited)
# makes every run after the first load its executables instead of compiling them. 60 new tokens:
# enough steps per record for a kill to land mid-job, few enough that each run serves quickly.
MAX_NEW = 60
GEOM = ["--model", "tiny-random", "--batch_buckets", "1,2", "--k_buckets", "0,1,2", "--num_spec_tokens", "2",
        "--slots", "256", "--max_new_tokens", str(MAX_NEW)]


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


def _kill_when(ready, args, log_path, sig=signal.SIGKILL) -> int:
    """Start the job with ``args`` and send it ``sig`` as soon as ``ready()`` holds (it must not
    have ended by then). Returns its exit status."""
    log = open(log_path, "w")
    p = subprocess.Popen([sys.executable, SCRIPT, *args], stdout=log, stderr=log, env=_env())
    try:
        deadline = time.time() + 240
        while not ready() and p.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        assert p.poll() is None, "the job ended before it could be killed; give it more work"
        p.send_signal(sig)
        return p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        log.close()


def _write_input(path):
    """Valid rows among malformed, mistyped, duplicate, oversized, non-UTF-8, blank and id-less
    lines. Returns (ids served, {id: error fragment}) as JSON texts of the ids."""
    valid = {f"r{i}": f"row {i} {'ab' * (i % 3)}" for i in range(10)}  # <= 16 bytes: one prompt bucket
    lines = [json.dumps({"id": k, "prompt": v}).encode() for k, v in valid.items()]
    lines.insert(2, b"{not json")  # line 3
    lines.insert(5, json.dumps(["not", "an", "object"]).encode())  # line 6
    lines += [json.dumps({"id": "long", "prompt": "x" * 200}).encode(),  # 200 + MAX_NEW + 3 > 256 slots
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


def test_kill_and_resume(tmp_path, seed):
    """SIGKILL or SIGTERM at a random point, then the same command: every record once, equal to
    an uninterrupted run's."""
    inp, ref, out = (str(tmp_path / n) for n in ("in.jsonl", "ref.jsonl", "out.jsonl"))
    served, errors = _write_input(inp)
    args = ["--input_jsonl", inp, *GEOM]

    # uninterrupted reference, everything compiled before serving (into the persistent cache); the
    # killed and resumed runs compile lazily: the outputs must not depend on it
    r = run(*args, "--output_jsonl", ref, "--compile", "ahead")
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"compiled \d+ executables and ran each once in", r.stderr), r.stderr[-2000:]
    want = {json.dumps(x["id"]): x for x in _read(ref)}
    assert sorted(want) == sorted(served + list(errors)) and len(_read(ref)) == len(want)

    rng = random.Random(seed)
    threshold = rng.randint(1, 6)  # a random point of the job to stop it at
    # SIGKILL, or SIGTERM (a preemption: the step finishes, what finished is written, exit 143)
    sig = rng.choice([signal.SIGKILL, signal.SIGTERM])
    code = _kill_when(lambda: _served(out) >= threshold, [*args, "--output_jsonl", out], tmp_path / "killed.log", sig)
    assert code == (143 if sig == signal.SIGTERM else -signal.SIGKILL), (seed, code)
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
    assert got['"short"']["num_tokens"] == 5 and got['"r1"']["num_tokens"] == MAX_NEW
    assert got['"r0"']["prompt"] == "row 0 "  # the first record of a duplicated id is the one served
    assert got['"#20"']["prompt"] == "no id"
    # Greedy decoding is deterministic whatever the batch composition: resumed == uninterrupted.
    assert got == want, f"seed {seed}"


BAD_FLAGS = [
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
    (["--input_jsonl", "IN", "--output_jsonl", "OUT", "--online_distill", "CK"], "trains a device draft: use --drafter"),
    (["--input_jsonl", "IN", "--output_jsonl", "OUT", "--online_distill", "CK", "--drafter", "layer_skip",
      "--distill_divergence", "jsd"], "keeps its top k: use fkl or tvd"),
    (["--input_jsonl", "IN", "--output_jsonl", "OUT", "--online_distill", "CK", "--drafter", "layer_skip",
      "--num_processes", "2"], "does not combine with --mesh or --num_processes > 1"),
    (["--input_jsonl", "IN", "--output_jsonl", "OUT", "--online_distill", "CK", "--drafter", "eagle",
      "--distill_tags", "a,b"], "refines one eagle head"),
    (["--input_jsonl", "IN", "--output_jsonl", "OUT", "--mesh", "2by4"], "--mesh must be DATAxMODEL"),
    (["--input_jsonl", "IN", "--output_jsonl", "OUT", "--num_processes", "2", "--process_id", "0"],
     "needs --coordinator_address host:port"),
]


@pytest.fixture(scope="module")
def bad_flag_runs(tmp_path_factory):
    """Every BAD_FLAGS case run by launch/batch.py's main in one process (tests/flag_errors.py: a
    start-up per file, not per case), each with its own input and output files; returns
    [(exit status, stderr, output path)]."""
    from flag_errors import run_cases

    cases, outs = [], []
    for i, (args, _) in enumerate(BAD_FLAGS):
        d = tmp_path_factory.mktemp(f"bad{i}")
        (d / "in.jsonl").write_text(json.dumps({"id": "a", "prompt": "hi"}) + "\n")
        outs.append(str(d / "out.jsonl"))
        cases.append([{"IN": str(d / "in.jsonl"), "OUT": outs[-1], "CK": str(d / "ck")}.get(a, a) for a in args])
    return [(code, err, out) for (code, err), out in zip(run_cases(SCRIPT, cases), outs)]


@pytest.mark.parametrize("case", range(len(BAD_FLAGS)), ids=[m for _, m in BAD_FLAGS])
def test_bad_flags_give_one_line_error(bad_flag_runs, case):
    message = BAD_FLAGS[case][1]
    code, err, out = bad_flag_runs[case]
    assert_one_line_error(code, err, message)
    assert not os.path.exists(out) or not open(out).read()  # nothing served, nothing half-written


def _checkpoints(directory) -> list[int]:
    """The steps written and recorded (specjax.ondisk): the ones a restart may restore."""
    if not os.path.isdir(directory):
        return []
    names = os.listdir(directory)
    return sorted(int(n) for n in names if n.isdigit() and n + ".sha256" in names)


def test_online_distillation_survives_a_kill(tmp_path, seed):
    """--online_distill on the tiny model: the self-draft trains every 2 requests and checkpoints
    every update. SIGKILL once a checkpoint is on disk, at a random number of results; the same
    command resumes from the latest checkpoint (its update count goes on from there), writes
    exactly the records not yet written, and every output equals the plain (never trained)
    layer-skip run's: no record lost, duplicated or altered. A checkpoint directory of another
    model is a one-line error that serves nothing."""
    inp, ref, out, ck = (str(tmp_path / n) for n in ("in.jsonl", "ref.jsonl", "out.jsonl", "ck"))
    with open(inp, "w") as f:
        for i in range(40):
            f.write(json.dumps({"id": f"q{i}", "prompt": f"row {i % 5} " + "ab" * (i % 3)}) + "\n")
    geom = [a if a != str(MAX_NEW) else "16" for a in GEOM] + ["--drafter", "layer_skip", "--draft_layers", "1"]
    r = run("--input_jsonl", inp, "--output_jsonl", ref, *geom)
    assert r.returncode == 0, r.stderr[-3000:]
    want = {x["id"]: x for x in _read(ref)}
    distill = ["--online_distill", ck, "--distill_every", "2", "--distill_checkpoint_every", "1", "--distill_lr", "3e-3"]

    threshold = random.Random(seed).randint(8, 24)
    _kill_when(lambda: _served(out) >= threshold and _checkpoints(ck),
               ["--input_jsonl", inp, "--output_jsonl", out, *geom, *distill], tmp_path / "killed.log")
    at_kill, saved = _served(out), _checkpoints(ck)
    assert saved and at_kill < 40, (at_kill, saved)

    # SIGTERM (a pod's preemption) at a random later point: the step finishes, what finished is
    # written, the draft is checkpointed, exit status 143; the next run resumes from that checkpoint.
    term_at = at_kill + random.Random(seed + 1).randint(1, 6)
    code = _kill_when(lambda: _served(out) >= term_at, ["--input_jsonl", inp, "--output_jsonl", out, *geom, *distill],
                      tmp_path / "terminated.log", signal.SIGTERM)
    log = (tmp_path / "terminated.log").read_text()
    assert code == 143 and "Traceback" not in log, log[-3000:]
    # (the first run started from nothing, so its checkpoints are numbered by update count)
    assert f"resumed from checkpoint {saved[-1]} ({saved[-1]} updates" in log and "interrupted: " in log, log[-3000:]
    at_term, saved = _served(out), _checkpoints(ck)
    # The final checkpoint and the update count it holds. They may differ from here on: a
    # checkpoint the kill tore is passed over at restore but keeps its step number, so the next
    # save takes the number after it.
    updates, last = map(int, re.search(r"distillation: (\d+) updates .*; checkpoint (\d+) in ", log).groups())
    assert last == saved[-1] and at_term < 40, (at_term, saved, log[-2000:])

    r = run("--input_jsonl", inp, "--output_jsonl", out, *geom, *distill)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from checkpoint {last} ({updates} updates" in r.stderr, (seed, r.stderr[-2000:])
    assert f"written now: {40 - at_term} results" in r.stderr, (seed, r.stderr[-2000:])
    assert _checkpoints(ck)[-1] > saved[-1]  # it went on training from there
    recs = _read(out)
    assert len(recs) == 40 and {x["id"]: x for x in recs} == want, f"seed {seed}"

    from specjax import ondisk

    with open(os.path.join(ck, "draft.json")) as f:
        spec = json.load(f)
    # as specjax writes it for another model (a hand edit without its record is damage: rewritten)
    ondisk.write(os.path.join(ck, "draft.json"), json.dumps(dict(spec, target="another-model")).encode())
    r = run("--input_jsonl", inp, "--output_jsonl", str(tmp_path / "other.jsonl"), *geom, *distill)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith("error: ") and "holds a draft of another-model" in r.stderr


def test_online_distillation_with_a_draft_per_tag_or_cluster(tmp_path):
    """--distill_tags: a draft per record tag, each in its own directory, trained on its own
    records only; --distill_clusters: drafts per prompt cluster. Outputs equal the plain run's;
    a record whose tag is not a string is an error record, the rest are served."""
    inp, ref = tmp_path / "in.jsonl", str(tmp_path / "ref.jsonl")
    rows = [{"id": f"q{i}", "prompt": ("alpha beta gamma " if i % 2 else "12 34 56 ") + str(i), "tag": "ab"[i % 2]}
            for i in range(16)] + [{"id": "bad", "prompt": "x", "tag": 5}]
    write = "".join(json.dumps(r) + "\n" for r in rows)
    inp.write_text(write)
    geom = [a if a != str(MAX_NEW) else "12" for a in GEOM] + ["--drafter", "layer_skip", "--draft_layers", "1"]
    r = run("--input_jsonl", str(inp), "--output_jsonl", ref, *geom)
    assert r.returncode == 0, r.stderr[-3000:]
    want = {x["id"]: x for x in _read(ref)}
    assert "tag must be a string" in want["bad"]["error"]
    for extra, dirs in ((["--distill_tags", "a,b"], ["a", "b"]),
                        (["--distill_clusters", "2", "--distill_tags", "a"], ["cluster0", "cluster1"])):
        out, ck = tmp_path / f"out{dirs[0]}.jsonl", tmp_path / f"ck{dirs[0]}"
        r = run("--input_jsonl", str(inp), "--output_jsonl", str(out), *geom, "--online_distill", str(ck),
                "--distill_every", "2", *extra)
        assert r.returncode == 0, r.stderr[-3000:]
        assert {x["id"]: x for x in _read(out)} == want
        for d in dirs:
            assert f"online distillation of layer_skip1 in {ck / d}: a new draft" in r.stderr, r.stderr[-2000:]
            assert _checkpoints(ck / d), (d, r.stderr[-2000:])
        if dirs == ["a", "b"]:  # 8 records each, an update every 2 of its own
            assert r.stderr.count("[online distillation: 4 updates") == 2, r.stderr[-2000:]


def test_kv_rows_are_sized_from_the_job_without_a_slots_flag(tmp_path):
    """No --slots: records that need 512 and 1,024 KV slots are served in two slot classes, each
    on rows of its own size (the short ones do not reserve the long ones' cache), with the same
    outputs as one engine whose rows hold the longest record; the classes share one prefix store
    (a long prompt reuses the chunks a short one with the same start stored); a record longer
    than the context is still an error record."""
    inp = tmp_path / "in.jsonl"
    long = "the quick brown fox jumps over the lazy dog " * 14  # ~630 byte tokens
    shared = "Lorem ipsum dolor sit amet, " * 11  # 308 byte tokens: two whole 128-token chunks
    recs = [{"id": "s0", "prompt": "hi"}, {"id": "l0", "prompt": long}, {"id": "s1", "prompt": "hello there"},
            {"id": "l1", "prompt": long[::-1]}, {"id": "huge", "prompt": "x" * 1100},
            {"id": "p0", "prompt": shared + "?"}, {"id": "p1", "prompt": shared + long}]
    inp.write_text("".join(json.dumps(r) + "\n" for r in recs))
    geom = ["--model", "tiny-random", "--batch_buckets", "1", "--k_buckets", "0,2", "--num_spec_tokens", "2",
            "--max_new_tokens", "8", "--input_jsonl", str(inp), "--drafter", "prompt_lookup", "--policy", "2",
            "--prefill_chunk", "128"]
    auto, fixed = str(tmp_path / "auto.jsonl"), str(tmp_path / "fixed.jsonl")
    # (compiled ahead: a lazy table may not have built the store's row ops when p0 runs, and skips storing)
    r = run(*geom, "--output_jsonl", auto, "--compile", "ahead")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 slot classes served (512, 1024 slots per row)" in r.stderr, r.stderr[-3000:]
    assert "512 slots]" in r.stderr and "1024 slots]" in r.stderr
    # p1 (1,024-slot class) starts after the two chunks p0 (512-slot class, served first) stored
    assert "prefix cache: 1/6 prompts hit (17%), 256 of" in r.stderr, r.stderr[-3000:]
    r = run(*geom, "--output_jsonl", fixed, "--slots", "1024")
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = ({o["id"]: o for o in _read(p)} for p in (auto, fixed))
    assert set(a) == {r["id"] for r in recs} and "error" in a["huge"]
    assert {k: o.get("output_ids") for k, o in a.items()} == {k: o.get("output_ids") for k, o in b.items()}


def test_batch_ab_serves_the_job_turn_about(tmp_path):
    """benchmarks/batch_ab.py: every arm serves the whole job, fresh, once per round, in an order
    rotated each round; greedy outputs equal AR's record by record; a job compiled ahead warms a
    suffix drafter's host kernels before serving (serve_job), not on its first drafts."""
    inp, js = tmp_path / "in.jsonl", tmp_path / "ab.json"
    inp.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"row {i} {'ab' * i}"}) + "\n" for i in range(3)))
    geom = [a if a != str(MAX_NEW) else "8" for a in GEOM]
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "batch_ab.py"), *geom, "--input_jsonl",
                        str(inp), "--arms", "none,suffix,none", "--rounds", "2", "--out_dir", str(tmp_path / "runs"),
                        "--json_out", str(js)], capture_output=True, text=True, timeout=300, env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    runs = json.loads(js.read_text())["runs"]
    assert [(x["round"], x["arm"]) for x in runs] == [(0, "ar"), (0, "suffix"), (0, "ar (control 1)"),
                                                      (1, "suffix"), (1, "ar (control 1)"), (1, "ar")]
    assert all(x["rc"] == 0 and x["records"] == x["equal"] == 3 and x["tokens"] > 0 for x in runs)
    # the serving loop's time between device calls is measured apart, less than the serving time
    assert all(0 < x["host_s"] < x["serve_s"] for x in runs)
    assert r.stderr.count("warmed the drafter host kernels") == 2
    assert "| suffix |" in r.stdout and "| ar (control 1) |" in r.stdout

    # --paired: each other arm served beside an AR job of its own, the two taking turns
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "batch_ab.py"), *geom, "--input_jsonl",
                        str(inp), "--arms", "none,prompt_lookup,none", "--rounds", "1", "--paired", "--out_dir",
                        str(tmp_path / "pairs"), "--json_out", str(js)], capture_output=True, text=True, timeout=300,
                       env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    runs = json.loads(js.read_text())["runs"]
    assert sorted(x["arm"] for x in runs) == ["ar (control 1)", "prompt_lookup"]
    for x in runs:
        p = x["partner"]
        assert x["records"] == x["equal"] == 3 and p["tokens"] == x["tokens"] > 0
        # each side's serving time leaves out its waits for the other, which did happen
        assert 0 < x["serve_s"] and 0 < p["serve_s"] and x["waited_s"] + p["waited_s"] > 0
    assert "| prompt_lookup |" in r.stdout and "x the AR beside it" in r.stdout
