"""The llama.cpp peer's plumbing without llama_cpp: the one-line error of an environment that
lacks it, bench's peer-flag checks, and the peer columns specbench builds from its rows."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from specjax import peers, specbench
from specjax.errors import SpecjaxError


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is not None, reason="this Python has llama_cpp")
def test_llamacpp_peer_without_llama_cpp_is_one_line():
    with pytest.raises(SpecjaxError, match=r"peer llamacpp: .* cannot import llama_cpp \(install") as e:
        peers.run_peer("llamacpp", sys.executable, {"gguf": "unused.gguf"})
    assert "\n" not in str(e.value)


def test_peer_python_flag_check(tmp_path):
    peers.check_python_flag("llamacpp_python", None)
    peers.check_python_flag("llamacpp_python", sys.executable)
    for bad in (tmp_path / "nope" / "python", tmp_path):
        with pytest.raises(SpecjaxError, match=r"^--llamacpp_python .* is not an executable file$"):
            peers.check_python_flag("llamacpp_python", str(bad))


def test_llamacpp_columns_from_peer_rows():
    """Two prompts, specjax AR decodes 9 tokens in 0.1 s each (90 tok/s); llama.cpp in 0.2 s (45)."""
    rows, lc = [], []
    for i, cat in enumerate(["chat", "sql"]):
        out = [5, 6, 7, 8, 9, 10, 11, 12, 13, 2]
        rows.append({"key": f"{cat}/{i}", "category": cat, "prompt_tokens": 100,
                     "ar": {"wall_s": 0.2, "new_tokens": 10, "prefill_s": 0.1, "decode_s": 0.1, "output_ids": out}})
        lc.append({"key": f"{cat}/{i}", "category": cat, "prompt_tokens": 100,
                   "greedy": {"wall_s": 0.4, "new_tokens": 10, "prefill_s": 0.2, "decode_s": 0.2, "output_ids": out},
                   "pld": {"wall_s": 0.2, "new_tokens": 10, "output_ids": out}, "pld_equals_greedy": True})
    summary = specbench.summarize(rows, ["chat", "sql"], [], [], {"llamacpp": lc})
    x = summary[-1]["llamacpp"]
    assert x["greedy_decode_tok_s"] == pytest.approx(45.0) and x["greedy_prefill_tok_s"] == pytest.approx(500.0)
    assert x["specjax_ar_decode_ratio"] == pytest.approx(2.0) and x["pld_speedup"] == pytest.approx(2.0)
    assert x["greedy_equals_specjax_ar"] == 2 and summary[-1]["ar"]["decode_tok_s"] == pytest.approx(90.0)
    table = specbench.markdown_table(summary, [], ["llamacpp"])
    assert "| AR decode tok/s |" in table and "specjax AR / llama.cpp decode" in table
    assert "| **overall** | 2 | 0 | 50.0 | 90.0 | 0 | 25.0 | 45.0 | **2.00x** | 2.00x | 0 |" in table
    pt = specbench.prefill_table({128: 0.1, 512: 0.4}, {"llama.cpp": {128: 0.2}})
    assert "| 128 | 1280 | 640 | 2.00x |" in pt and "| 512 | 1280 | - | - |" in pt
