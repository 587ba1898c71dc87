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
    assert "SmartSpec vs best baseline" in p.stdout and "mean over 2 independent request streams" in p.stdout
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


@pytest.mark.parametrize("args, msg", [
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--rates", "0,1"], "--rates must be positive"),
    (["--scale", "9b"], "unknown --scale"),
    (["--policies", "none,7"], "not in --k_buckets"),
])
def test_flag_errors_are_one_line(args, msg):
    p = run("--mode", "sim", "--scale", "7b", "--num_requests", "3", "--rates", "1", *args)
    assert p.returncode == 2, p.stderr[-2000:]
    assert msg in p.stderr and "Traceback" not in p.stderr


def test_rotated_policy_order():
    from launch.serve_sim import rotated

    pols = ["none", "1", "3", "smartspec"]
    orders = [rotated(pols, r) for r in range(4)]
    assert orders[0] == pols and orders[1] == ["1", "3", "smartspec", "none"]
    assert [o[0] for o in orders] == pols  # each policy leads one stream
    assert rotated(pols, 5) == orders[1]
