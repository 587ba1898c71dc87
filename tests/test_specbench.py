"""specjax.specbench's several-policy report logic on synthetic rows (no model): summaries per
(drafter, policy) pair, the goodput policy's PASS/FAIL checks against AR and the best fixed K."""

from __future__ import annotations

import pytest

from specjax import specbench
from specjax.spec_generate import SpecStats

CATS = ["a", "b"]


def _method(drafter, policy, label, k=None):
    return {"name": specbench.method_name(drafter, policy, True), "drafter": drafter, "policy": policy,
            "label": label, "goodput": k is None, "k": k}


def _rows(walls):
    """walls: method name -> {category: drafter wall}; AR takes 1 s on every prompt."""
    rows = []
    for cat in CATS:
        row = {"key": f"{cat}/1", "category": cat, "ar": {"wall_s": 1.0, "new_tokens": 10}}
        for name, w in walls.items():
            row[name] = {"wall_s": w[cat], "new_tokens": 10, "equal_to_ar": True, "_stats": SpecStats(),
                         "draft_prefill": name.startswith("layer_skip"),
                         "step_records": {"k_step": [0, 2, 0]}}
        rows.append(row)
    return rows


def _report(methods, walls, drafters):
    summary = specbench.summarize(_rows(walls), CATS, [m["name"] for m in methods], [], None)
    checks = specbench.goodput_checks(summary, methods)
    return summary, checks, specbench.check_lines(checks, drafters)


PL = [_method("prompt_lookup", "auto", "SmartSpec"), _method("prompt_lookup", "2", "K=2", 2),
      _method("prompt_lookup", "4", "K=4", 4)]


def test_method_names_and_rotation():
    assert specbench.method_name("suffix", "auto", False) == "suffix"  # one policy: the old keys
    assert specbench.method_name("suffix", "8", True) == "suffix@8"
    xs = ["p", "q", "r"]
    assert [specbench.rotated(xs, i) for i in range(4)] == [xs, ["q", "r", "p"], ["r", "p", "q"], xs]
    assert specbench.rotated([], 3) == []


def test_goodput_passes_when_no_category_is_low_and_it_beats_every_fixed_k():
    walls = {"prompt_lookup@auto": {"a": 0.9, "b": 1.0}, "prompt_lookup@2": {"a": 0.95, "b": 1.0},
             "prompt_lookup@4": {"a": 0.8, "b": 1.2}}
    summary, checks, lines = _report(PL, walls, ["prompt_lookup"])
    over = summary[-1]["drafters"]
    assert over["prompt_lookup@auto"]["speedup"] == pytest.approx(2 / 1.9)
    assert over["prompt_lookup@2"]["k_step_counts"] == {"0": 4, "2": 2}
    (c,) = checks
    assert (c["lowest_category"], c["lowest_ratio"]) == ("b", pytest.approx(1.0)) and c["categories_pass"]
    assert c["best_fixed"] == "prompt_lookup@2" and c["overall_pass"]  # K=2 (1.026x) beats K=4 (1.0x)
    assert lines[0].startswith("PASS: prompt_lookup under SmartSpec: no category below 0.97x AR")
    assert lines[1].startswith("PASS: ") and "best fixed K=2 1.026x" in lines[1]
    assert lines[-1].endswith(": PASS")
    table = specbench.ratio_table(summary, PL)
    assert "| prompt_lookup | SmartSpec | 1.11 | 1.00 | **1.05** |" in table


def test_goodput_fails_on_one_low_category_or_a_better_fixed_k():
    walls = {"prompt_lookup@auto": {"a": 0.9, "b": 1.04}, "prompt_lookup@2": {"a": 0.95, "b": 1.0},
             "prompt_lookup@4": {"a": 0.8, "b": 1.2}}
    _, (c,), lines = _report(PL, walls, ["prompt_lookup"])
    assert not c["categories_pass"] and c["below_floor"] == {"b": pytest.approx(1 / 1.04)}
    assert c["overall_pass"]  # 2 / 1.94 still beats K=2's 2 / 1.95
    assert lines[0].startswith("FAIL: ") and "lowest 0.962x, b" in lines[0] and lines[-1].endswith(": FAIL")
    walls["prompt_lookup@auto"] = {"a": 0.99, "b": 1.0}  # every category fine, but K=2 is faster overall
    _, (c,), lines = _report(PL, walls, ["prompt_lookup"])
    assert c["categories_pass"] and c["overall_pass"] is False
    assert lines[1].startswith("FAIL: ") and "< best fixed K=2" in lines[1] and lines[-1].endswith(": FAIL")


def test_goodput_check_is_incomplete_without_a_fixed_k_or_a_goodput_pair():
    ls = [_method("layer_skip", "auto", "SmartSpec")]
    walls = {"layer_skip@auto": {"a": 1.0, "b": 1.0}}
    _, (c,), lines = _report(ls, walls, ["layer_skip", "suffix"])
    assert c["overall_pass"] is None and c["best_fixed"] is None
    assert lines[1].startswith("N/A: ") and "no fixed K for layer_skip" in lines[1]
    assert lines[-1].endswith("INCOMPLETE (no goodput policy for: suffix)")
    summary = specbench.summarize(_rows(walls), CATS, ["layer_skip@auto"], [], None)
    assert summary[-1]["drafters"]["layer_skip@auto"]["draft_prefills"] == 2
    # fixed K only (auto fell back: no performance model): nothing to check
    fixed = [_method("suffix", "4", "K=4", 4)]
    assert specbench.goodput_checks(specbench.summarize(_rows({"suffix@4": walls["layer_skip@auto"]}), CATS,
                                                        ["suffix@4"], [], None), fixed) == []
    assert specbench.check_lines([], ["suffix"]) == []
