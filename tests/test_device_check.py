"""benchmarks/device_check.py (the accelerator check) stays runnable: its --tiny CPU smoke run of
the engine section (step cost per K, the engine end to end against the reference AR loop with
token identity asserted, since CPU numerics are exact) exits 0 and writes its report."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_device_check_tiny_engine(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "device_check.py"), "--tiny",
                        "--sections", "env,engine,perf_model", "--reps", "1", "--max_new_tokens", "16", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    report = (tmp_path / "report.md").read_text()
    assert "(engine: ok" in report and "**NO**" not in report
    eng = json.loads((tmp_path / "engine.json").read_text())
    assert eng["identity_asserted"] and all(run["identical"] for run in eng["engine"])
    assert {run["policy"] for run in eng["engine"]} == {"no-SD", "prompt_lookup", "layer_skip1", "eagle", "medusa_tree"}
    assert all(next(run for run in eng["engine"] if run["policy"] == p)["drafted"] > 0 for p in ("eagle", "medusa_tree"))
    assert {c["K"] for c in eng["step_cost"]} == {0, 2, 4, 8}
    assert eng["programs"] and not any(p["k0_extra"] for p in eng["programs"])  # no whole-cache transpose at K = 0
    perf = json.loads((tmp_path / "perf_model.json").read_text())
    assert "(perf_model: ok" in report and perf["report"]["cells"] == 2 * 2 * 3 and perf["steps"]
