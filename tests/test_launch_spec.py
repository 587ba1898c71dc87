"""launch/generate.py with speculative drafters and launch/bench.py, end to end on the tiny model."""

import json
import os
import subprocess
import sys

import pytest
from flag_errors import assert_one_line_error

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GENERATE = os.path.join(ROOT, "launch", "generate.py")
BENCH = os.path.join(ROOT, "launch", "bench.py")
TINY = ["--model", "tiny-random"]


def run(script, *args, timeout=300):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=timeout, env=env)


def _save_tiny(path, **changes):
    from specjax.config import get_model_config
    from specjax.models import llama, weights

    cfg = get_model_config("tiny-random").replace(name=os.path.basename(path), **changes)
    weights.save_safetensors_params(llama.init_random_params(cfg, seed=1), cfg, str(path))
    return str(path)


@pytest.fixture(scope="module")
def draft_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("drafts")
    return {"other_vocab": _save_tiny(d / "tiny-vocab300", vocab_size=300),
            "two_layers": _save_tiny(d / "tiny-2layers", num_layers=2)}


def _assert_metrics(stderr):
    assert "acceptance rate" in stderr and "mean accepted tokens per step" in stderr, stderr[-2000:]
    assert "per-position acceptance [" in stderr, stderr[-2000:]


@pytest.mark.parametrize("extra", [
    ["--drafter", "prompt_lookup", "--pld_max_ngram", "2"],
    ["--drafter", "draft_model", "--draft_model", "two_layers"],
], ids=["prompt_lookup", "draft_model"])
def test_spec_drafter_runs_and_prints_metrics(extra, draft_dirs):
    """A host and a device drafter through generate.py as a user runs it (every drafter's tokens
    against AR: tests/test_launch_matrix.py)."""
    extra = [draft_dirs.get(a, a) for a in extra]
    r = run(GENERATE, "--prompt", "abc abc abc abc", *TINY, "--max_new_tokens", "12", *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "12 tokens (length)" in r.stderr
    assert "excluded" in r.stderr  # compilation happens before generation and is reported apart
    # --policy auto: no performance model for the tiny model here, so a fixed K, said once
    assert "instead of SmartSpec" in r.stderr and "policy K=" in r.stderr, r.stderr[-2000:]
    _assert_metrics(r.stderr)


BAD_SPEC = [
    (["--drafter", "prompt_lookup", "--num_spec_tokens", "16"], "larger than the largest bucket"),
    (["--drafter", "prompt_lookup", "--num_spec_tokens", "3"], "not a bucket"),
    (["--drafter", "prompt_lookup", "--num_spec_tokens", "3", "--k_buckets", "0,1,2"],
     "larger than the largest bucket"),
    (["--drafter", "prompt_lookup", "--k_buckets", "1,2,4"], "and include 0"),
    (["--drafter", "prompt_lookup", "--pld_min_ngram", "3", "--pld_max_ngram", "2"], "min_ngram <= max_ngram"),
    (["--drafter", "layer_skip"], "--draft_layers must be in 1..3"),  # default 8 > 3
    (["--drafter", "layer_skip", "--draft_layers", "4"], "--draft_layers must be in 1..3"),
    (["--drafter", "layer_skip", "--draft_layers", "0"], "--draft_layers must be >= 1"),
    (["--drafter", "draft_model"], "needs --draft_model"),
    (["--drafter", "draft_model", "--draft_model", "other_vocab"], "vocabulary size 300"),
    (["--drafter", "prompt_lookup", "--top_p", "0"], "top_p must be in (0, 1]"),
    (["--drafter", "suffix", "--suffix_min_prob", "1.5"], "min_prob must be in [0, 1]"),
    (["--drafter", "hybrid", "--suffix_tau", "-1"], "--suffix_tau must be >= 0"),
    (["--drafter", "suffix", "--suffix_history_jsonl", "/nonexistent.jsonl"], "does not exist"),
    (["--drafter", "prompt_lookup", "--suffix_history_jsonl", "x.jsonl"], "only used with --drafter suffix"),
    (["--drafter", "prompt_lookup", "--policy", "smartspec"], "no performance model for 'tiny-random|prompt_lookup"),
    (["--drafter", "prompt_lookup", "--policy", "3"], "--policy K=3 is not in --k_buckets"),
    (["--drafter", "prompt_lookup", "--policy", "fast"], "--policy must be auto, smartspec"),
    # (K buckets above a drafter's most drafts a step are not compiled: the default 0,1,2,4,8
    # serves 4 Medusa heads at 0, 1, 2, 4)
    (["--drafter", "medusa", "--nomedusa_tree", "--num_spec_tokens", "8"],
     "num_spec_tokens=8: this drafter takes at most 4 drafts a step"),
    (["--drafter", "medusa", "--nomedusa_tree", "--num_spec_tokens", "8", "--k_buckets", "0,8"],
     "the medusa drafter takes at most 4 drafts a step; --k_buckets [0, 8] has no K in 1..4"),
]


@pytest.fixture(scope="module")
def bad_spec_runs(draft_dirs):
    """Every BAD_SPEC case run by generate.py's main in one process (tests/flag_errors.py: one
    start-up for the file, not one per case): [(exit status, stderr)]."""
    from flag_errors import run_cases

    return run_cases(GENERATE, [["--prompt", "hi", *TINY, *[draft_dirs.get(a, a) for a in args]]
                                for args, _ in BAD_SPEC])


@pytest.mark.parametrize("case", range(len(BAD_SPEC)), ids=[m for _, m in BAD_SPEC])
def test_bad_spec_input_gives_one_line_error(bad_spec_runs, case):
    message = BAD_SPEC[case][1]
    code, err = bad_spec_runs[case]
    assert_one_line_error(code, err, message)


def test_process_ending_during_kernel_warmup_waits_for_it(tmp_path):
    """A launch script warms the suffix kernels in a thread (cli.prewarm_drafter); a process that
    ends while numba compiles them (a short job, a cold disk cache) must let the compile finish:
    a thread killed inside numba's C++ at interpreter exit aborted the process (CI, 2026-12-08)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    r = subprocess.run([sys.executable, "-c", "from specjax import cli; cli.prewarm_drafter('suffix')"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    from specjax.drafters.suffix import kernels

    compiled = {p.name.split("-")[0] for p in (tmp_path / "numba").rglob("*.nbi")}
    used = {f"kernels.{n}" for n, f in vars(kernels).items() if hasattr(f, "py_func")}
    assert used and used <= compiled  # every kernel finished compiling (into the cold cache)


def test_hybrid_with_preloaded_history(tmp_path):
    hist = tmp_path / "hist.jsonl"
    hist.write_text(json.dumps({"output_ids": [97, 98, 99, 32] * 5}) + "\n" + json.dumps({"output": "abc abc"}) + "\n")
    r = run(GENERATE, "--prompt", "abc abc abc abc", *TINY, "--max_new_tokens", "12", "--drafter", "hybrid",
            "--num_spec_tokens", "8", "--suffix_history_jsonl", str(hist))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "12 tokens (length)" in r.stderr
    _assert_metrics(r.stderr)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"output_ids": [1, -2]}) + "\n")
    r = run(GENERATE, "--prompt", "abc", *TINY, "--drafter", "suffix", "--suffix_history_jsonl", str(bad))
    assert r.returncode == 2 and "bad.jsonl:1: needs 'output_ids'" in r.stderr and "Traceback" not in r.stderr


def test_jsonl_with_drafter_reports_metrics(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(json.dumps({"id": str(i), "prompt": "ab " * (i + 2)}) for i in range(3)) + "\n"
                   + json.dumps({"id": "bad", "prompt": ""}) + "\n")
    r = run(GENERATE, "--input_jsonl", str(inp), "--output_jsonl", str(out), *TINY, "--max_new_tokens", "6",
            "--drafter", "prompt_lookup", "--batch_buckets", "1,2", "--k_buckets", "0,4")
    assert r.returncode == 0, r.stderr[-3000:]
    recs = {x["id"]: x for x in map(json.loads, out.read_text().splitlines())}
    assert len(recs) == 4 and "empty prompt" in recs["bad"]["error"]
    assert all(recs[str(i)]["num_tokens"] == 6 for i in range(3))
    _assert_metrics(r.stderr.strip().splitlines()[-1])


CATS = ["writing", "math", "rag"]


def _questions(path):
    qs = [
        {"question_id": 1, "category": "writing", "turns": ["hello hello hello world", "second turn ignored"]},
        {"question_id": 2, "category": "writing", "turns": ["abc abc abc abc"]},
        {"question_id": 3, "category": "writing", "turns": ["dropped by --per_category 2"]},
        {"question_id": 4, "category": "math", "turns": ["1+1=2, 2+2=4, 3+3="]},
        {"question_id": 5, "category": "rag", "turns": ["the cat sat on the mat; the cat sat on the"]},
        {"question_id": 6, "category": "rag", "turns": ["x" * 80]},  # > --max_prompt_tokens 60: skipped
    ]
    path.write_text("\n".join(json.dumps(q) for q in qs) + "\n")
    return str(path)


def test_bench_on_tiny_model(tmp_path):
    js, md, bm = tmp_path / "b.json", tmp_path / "b.md", tmp_path / "BENCHMARKS.md"
    bm.write_text("# Benchmarks\n\nearlier section kept\n")
    r = run(BENCH, *TINY, "--nochat", "--question_file", _questions(tmp_path / "q.jsonl"), "--per_category", "2",
            "--max_new_tokens", "16", "--max_prompt_tokens", "60",
            "--drafters", "prompt_lookup,suffix", "--num_spec_tokens", "8", "--json_out", str(js), "--markdown_out", str(md), "--benchmarks_md", str(bm),
            "--prefix_cache_mb", "64", "--prefill_chunk", "16")  # (a warm store: timed prompts reuse the warm-up's chunks)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(js.read_text())
    pc = res["prefix_cache"]
    assert set(pc) == {"ar", "prompt_lookup", "suffix"} and all(p["hits"] >= 1 and p["tokens_saved"] >= 16 for p in pc.values()), pc
    assert "Prefix cache on (--prefix_cache_mb 64" in r.stdout
    assert [e["category"] for e in res["summary"]] == CATS + ["overall"]
    assert res["num_mismatches"] == 0 and "MISMATCH" not in r.stderr
    assert res["timing"]["compile_events_during_timing"] == 0
    assert res["num_skipped"] == 1 and res["skipped"][0]["category"] == "rag"
    assert "SKIPPED rag/6" in r.stderr
    over = res["summary"][-1]
    assert over["prompts"] == 4 and over["skipped"] == 1
    for d in ("prompt_lookup", "suffix"):  # (every drafter through bench: test_launch_matrix)
        x = over["drafters"][d]
        assert x["speedup"] > 0 and x["mean_accepted_tokens"] >= 1.0 and x["mismatches"] == 0
    assert all(p["ar"]["new_tokens"] == 16 for p in res["prompts"])
    table = md.read_text()
    for c in CATS + ["**overall**", "prompt_lookup speedup", "suffix acc. tok/step"]:
        assert c in table
    assert table.strip().splitlines()[2] in r.stdout  # the same table goes to stdout
    doc = bm.read_text()
    assert "earlier section kept" in doc and table.strip() in doc and "--per_category 2" in doc
    assert doc.count("spec-bench:begin") == 1


def test_bench_several_policies_per_drafter(tmp_path):
    """--policies: every (drafter, policy) pair on every prompt, rotated per prompt; the goodput
    policy's checks against AR and the best fixed K; one policy (and one prefill gate) per pair
    for the whole run. The performance models make a layer-skip draft forward cost 100 target
    steps, so SmartSpec never speculates with it and no prompt runs the draft prefill (it could
    not pay even with every draft accepted: Policy.could_pay)."""
    from specjax.goodput import LinearCost, StepCostModel
    from specjax.engine.spec import EngineSpec
    from specjax.goodput.perf_model import hardware_key, save_model

    perf = str(tmp_path / "perf.json")
    target = LinearCost(0.0, 1e-6, 1e-2)
    code = EngineSpec().code_key()  # the bench's default forward options (no rows kernel for tiny-random)
    save_model(perf, f"tiny-random|prompt_lookup|{hardware_key()}|{code}", StepCostModel(target=target))
    save_model(perf, f"tiny-random|layer_skip2|{hardware_key()}|{code}",
               StepCostModel(target=target, draft=LinearCost(0.0, 1e-6, 1.0)))
    js = tmp_path / "b.json"
    r = run(BENCH, *TINY, "--nochat", "--question_file", _questions(tmp_path / "q.jsonl"), "--per_category", "2",
            "--max_new_tokens", "16", "--draft_layers", "2", "--max_prompt_tokens", "60",
            "--drafters", "prompt_lookup,layer_skip", "--policies", "auto,0,4", "--perf_models", perf,
            "--json_out", str(js))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(js.read_text())
    assert set(res["prefix_cache"].values()) == {None}  # (off unless --prefix_cache_mb is given)
    # ("0" is the policy "none": a drafter's K = 0 path, compared with AR)
    names = [f"{d}@{p}" for d in ("prompt_lookup", "layer_skip") for p in ("auto", "none", "4")]
    assert [m["name"] for m in res["config"]["methods"]] == names and res["config"]["policies"] == ["auto", "none", "4"]
    assert [m["label"] for m in res["config"]["methods"]][:3] == ["SmartSpec", "no-SD", "K=4"]
    assert res["num_mismatches"] == 0 and res["timing"]["compile_events_during_timing"] == 0
    for i, row in enumerate(res["prompts"]):
        assert row["order"][0] == "ar" and row["order"][1:] == names[i % 6:] + names[:i % 6]
        for n in names:
            assert row[n]["equal_to_ar"] and len(row[n]["step_records"]["k_step"]) == row[n]["steps"]
    # SmartSpec with layer skip: drafts can never pay, so no timed prompt ran the draft prefill
    assert [row["layer_skip@auto"]["draft_prefill"] for row in res["prompts"]] == [False] * 4
    assert all(row["layer_skip@4"]["draft_prefill"] for row in res["prompts"])
    assert [c["method"] for c in res["goodput_checks"]] == ["prompt_lookup@auto", "layer_skip@auto"]
    assert res["goodput_checks"][1]["best_fixed"] in ("layer_skip@1", "layer_skip@4")
    assert "| layer_skip | SmartSpec |" in r.stdout and "layer_skip@4 speedup" in r.stdout
    assert len([ln for ln in r.stdout.splitlines() if ln.startswith(("- PASS: ", "- FAIL: "))]) == 4
    assert "- Goodput check over every drafter" in r.stdout


def test_bench_sampled(tmp_path):
    """--temperature > 0: every side samples (the sampled executables warmed, none compiled while
    timing); outputs are not compared token by token, so no mismatch is counted, and the speedup
    is tok/s over AR's (the two sides' outputs differ in length)."""
    js = tmp_path / "b.json"
    r = run(BENCH, *TINY, "--nochat", "--question_file", _questions(tmp_path / "q.jsonl"), "--per_category", "1",
            "--max_new_tokens", "12", "--max_prompt_tokens", "60", "--drafters", "prompt_lookup",
            "--num_spec_tokens", "4", "--temperature", "1.0", "--seed", "3", "--json_out", str(js))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(js.read_text())
    assert not res["config"]["greedy"] and res["config"]["sampling"]["temperature"] == 1.0
    assert res["timing"]["compile_events_during_timing"] == 0 and res["num_mismatches"] == 0
    assert all(p["prompt_lookup"]["equal_to_ar"] is None for p in res["prompts"])
    over = res["summary"][-1]
    x, ar = over["drafters"]["prompt_lookup"], over["ar"]
    assert x["speedup"] == pytest.approx(x["tok_s"] / ar["tok_s"]) and x["mean_accepted_tokens"] >= 1.0
    assert "sampled (temperature 1, top_k 0, top_p 1, seed 3)" in r.stdout and "not compared token by token" in r.stdout


BAD_BENCH = [
    (["--temperature", "-1"], "--temperature must be"),
    (["--temperature", "0.7", "--llamacpp_python", sys.executable], "the peers run greedy only"),
    (["--question_file", "/nonexistent/question.jsonl"], "question file not found"),
    (["--categories", "nosuch"], "unknown categories"),
    (["--drafters", "prompt_lookup,lookahead"], "unknown drafters"),
    (["--num_spec_tokens", "16"], "larger than the largest bucket"),
    (["--hf_python", "/nonexistent/python"], "is not an executable file"),
    (["--policies", "auto,3"], "--policy K=3 is not in --k_buckets"),
    (["--policies", "4,2,4"], "lists a policy twice"),
    (["--policies", ""], "--policies is empty"),
    (["--policy", "4", "--policies", "2,4"], "not both"),
    (["--drafters", "prompt_lookup", "--also_chains"], "--also_chains needs a head drafting trees"),
]


@pytest.fixture(scope="module")
def bad_bench_runs(tmp_path_factory):
    """Every BAD_BENCH case run by bench.py's main in one process (tests/flag_errors.py):
    [(exit status, stderr)]."""
    from flag_errors import run_cases

    base = ["--question_file", _questions(tmp_path_factory.mktemp("bad_bench") / "q.jsonl"), "--nochat"]
    return run_cases(BENCH, [[*TINY, *base, *args] for args, _ in BAD_BENCH])


@pytest.mark.parametrize("case", range(len(BAD_BENCH)), ids=[m for _, m in BAD_BENCH])
def test_bench_bad_input_gives_one_line_error(bad_bench_runs, case):
    message = BAD_BENCH[case][1]
    code, err = bad_bench_runs[case]
    assert_one_line_error(code, err, message)
