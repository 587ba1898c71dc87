"""Peers: other inference stacks a benchmark compares with, each run as a subprocess in its own
Python environment (specjax never imports torch and must not depend on it).

Contract: a peer is a script ``python SCRIPT --input job.json --output result.json``; the job is
one JSON object, the result another (each peer's docstring names their fields). The caller runs
it through ``run_peer``, which checks first that the environment has what the peer imports (a
missing one is a one-line ``SpecjaxError``, not a traceback from inside the child). The script
side reads and writes through ``peer_main``. The peer's stdout goes to this process's stderr
(progress bars, logs); peers run one at a time, never beside a specjax measurement.

A new peer is a script holding that contract and one ``PEERS`` entry (llama.cpp is one:
benchmarks/llamacpp_peer.py, llama-cpp-python in a venv of its own). One requirements file per
peer venv pins its versions and says how it is built (benchmarks/requirements-<peer>-peer.txt);
each peer's result records the versions it ran with in its ``env``. This module uses the
standard library only: peer scripts import it from their own environment (``run_peer`` puts the
repository on their PYTHONPATH).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Peer:
    """script: relative to the repository; needs: the modules its environment must import."""

    script: str
    needs: tuple[str, ...]


_HF = ("torch", "transformers", "gguf")
PEERS = {
    # transformers + torch CPU (benchmarks/requirements-hf-peer.txt): greedy by its own KV-cache loop
    # (logits of the last position only) on text prompts, prefill and decode by length
    "hf": Peer("benchmarks/hf_baseline.py", _HF),
    # the same greedy, its prompt lookup decoding and prefill by length, on given token ids (bench)
    "hf_pld": Peer("benchmarks/hf_pld.py", _HF),
    # llama-cpp-python (benchmarks/requirements-llamacpp-peer.txt): greedy, its prompt lookup,
    # prefill by length, parallel sequences
    "llamacpp": Peer("benchmarks/llamacpp_peer.py", ("llama_cpp",)),
}


def _error(msg: str):
    from specjax.errors import SpecjaxError

    return SpecjaxError(msg)


def check_python_flag(flag: str, python) -> None:
    """A ``--<peer>_python`` flag's value, when given, must be an executable file: checked before
    any model loads (the modules it needs are checked when the peer runs)."""
    if python and not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise _error(f"--{flag} {python} is not an executable file")


def missing_modules(python: str, modules) -> list[str]:
    """The ``modules`` the interpreter ``python`` cannot import (found without importing them)."""
    code = ("import importlib.util, sys; "
            "print(','.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))")
    r = subprocess.run([python, "-c", code, *modules], capture_output=True, text=True)
    if r.returncode != 0:
        raise _error(f"{python} does not run: {(r.stderr.strip().splitlines() or ['no output'])[-1]}")
    return [m for m in r.stdout.strip().split(",") if m]


def run_peer(name: str, python: str, job: dict) -> dict:
    """Run peer ``name`` under the interpreter ``python`` on ``job``; its result dict, with
    ``env.subprocess_s`` (the child's whole wall time) added. Raises SpecjaxError (one line) when
    the interpreter or a module the peer needs is missing, or the peer fails."""
    peer = PEERS[name]
    if not python or not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise _error(f"peer {name}: {python!r} is not an executable Python (a venv with {', '.join(peer.needs)}; "
                     "see BENCHMARKS.md)")
    lacks = missing_modules(python, peer.needs)
    if lacks:
        raise _error(f"peer {name}: {python} cannot import {', '.join(lacks)} (install them in that environment; "
                     "see BENCHMARKS.md)")
    script = os.path.join(ROOT, peer.script)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    with tempfile.TemporaryDirectory(prefix=f"specjax_peer_{name}_") as d:
        inp, out = os.path.join(d, "job.json"), os.path.join(d, "result.json")
        with open(inp, "w") as f:
            json.dump(job, f)
        t0 = time.perf_counter()
        r = subprocess.run([python, script, "--input", inp, "--output", out], stdout=sys.stderr, env=env)
        if r.returncode != 0 or not os.path.isfile(out):
            raise _error(f"peer {name} ({peer.script} under {python}) failed with exit status {r.returncode}; "
                         "see its output above")
        with open(out) as f:
            res = json.load(f)
    res.setdefault("env", {})["subprocess_s"] = time.perf_counter() - t0
    return res


def peer_main(run, argv=None) -> int:
    """A peer script's main: ``run(job) -> result`` between the contract's two JSON files."""
    import argparse

    ap = argparse.ArgumentParser(description="a specjax peer (specjax.peers): JSON job in, JSON result out")
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    args = ap.parse_args(argv)
    with open(args.input) as f:
        job = json.load(f)
    res = run(job)
    with open(args.output, "w") as f:
        json.dump(res, f)
    return 0


def run_requested(prompts, eos_ids, gguf: str, prefill_prompts, max_new_tokens: int, hf: dict | None = None,
                  llamacpp: dict | None = None) -> dict:
    """Each peer asked for (``hf`` / ``llamacpp``: its venv's ``python`` and its settings), one
    after the other, on the same token ids (``prompts``: specbench questions with their ``ids``):
    {summary key: result}."""
    import sys

    from specjax.specbench import PEER_LABELS

    base = {"gguf": gguf, "max_new_tokens": max_new_tokens, "eos_ids": list(eos_ids),
            "prompts": [{"key": p["key"], "category": p["category"], "input_ids": p["ids"]} for p in prompts],
            "prefill_prompts": prefill_prompts}
    prefill = ["prefill"] if prefill_prompts else []
    jobs = {}  # summary key: (peer, python, job)
    if hf:
        hf = dict(hf)
        jobs["hf"] = ("hf_pld", hf.pop("python"), {**base, **hf, "modes": ["greedy", "pld"] + prefill})
    if llamacpp:
        lc = dict(llamacpp)
        modes = ["greedy", "pld"] + prefill + (["batch"] if lc.get("batch_sizes") else [])
        jobs["llamacpp"] = ("llamacpp", lc.pop("python"), {**base, **lc, "modes": modes})
    out = {}
    for key, (peer, python, job) in jobs.items():
        print(f"[{PEER_LABELS[key]} peer: {python} {PEERS[peer].script} on {len(prompts)} prompts "
              f"({job['threads']} threads)]", file=sys.stderr)
        out[key] = run_peer(peer, python, job)
    return out
