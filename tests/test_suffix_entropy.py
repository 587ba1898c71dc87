"""The empirical-entropy tool: exact values on hand-computable trees, the tool's CLI, bad input."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from specjax.drafters.suffix.entropy import empirical_entropy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_entropy_values():
    # "a b" twice: node a has 2 continuations, both b -> 0 bits.
    assert empirical_entropy([[1, 2], [1, 2]])["mean_entropy_bits"] == 0.0
    # a->b and a->c once each: 1 bit at node a; nothing else repeats.
    r = empirical_entropy([[1, 2], [1, 3]])
    assert r["mean_entropy_bits"] == pytest.approx(1.0) and r["nodes"] == 1
    # Weighted: node a sees b,b,c (H = 0.918, weight 3); node (a b) sees x, y (H = 1, weight 2);
    r = empirical_entropy([[1, 2, 5], [1, 2, 6], [1, 3]])
    h_a = -(2 / 3) * math.log2(2 / 3) - (1 / 3) * math.log2(1 / 3)
    # node (2) also sees 5 and 6 (H = 1, weight 2)
    assert r["mean_entropy_bits"] == pytest.approx((3 * h_a + 2 * 1.0 + 2 * 1.0) / 7)
    # Templated outputs are far more predictable than random ones.
    import numpy as np

    rng = np.random.default_rng(0)
    templ = [[7, 8, 9, int(x), 10, 11, 12] for x in rng.integers(20, 24, 50)]
    rand = [rng.integers(0, 50, 7).tolist() for _ in range(50)]
    assert empirical_entropy(templ)["mean_entropy_bits"] < empirical_entropy(rand)["mean_entropy_bits"]


def test_entropy_cli(tmp_path):
    p = tmp_path / "out.jsonl"
    p.write_text("\n".join(json.dumps({"output_ids": ids}) for ids in [[1, 2, 5], [1, 2, 6], [1, 3]]) + "\n")
    cmd = [sys.executable, os.path.join(ROOT, "launch", "suffix_entropy.py"), "--input_jsonl", str(p)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "0.965 bits" in r.stdout
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"output_ids": [1, 2]}\nnot json\n')
    r = subprocess.run(cmd[:-1] + [str(bad)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "bad.jsonl:2: malformed JSON" in r.stderr and "Traceback" not in r.stderr
