"""Run one launch script in this process once per drafter (its flags re-parsed each time) and
write what each run generated to a JSON file; tests/test_launch_matrix.py compares the runs
with the autoregressive one. One process per script: jax, the model and the compiled AR steps
load once, not once per drafter.

  python tests/launch_matrix.py SCRIPT OUT.json WORKDIR
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import flags  # noqa: E402

from specjax import registry  # noqa: E402

PROMPTS = ["abc abc abc abc", "the cat sat on the mat; the cat sat on the", "1 2 3 1 2 3 1 2"]
COMMON = ["--model", "tiny-random", "--max_new_tokens", "10", "--k_buckets", "0,2", "--num_spec_tokens", "2",
          "--policy", "2", "--rows_kernel", "0"]
ENGINE = ["--batch_buckets", "1,4", "--slots", "64", "--prefill_chunk", "16"]
DRAFTERS = ["none", *registry.SPEC_DRAFTERS]


def drafter_flags(d: str, flag: str = "--drafter") -> list[str]:
    """The flags that select drafter ``d`` (a device draft: the tiny model's first 2 layers, or
    the tiny model as its own draft)."""
    extra = {"layer_skip": ["--draft_layers", "2"], "draft_model": ["--draft_model", "tiny-random"],
             "none": ["--policy", "none"]}  # (the last value of a flag wins)
    return [flag, d, *extra.get(d, [])]


def call(mod, argv: list[str], err: list | None = None) -> str:
    """mod.main(argv) with the flags parsed from ``argv``; returns its stdout (SystemExit 0
    expected); what it printed to sys.stderr is appended to ``err`` if given."""
    import time

    t0 = time.perf_counter()
    flags.FLAGS.unparse_flags()
    flags.FLAGS(argv)
    out, errs = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(errs if err is not None else sys.stderr):
        try:
            mod.main([argv[0]])
        except SystemExit as e:
            if e.code:
                raise RuntimeError(f"{argv} exited with {e.code}") from None
    if err is not None:
        err.append(errs.getvalue())
    print(f"[matrix: {' '.join(argv)}: {time.perf_counter() - t0:.1f} s]", file=sys.stderr)
    return out.getvalue()


def jsonl_ids(path: str) -> dict:
    with open(path) as f:
        return {r["id"]: r["output_ids"] for r in map(json.loads, f)}


def main(script: str, out_path: str, work: str) -> None:
    import importlib

    mod = importlib.import_module(f"launch.{script}")
    if hasattr(mod, "define_flags"):
        mod.define_flags()
    inp = os.path.join(work, "in.jsonl")
    with open(inp, "w") as f:
        f.writelines(json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in enumerate(PROMPTS))
    res = {}
    if script == "bench":  # every drafter in one run; the script compares each with its AR baseline
        q = os.path.join(work, "q.jsonl")
        with open(q, "w") as f:
            f.writelines(json.dumps({"question_id": i, "category": "c", "turns": [p]}) + "\n"
                         for i, p in enumerate(PROMPTS))
        js = os.path.join(work, "bench.json")
        argv = [script, *COMMON, "--nochat", "--question_file", q, "--json_out", js, "--draft_layers", "2",
                "--draft_model", "tiny-random", "--drafters", ",".join(DRAFTERS[1:])]
        call(mod, argv)
        with open(js) as f:
            rows = json.load(f)["prompts"]
        for d in DRAFTERS[1:]:  # (bench keeps the verdict, not the tokens)
            res[d] = {r["key"]: r[d]["equal_to_ar"] and r[d]["new_tokens"] == r["ar"]["new_tokens"] for r in rows}
    for d in DRAFTERS if script != "bench" else ():
        if script == "generate":  # the single-prompt path (SpecGenerator) and the JSONL path (the engine)
            # (--compile ahead: the K = 2 step is built before the answer, which would otherwise run
            # plain decode calls until a background build, from step 16, is in: nothing speculated)
            err: list = []
            text = call(mod, [script, *COMMON, *drafter_flags(d), "--prompt", PROMPTS[1], "--compile", "ahead"], err)
            o = os.path.join(work, f"gen_{d}.jsonl")
            call(mod, [script, *COMMON, *ENGINE, *drafter_flags(d), "--input_jsonl", inp, "--output_jsonl", o])
            # the single answer's draft count, from its "[spec ...: ... (accepted/drafted drafts)" line
            drafted = re.search(r"\((\d+)/(\d+) drafts\)", err[0])
            res[d] = {"single": text, "single_drafted": int(drafted.group(2)) if drafted else 0, **jsonl_ids(o)}
        elif script == "batch":
            o = os.path.join(work, f"batch_{d}.jsonl")
            call(mod, [script, *COMMON, *ENGINE, *drafter_flags(d), "--input_jsonl", inp, "--output_jsonl", o])
            res[d] = jsonl_ids(o)
    with open(out_path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
