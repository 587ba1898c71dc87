"""The peers' plumbing without their venvs (no torch, no llama_cpp): the one-line error of an
environment that lacks a peer's modules, bench's peer-flag checks, and a fake peer script holding
the peers' contract, whose rows go through run_peer into specbench's summaries and tables."""

from __future__ import annotations

import importlib.util
import json
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


# A peer with the real peers' job and result layout: every prompt's greedy output is its job's
# "outputs" entry, prefilled in 0.1 s and decoded at ``tok_s`` (its own steps); prompt lookup
# takes half the greedy wall time; prefill by length at 1000 tok/s.
FAKE = """
import sys
from specjax.peers import peer_main

def run(job):
    rows = []
    for p in job["prompts"]:
        out = job["outputs"][p["key"]][:job["max_new_tokens"]]
        g = {"prefill_s": 0.1, "decode_s": (len(out) - 1) / job["tok_s"], "new_tokens": len(out),
             "output_ids": out}
        g["wall_s"] = g["prefill_s"] + g["decode_s"]
        rows.append({"key": p["key"], "category": p["category"], "prompt_tokens": len(p["input_ids"]),
                     "greedy": g, "pld": {"wall_s": g["wall_s"] / 2, "new_tokens": len(out), "output_ids": out},
                     "pld_equals_greedy": True})
    return {"rows": rows, "prefill": [{"tokens": len(i), "seconds": len(i) / 1000} for i in job["prefill_prompts"]],
            "env": {"threads": job["threads"], **job["versions"]}}

sys.exit(peer_main(run))
"""


def test_fake_peers_through_run_peer_into_tables(tmp_path, monkeypatch):
    """Two prompts; specjax AR decodes 9 tokens after the first in 0.1 s (90 tok/s) and prompt
    lookup halves its wall time; llama.cpp decodes at 45 tok/s and agrees with AR; transformers at
    30 tok/s and diverges from AR on the second prompt at token 4 of 10."""
    script = tmp_path / "fake_peer.py"
    script.write_text(FAKE)
    for name in ("llamacpp", "hf_pld"):
        monkeypatch.setitem(peers.PEERS, name, peers.Peer(str(script), ("json",)))
    ar_out = [5, 6, 7, 8, 9, 10, 11, 12, 13, 2]
    prompts = [{"key": f"{c}/{i}", "category": c, "input_ids": [1] * 100} for i, c in enumerate(["chat", "sql"])]
    base = {"prompts": prompts, "max_new_tokens": 10, "prefill_prompts": [[3] * 128, [3] * 512], "threads": 2}
    res = {"llamacpp": peers.run_peer("llamacpp", sys.executable, {
               **base, "tok_s": 45.0, "outputs": {p["key"]: ar_out for p in prompts},
               "versions": {"llama_cpp_python": "0.3.36", "system_info": "AVX2 = 1", "omp_wait_policy": "unset"}}),
           "hf": peers.run_peer("hf_pld", sys.executable, {
               **base, "tok_s": 30.0, "outputs": {"chat/0": ar_out, "sql/1": ar_out[:4] + [99] * 6},
               "versions": {"torch": "2.13.0+cpu", "transformers": "5.23.0", "torch_cpu_capability": "AVX2"}})}
    rows = []
    for p in prompts:
        ar = {"wall_s": 0.2, "new_tokens": 10, "prefill_s": 0.1, "decode_s": 0.1, "output_ids": ar_out}
        pl = {"wall_s": 0.1, "new_tokens": 10, "equal_to_ar": True, "_stats": specbench.SpecStats()}
        rows.append({"key": p["key"], "category": p["category"], "prompt_tokens": 100, "ar": ar, "prompt_lookup": pl})
    summary = specbench.summarize(rows, ["chat", "sql"], ["prompt_lookup"], [],
                                  {k: v["rows"] for k, v in res.items()})
    lc, hf = summary[-1]["llamacpp"], summary[-1]["hf"]
    assert lc["greedy_decode_tok_s"] == pytest.approx(45.0) and lc["specjax_ar_decode_ratio"] == pytest.approx(2.0)
    assert lc["greedy_prefill_tok_s"] == pytest.approx(1000.0) and lc["pld_speedup"] == pytest.approx(2.0)
    assert (lc["greedy_equals_specjax_ar"], lc["greedy_token_agreement"]) == (2, 1.0)
    assert hf["specjax_ar_decode_ratio"] == pytest.approx(3.0)
    assert (hf["greedy_equals_specjax_ar"], hf["greedy_token_agreement"]) == (1, pytest.approx(14 / 20))
    assert summary[-1]["ar"]["decode_tok_s"] == pytest.approx(90.0)

    assert "| **overall** | 2 | 0 | 50.0 | 90.0 | **2.00x** | 0.00 | 100.0 | 0 |" in specbench.markdown_table(
        summary, ["prompt_lookup"])
    dec, e2e = specbench.peer_tables(summary, ["prompt_lookup"], ["llamacpp", "hf"])
    assert dec.splitlines()[0] == ("| category | prompts | specjax AR decode tok/s | llama.cpp decode tok/s | "
                                   "specjax / llama.cpp | transformers decode tok/s | specjax / transformers | "
                                   "llama.cpp = specjax AR (prompts, tokens) | transformers = specjax AR (prompts, "
                                   "tokens) |")
    assert "| sql | 1 | 90.0 | 45.0 | 2.00x | 30.0 | 3.00x | 1/1, 100% | 0/1, 40% |" in dec
    assert "| **overall** | 2 | 90.0 | 45.0 | **2.00x** | 30.0 | **3.00x** | 2/2, 100% | 1/2, 70% |" in dec
    # end to end: llama.cpp greedy 10 tokens in 0.3 s (33.3 tok/s), its PLD twice that; transformers
    # 10 in 0.4 s (25.0), its PLD 50.0; specjax prompt lookup 100 tok/s
    assert "prompt_lookup / llama.cpp PLD | prompt_lookup / transformers PLD |" in e2e.splitlines()[0]
    assert "| **overall** | 50.0 | 100.0 | 33.3 | 66.7 | 25.0 | 50.0 | **1.50x** | **2.00x** |" in e2e

    pre = {specbench.PEER_LABELS[k]: {p["tokens"]: p["seconds"] for p in v["prefill"]} for k, v in res.items()}
    pt = specbench.prefill_table({128: 0.064, 512: 0.4, 1024: 1.0}, pre)
    assert "| 128 | 2000 | 1000 | 2.00x | 1000 | 2.00x |" in pt and "| 1024 | 1024 | - | - | - | - |" in pt
    v = specbench.peer_versions(res)
    assert v == {"llamacpp": {"llama_cpp_python": "0.3.36", "system_info": "AVX2 = 1"},
                 "hf": {"torch": "2.13.0+cpu", "transformers": "5.23.0", "torch_cpu_capability": "AVX2"}}
    json.dumps(v)  # (goes into the bench JSON)
    from specjax.models.options import ForwardOptions

    head = specbench.peers_headline(ForwardOptions(rows_kernel=32), {k: r["env"] for k, r in res.items()})
    for words in ("blocks of up to 32 rows", "llama.cpp reads the same blocks", "float32 at load",
                  "n_threads = n_threads_batch = 2", "torch.set_num_threads(2)", "Machine: "):
        assert words in head
    assert "rows kernel off" in specbench.peers_headline(ForwardOptions(), {})
    int8 = specbench.peers_headline(ForwardOptions(rows_kernel=32, rows_activations="int8", attention="cpu"), {})
    assert "every decode and verify block" in int8 and "rounded to int8" in int8
