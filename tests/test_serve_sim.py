"""launch/serve_sim.py in simulator mode (no model needed): repeated streams are pooled, the
policy order rotates per stream, the table and JSON come out, and flag mistakes are one line."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "launch", "serve_sim.py")
sys.path.insert(0, ROOT)


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_simulated_sweep_pools_repeats(tmp_path):
    out = tmp_path / "sweep.json"
    p = run("--mode", "sim", "--scale", "7b", "--rates", "2,16", "--num_requests", "20", "--repeats", "2",
            "--policies", "none,3,smartspec,oracle", "--out_json", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    assert "SmartSpec vs best fixed" in p.stdout and "mean over 2 independent request streams" in p.stdout
    data = json.loads(out.read_text())
    assert len(data["runs"]) == 2 * 2 * 4 and len(data["pooled"]) == 2 * 4
    for row in data["pooled"]:
        runs = [r for r in data["runs"] if (r["rate"], r["policy"]) == (row["rate"], row["policy"])]
        assert sorted(r["repeat"] for r in runs) == [0, 1]
        assert row["mean_latency_s"] == pytest.approx(sum(r["mean_latency_s"] for r in runs) / 2)
        assert row["latency_runs_s"] == [r["mean_latency_s"] for r in runs]
        assert 0 < row["utilization"] <= 1.0 + 1e-9
    # The two streams differ (seed + repeat), so their latencies do too.
    assert len({r["mean_latency_s"] for r in data["runs"] if r["policy"] == "no-SD" and r["rate"] == 16}) == 2


FLAG_ERRORS = [
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--rates", "0,1"], "--rates must be positive"),
    (["--scale", "9b"], "unknown --scale"),
    (["--policies", "none,7"], "not in --k_buckets"),
    (["--replay_json", "x.json"], "use it with --mode sim (no --scale)"),
    (["--speed_probe"], "use it with --mode real or both"),
    (["--sim_alpha", "1.5"], "--sim_alpha must be in [0, 1]"),
    (["--sim_tree_paths", "missing.json:eagle"], "no measured acceptance for 'eagle'"),
    (["--scale", "", "--sim_tree_paths", "x.json:eagle"], "use it with --scale"),
    (["--prefill_disable", "nan"], "--prefill_disable must be a finite number"),
    (["--prefill_chunk", "100"], "--prefill_chunk must be a power of two"),
    (["--prefill_budget", "-1"], "--prefill_budget must be >= 0"),
    (["--mode", "real", "--scale", "", "--drafters", "draft_model"], "needs --draft_model"),
    (["--mode", "real", "--scale", "", "--drafters", "layer_skip", "--draft_model", "x.gguf"], "only used with"),
]


@pytest.fixture(scope="module")
def flag_error_runs():
    """Every FLAG_ERRORS case run by serve_sim.py's main in one process (tests/flag_errors.py: one
    start-up for the file, not one per case): [(exit status, stderr)]."""
    from flag_errors import run_cases

    return run_cases(SCRIPT, [["--mode", "sim", "--scale", "7b", "--num_requests", "3", "--rates", "1", *args]
                              for args, _ in FLAG_ERRORS])


@pytest.mark.parametrize("case", range(len(FLAG_ERRORS)), ids=[m for _, m in FLAG_ERRORS])
def test_flag_errors_are_one_line(flag_error_runs, case):
    msg = FLAG_ERRORS[case][1]
    code, err = flag_error_runs[case]
    assert code == 2, err[-2000:]
    assert msg in err and "Traceback" not in err


def test_rotated_policy_order():
    from launch.serve_sim import rotated

    pols = ["none", "1", "3", "smartspec"]
    orders = [rotated(pols, r) for r in range(4)]
    assert orders[0] == pols and orders[1] == ["1", "3", "smartspec", "none"]
    assert [o[0] for o in orders] == pols  # each policy leads one stream
    assert rotated(pols, 5) == orders[1]


def _questions(path):
    """A small Spec-Bench-format question file (the replay only needs prompts of some lengths)."""
    turns = ["What is the capital of France?", "Write a haiku about the sea.", "Summarize: " + "the cat sat. " * 12,
             "Explain recursion to a child in two sentences.", "def add(a, b):\n    return a + b\n# test it",
             "List three prime numbers greater than ten."]
    path.write_text("".join(json.dumps({"question_id": i, "category": "c", "turns": [t]}) + "\n"
                            for i, t in enumerate(turns)))
    return str(path)


@pytest.fixture(params=["synthetic", pytest.param("spec_bench", marks=pytest.mark.shared_data)])
def question_file(request, tmp_path):
    """A synthetic question file, and Spec-Bench's own (from the shared data)."""
    if request.param == "synthetic":
        return _questions(tmp_path / "q.jsonl")
    return os.path.join(request.getfixturevalue("shared_data_dir"), "spec_bench", "question.jsonl")


def test_replay_of_saved_real_runs(tmp_path, question_file):
    """--mode sim --replay_json re-simulates saved real runs (their output lengths and measured
    acceptance) and prints the fidelity table against them; a file without the asked-for runs
    is a one-line error."""
    real = [dict(mode="real", drafter="prompt_lookup", rate=1.0, policy=p, repeat=0, out_lens=[8] * 4,
                 mean_latency_s=lat, utilization=0.5, requests=4, errors=0, tokens=32)
            for p, lat in (("no-SD", 1.0), ("SmartSpec", 0.9))]
    acc = {"prompt_lookup": {"per_position": [0.4, 0.8], "propose_prob": 1.0, "draft_len_cap": None,
                             "draft_len_dist": [0.5, 0.0, 0.5]}}
    path = tmp_path / "real.json"
    path.write_text(json.dumps({"runs": real, "acceptance": acc}))
    common = ["--mode", "sim", "--drafters", "prompt_lookup", "--num_requests", "4", "--max_prompt_tokens", "120",
              "--replay_json", str(path), "--question_file", question_file]
    # (the default forward options: a shipped SmolLM2 profile exists for them on AVX2 and AVX-512 CPUs;
    # --rows_kernel 0 has one for AVX-512 only, so an AVX2 machine failed this test)
    p = run(*common, "--rates", "1", "--policies", "none,smartspec")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "Simulator fidelity" in p.stdout and "| prompt_lookup | 1 | SmartSpec | 0.50 | 0.90 |" in p.stdout
    p = run(*common, "--rates", "2", "--policies", "none")
    assert p.returncode == 2 and "no real no-SD run for (rate, repeat) (2.0, 0)" in p.stderr
    # Real runs that carry a speed probe are also simulated on the table scaled by it.
    for r in real:
        r["speed_probe"] = {"1": 3.0, "2": 3.0, "4": 3.0, "8": 3.0}
    path.write_text(json.dumps({"runs": real, "acceptance": acc}))
    p = run(*common, "--rates", "1", "--policies", "none,smartspec")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "**prompt_lookup+probe** (sim)" in p.stdout and "- prompt_lookup+probe, below saturation" in p.stdout
    sim = {}
    for line in p.stdout.splitlines():
        if line.startswith("| prompt_lookup") and "| no-SD |" in line:
            sim[line.split(" | ")[0]] = float(line.split(" | ")[5])
    assert sim["| prompt_lookup+probe"] > 2 * sim["| prompt_lookup"]  # 3x slower steps and prefills
