"""Spec-Bench-style speed benchmark: specjax speculative drafters vs the specjax AR baseline.

  python launch/bench.py --per_category 10 --max_new_tokens 256 \
      --json_out bench.json --markdown_out bench.md [--hf_python /tmp/hfvenv/bin/python]

Protocol (Spec-Bench conventions where they apply; differences are stated):

- Questions: ``--question_file`` (default ``../shared/data/spec_bench/question.jsonl`` relative
  to the repo root), **first turn only**, wrapped in the model's chat template (``--nochat`` to
  feed raw text); ``--categories`` filters, ``--per_category N`` keeps the first N of each
  category (file order). Prompts longer than ``--max_prompt_tokens``, or that cannot fit
  prompt + ``--max_new_tokens`` + max(K bucket) + 1 in the context, are skipped and counted
  (per category in the table, listed in the JSON), never dropped silently.
- Greedy, batch 1, both sides stop at EOS. One process runs the specjax AR baseline
  (``Generator``, the engine's K = 0 step) and each drafter in ``--drafters`` (``SpecGenerator``
  under ``--policy``: SmartSpec when a performance model exists, else fixed K =
  ``--num_spec_tokens``; an integer forces that K). For each prompt the AR baseline runs first, then each drafter in
  order (interleaving per prompt keeps slow machine drift out of the ratios).
- Warm-up before any timing: every prefill/decode/spec-step variant the selected prompts need is
  compiled ahead of time (shape-exact, from the same bucket rules the generators use), then
  each method generates the first prompt once untimed (Spec-Bench warms up on its first
  question too). **Compilation is excluded from every timing.** The script counts JAX
  trace/compile events during the timed runs and reports the number (expected 0).
- Wall time per prompt is measured around the whole ``generate`` call, **prefill included**
  (as Spec-Bench does).
- Losslessness check: every drafter's output token ids must equal the AR baseline's; each
  mismatch is printed as ``MISMATCH ...`` when it happens, counted per category and listed in
  the JSON (``--fail_on_mismatch`` makes the exit status 1).

Metrics per category and overall:

- speedup = (total AR wall time) / (total drafter wall time) over the category's prompts
  (Spec-Bench instead averages per-prompt tok/s and takes the ratio of the means; with
  identical outputs the two differ only in how prompts are weighted);
- mean accepted tokens per step = tokens committed per verify step, bonus included
  (Spec-Bench's "#Mean accepted tokens"; 1.0 = no gain possible);
- tok/s = total new tokens / total wall time.

Peer column (``--hf_python``): before the specjax runs (never concurrently) a subprocess runs
``benchmarks/hf_pld.py`` in that Python (torch CPU + transformers; specjax never imports torch)
on the same chat-template token ids (passed in a temp JSON), doing HF greedy and HF prompt
lookup (``prompt_lookup_num_tokens`` = ``--hf_prompt_lookup_num_tokens``) with
``--hf_threads`` torch threads; the table adds HF greedy tok/s, HF PLD speedup vs HF greedy
(ratio of total wall times) and how many HF PLD outputs differ from HF greedy.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

from specjax import cli, registry, specbench  # noqa: E402

FLAGS = flags.FLAGS
DEFAULT_QUESTIONS = os.path.join("..", "shared", "data", "spec_bench", "question.jsonl")
flags.DEFINE_string("model", "smollm2-135m", "Target model: name (see configs/), .gguf file or HF safetensors dir.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter/activation dtype.")
flags.DEFINE_string("question_file", DEFAULT_QUESTIONS,
                    "Spec-Bench question.jsonl (a relative path is resolved against the repo root).")
flags.DEFINE_list("categories", None, "Only these categories (comma list); default all.")
flags.DEFINE_integer("per_category", 0, "Keep the first N questions of each category; 0 = all.")
flags.DEFINE_integer("max_new_tokens", 256, "New tokens per prompt (Spec-Bench uses 1024).")
flags.DEFINE_list("drafters", ["prompt_lookup", "layer_skip"],
                  f"Drafters to compare with the AR baseline, from {', '.join(registry.SPEC_DRAFTERS)}.")
flags.DEFINE_bool("chat", True, "Wrap questions in the model's chat template (--nochat: raw text).")
flags.DEFINE_string("system", None, "System message for the chat template.")
flags.DEFINE_integer("max_prompt_tokens", 2048, "Skip (and count) prompts longer than this many tokens.")
flags.DEFINE_string("json_out", None, "Write all results (config, per-prompt rows, table) as JSON here.")
flags.DEFINE_string("markdown_out", None, "Write the markdown table here.")
flags.DEFINE_string("benchmarks_md", None, "Also put the run (command, table, notes) into this BENCHMARKS.md, "
                    "replacing the section between the --benchmarks_md_section markers (appended if absent).")
flags.DEFINE_string("benchmarks_md_section", "spec-bench", "Marker name of the BENCHMARKS.md section to replace.")
flags.DEFINE_bool("fail_on_mismatch", False, "Exit with status 1 if any drafter output differs from AR.")
flags.DEFINE_string("hf_python", None, "Python of a venv with torch CPU + transformers + gguf: adds the HF "
                    "greedy vs HF prompt-lookup peer column (GGUF models only).")
flags.DEFINE_integer("hf_prompt_lookup_num_tokens", 10, "HF prompt_lookup_num_tokens.")
flags.DEFINE_integer("hf_max_matching_ngram_size", 0, "HF max_matching_ngram_size; 0 = HF's default (2).")
flags.DEFINE_integer("hf_threads", 2, "torch threads for the HF peer.")
cli.define_spec_flags()
cli.define_forward_flags()
cli.define_policy_flags()


# ---------------------------------------------------------------- inputs


def resolve_question_file(path: str) -> str:
    from specjax.errors import SpecjaxError

    p = path if os.path.isabs(path) else os.path.join(ROOT, path)
    p = os.path.normpath(p)
    if not os.path.isfile(p):
        raise SpecjaxError(f"question file not found: {p} (Spec-Bench's question.jsonl; pass --question_file)")
    return p


# ---------------------------------------------------------------- runs


def command_line() -> str:
    args = [a for a in sys.argv[1:]]
    return "python launch/bench.py " + " ".join(args)


def run_hf(prompts, eos_ids, gguf: str) -> dict:
    from specjax.errors import SpecjaxError

    script = os.path.join(ROOT, "benchmarks", "hf_pld.py")
    with tempfile.TemporaryDirectory(prefix="specjax_bench_") as d:
        inp, out = os.path.join(d, "prompts.json"), os.path.join(d, "hf.json")
        job = {"gguf": gguf, "max_new_tokens": FLAGS.max_new_tokens, "eos_ids": list(eos_ids),
               "threads": FLAGS.hf_threads, "prompt_lookup_num_tokens": FLAGS.hf_prompt_lookup_num_tokens,
               "max_matching_ngram_size": FLAGS.hf_max_matching_ngram_size or None,
               "prompts": [{"key": p["key"], "category": p["category"], "input_ids": p["ids"]} for p in prompts]}
        with open(inp, "w") as f:
            json.dump(job, f)
        print(f"[HF peer: {FLAGS.hf_python} {os.path.relpath(script, ROOT)} on {len(prompts)} prompts "
              f"({FLAGS.hf_threads} torch threads)]", file=sys.stderr)
        t0 = time.perf_counter()
        r = subprocess.run([FLAGS.hf_python, script, "--input", inp, "--output", out], stdout=sys.stderr,
                           stderr=sys.stderr)
        if r.returncode != 0 or not os.path.isfile(out):
            raise SpecjaxError(f"HF peer (benchmarks/hf_pld.py under {FLAGS.hf_python}) failed with exit status "
                               f"{r.returncode}; see its output above")
        with open(out) as f:
            res = json.load(f)
        res["env"]["subprocess_s"] = time.perf_counter() - t0
        return res


def _first_diff(a, b) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def validate_flags():
    from specjax.errors import SpecjaxError

    if FLAGS.max_new_tokens < 1:
        raise SpecjaxError(f"--max_new_tokens must be >= 1, got {FLAGS.max_new_tokens}")
    if FLAGS.per_category < 0:
        raise SpecjaxError(f"--per_category must be >= 0 (0 = all), got {FLAGS.per_category}")
    if FLAGS.max_prompt_tokens < 1:
        raise SpecjaxError(f"--max_prompt_tokens must be >= 1, got {FLAGS.max_prompt_tokens}")
    drafters = [d.strip() for d in FLAGS.drafters if d.strip()]
    if not drafters:
        raise SpecjaxError("--drafters is empty; give at least one of " + ", ".join(registry.SPEC_DRAFTERS))
    if len(set(drafters)) != len(drafters):
        raise SpecjaxError(f"--drafters lists a drafter twice: {drafters}")
    if "none" in drafters:
        raise SpecjaxError("--drafters: 'none' is the AR baseline every run already has; list speculative drafters")
    k_buckets = cli.validate_spec_flags(drafters)
    for d in drafters:
        registry.check_policy(FLAGS.policy, k_buckets, d, FLAGS.num_spec_tokens)
    if FLAGS.hf_python:
        if not (os.path.isfile(FLAGS.hf_python) and os.access(FLAGS.hf_python, os.X_OK)):
            raise SpecjaxError(f"--hf_python {FLAGS.hf_python} is not an executable file")
        if FLAGS.hf_prompt_lookup_num_tokens < 1:
            raise SpecjaxError("--hf_prompt_lookup_num_tokens must be >= 1")
        if FLAGS.hf_threads < 1:
            raise SpecjaxError("--hf_threads must be >= 1")
    return drafters, k_buckets


def bench() -> int:
    import jax
    from tqdm import tqdm

    from specjax.errors import SpecjaxError
    from specjax.generate import Generator
    from specjax.models.loader import load_model
    from specjax.spec_generate import SpecStats

    drafters, k_buckets = validate_flags()
    K = FLAGS.num_spec_tokens
    qfile = resolve_question_file(FLAGS.question_file)
    questions, cat_order = specbench.load_questions(qfile, FLAGS.categories, FLAGS.per_category)
    gguf = specbench.hf_gguf_path(FLAGS.model) if FLAGS.hf_python else None

    model = load_model(FLAGS.model, FLAGS.dtype)
    cfg, tok = model.cfg, model.tokenizer
    print(f"[loaded {cfg.name} ({cfg.num_params() / 1e6:.0f}M params, {FLAGS.dtype}) in {model.load_seconds:.1f} s]",
          file=sys.stderr)
    if FLAGS.chat and not tok.chat_template:
        raise SpecjaxError(f"model {cfg.name} has no chat template; pass --nochat to feed the raw question text")
    draft = load_model(FLAGS.draft_model, FLAGS.dtype) if "draft_model" in drafters else None

    # Tokenize and apply the guards (skipped prompts are counted, never silently dropped).
    kmax = max(k_buckets)
    prompts, skipped = [], []
    for q in questions:
        ids = tok.encode_chat(q["text"], FLAGS.system) if FLAGS.chat else tok.encode(q["text"])
        key = f"{q['category']}/{q['question_id']}"
        why = None
        if not ids:
            why = "empty prompt"
        elif len(ids) > FLAGS.max_prompt_tokens:
            why = f"{len(ids)} prompt tokens > --max_prompt_tokens {FLAGS.max_prompt_tokens}"
        elif len(ids) + FLAGS.max_new_tokens + kmax + 1 > cfg.max_position:
            why = (f"{len(ids)} prompt tokens + {FLAGS.max_new_tokens} new + {kmax + 1} spec headroom exceed the "
                   f"{cfg.max_position}-token context")
        if why:
            skipped.append({"key": key, "question_id": q["question_id"], "category": q["category"],
                            "prompt_tokens": len(ids), "reason": why})
        else:
            prompts.append({"key": key, "question_id": q["question_id"], "category": q["category"], "ids": ids})
    for s in skipped:
        print(f"SKIPPED {s['key']}: {s['reason']}", file=sys.stderr)
    if skipped:
        print(f"[{len(skipped)} prompt(s) skipped; counted in the table's 'skipped' column]", file=sys.stderr)
    if not prompts:
        raise SpecjaxError("no prompts left to benchmark (all skipped; see SKIPPED lines)")

    # HF peer first, in its own process, before any specjax work (never concurrently).
    hf = run_hf(prompts, tok.eos_ids, gguf) if FLAGS.hf_python else None

    # Generators and shape-exact warm-up (compilation excluded from every timing).
    fwd = cli.forward_options_from_flags()
    ar = Generator(cfg, model.params, eos_ids=tok.eos_ids, fwd=fwd)
    specs = {d: registry.build_spec_generator(model, d, k=K, k_buckets=k_buckets, fwd=fwd,
                                              **cli.drafter_kwargs(model, d, K, draft=draft))
             for d in drafters}
    # One policy per drafter, kept across prompts (SmartSpec learns acceptance online).
    policies = {d: cli.policy_from_flags(model, d) for d in drafters}
    counter = specbench.CompileCounter()
    mnt = FLAGS.max_new_tokens
    # The AR baseline is the engine's K = 0 step (Generator is a SpecGenerator with no drafter).
    warm = {"ar_compile_s": registry.warm_spec(ar, {registry.spec_shapes(ar, len(p["ids"]), mnt) for p in prompts}, 0)}
    for d, g in specs.items():
        print(f"[compiling {d} variants]", file=sys.stderr)
        k_warm = getattr(policies[d][0], "k", max(k_buckets))  # a fixed K runs buckets <= K; SmartSpec any
        warm[f"{d}_compile_s"] = registry.warm_spec(g, {registry.spec_shapes(g, len(p["ids"]), mnt) for p in prompts},
                                                    k_warm)
    t0 = time.perf_counter()
    first = prompts[0]["ids"]
    ar.generate([first], max_new_tokens=mnt)
    for d, g in specs.items():
        g.generate([first], max_new_tokens=mnt, num_spec_tokens=K, stats=SpecStats(), policy=policies[d][0])
    warm["untimed_first_prompt_s"] = time.perf_counter() - t0
    for g in specs.values():  # the warm-up output must not sit in a suffix cache when prompt 1 is timed
        for dr in (g.drafter, getattr(g.drafter, "suffix", None)):
            if hasattr(dr, "clear_cache"):
                dr.clear_cache()
    print("[warm-up: " + ", ".join(f"{k} {v:.1f} s" for k, v in warm.items()) + "; timing starts now]",
          file=sys.stderr)

    rows, mismatches = [], []
    methods = ["ar"] + drafters
    bar = tqdm(total=len(prompts) * len(methods), unit="run", desc="specjax", disable=None, file=sys.stderr)
    counter.active = True
    try:
        for p in prompts:
            row = {"key": p["key"], "question_id": p["question_id"], "category": p["category"],
                   "prompt_tokens": len(p["ids"])}
            t = time.perf_counter()
            r = ar.generate([p["ids"]], max_new_tokens=mnt)[0]
            wall = time.perf_counter() - t
            row["ar"] = {"wall_s": wall, "new_tokens": len(r.tokens), "prefill_s": r.prefill_s,
                         "decode_s": r.decode_s, "finish_reason": r.finish_reason, "output_ids": r.tokens}
            bar.update(1)
            for d in drafters:
                st = SpecStats()
                t = time.perf_counter()
                s = specs[d].generate([p["ids"]], max_new_tokens=mnt, num_spec_tokens=K, stats=st,
                                      policy=policies[d][0])[0]
                wall = time.perf_counter() - t
                eq = s.tokens == r.tokens
                row[d] = {"wall_s": wall, "new_tokens": len(s.tokens), "prefill_s": s.prefill_s,
                          "decode_s": s.decode_s, "finish_reason": s.finish_reason, "equal_to_ar": eq,
                          "_stats": st, **st.summary()}
                if not eq:
                    i = _first_diff(s.tokens, r.tokens)
                    msg = (f"MISMATCH {d} {p['key']}: output differs from the AR baseline at token {i} "
                           f"(AR {len(r.tokens)} tokens, {d} {len(s.tokens)} tokens)")
                    tqdm.write(msg, file=sys.stderr)
                    mismatches.append({"drafter": d, "key": p["key"], "first_diff": i, "ar_tokens": len(r.tokens),
                                       "drafter_tokens": len(s.tokens), "drafter_output_ids": s.tokens})
                bar.update(1)
            rows.append(row)
    finally:
        counter.active = False
        bar.close()

    summary = specbench.summarize(rows, cat_order, drafters, skipped, hf["rows"] if hf else None)
    table = specbench.markdown_table(summary, drafters, hf is not None)
    over = summary[-1]
    pols = ", ".join(f"{d}: {lab}" for d, (_, lab) in policies.items())
    head = (f"specjax Spec-Bench-style run: {cfg.name} ({FLAGS.dtype}), greedy, batch 1, policy ({pols}), "
            f"max_new_tokens={mnt}, first turn, {'chat template' if FLAGS.chat else 'raw text'}, "
            f"{len(prompts)} prompts ({len(skipped)} skipped); jax {jax.__version__} on "
            f"{jax.devices()[0].platform}; wall time per prompt includes prefill; compilation excluded "
            f"(shape-exact warm-up + one untimed run; {counter.count} compile events during timing).")
    notes = ["Speedup = total specjax AR wall time / total drafter wall time per category; "
             "acc. tok/step = mean accepted tokens per verify step, bonus included."]
    for d in drafters:
        x = over["drafters"][d]
        pos = ", ".join(f"{v:.2f}" for v in x["per_position_acceptance"])
        notes.append(f"{d}: acceptance rate {x['acceptance_rate']:.3f}, per-position acceptance [{pos}]"
                     + (f" (draft_layers={FLAGS.draft_layers})" if d == "layer_skip" else "")
                     + (f" (draft_model={FLAGS.draft_model})" if d == "draft_model" else "")
                     + (f" (ngram {FLAGS.pld_min_ngram}..{FLAGS.pld_max_ngram})" if d == "prompt_lookup" else ""))
    notes.append(f"Outputs identical to the AR baseline: {'all' if not mismatches else 'NO'} "
                 f"({len(mismatches)} mismatches).")
    if hf:
        he = hf["env"]
        notes.append(f"HF peer: transformers {he['transformers']}, torch {he['torch']}, {he['threads']} threads, fp32, "
                     f"prompt_lookup_num_tokens={he['prompt_lookup_num_tokens']}; HF PLD speedup = HF greedy wall / "
                     f"HF PLD wall; HF greedy output equals specjax AR on "
                     f"{over['hf']['greedy_equals_specjax_ar']}/{over['hf']['prompts']} prompts (informational).")
    md = "\n".join([head, "", table, ""] + [f"- {n}" for n in notes]) + "\n"
    print(md)
    if mismatches:
        print(f"!!! {len(mismatches)} DRAFTER OUTPUT(S) DIFFER FROM THE AR BASELINE (greedy must be lossless): "
              + ", ".join(f"{m['drafter']}:{m['key']}" for m in mismatches), file=sys.stderr)
    if counter.count:
        print(f"warning: {counter.count} JAX compile events during timed runs: {counter.events[:5]}",
              file=sys.stderr)
    if FLAGS.markdown_out:
        with open(FLAGS.markdown_out, "w") as f:
            f.write(md)
    if FLAGS.benchmarks_md:
        specbench.update_benchmarks_md(FLAGS.benchmarks_md, f"Command:\n\n```bash\n{command_line()}\n```\n\n{md}",
                             FLAGS.benchmarks_md_section)
    if FLAGS.json_out:
        for r in rows:
            for d in drafters:
                r[d].pop("_stats", None)
        res = {"config": {"model": cfg.name, "dtype": FLAGS.dtype, "question_file": qfile,
                          "categories": cat_order, "per_category": FLAGS.per_category, "max_new_tokens": mnt,
                          "drafters": drafters, "num_spec_tokens": K, "k_buckets": list(k_buckets),
                         "policies": {d: lab for d, (_, lab) in policies.items()},
                          "draft_layers": FLAGS.draft_layers, "draft_model": FLAGS.draft_model,
                          "pld_min_ngram": FLAGS.pld_min_ngram, "pld_max_ngram": FLAGS.pld_max_ngram,
                          "chat": FLAGS.chat, "system": FLAGS.system, "max_prompt_tokens": FLAGS.max_prompt_tokens,
                          "greedy": True, "batch_size": 1},
               "env": {"jax": jax.__version__, "device": str(jax.devices()[0]), "python": platform.python_version(),
                       "machine": platform.machine(), "cpu_count": os.cpu_count(),
                       "date": datetime.datetime.now().isoformat(timespec="seconds")},
               "timing": {"wall_includes_prefill": True, "compilation_excluded": True, "warmup": warm,
                          "compile_events_during_timing": counter.count},
               "summary": summary, "num_mismatches": len(mismatches), "mismatches": mismatches,
               "num_skipped": len(skipped), "skipped": skipped, "prompts": rows,
               "hf": hf, "markdown": md}
        with open(FLAGS.json_out, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if (mismatches and FLAGS.fail_on_mismatch) else 0


def main(argv):
    cli.run_job(bench, argv)


if __name__ == "__main__":
    app.run(main)
