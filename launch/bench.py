"""Spec-Bench-style speed benchmark: specjax speculative drafters vs the specjax AR baseline.

  python launch/bench.py --per_category 10 --max_new_tokens 256 \
      --json_out bench.json --markdown_out bench.md [--hf_python /work/hf-venv/bin/python] \
      [--llamacpp_python /work/llamacpp-venv/bin/python --prefill_lens 128,512,1024,2048]

The protocol (questions, warm-up, interleaved timing, the losslessness check), the metrics and
the peers (transformers, llama.cpp: each in its own venv, benchmarks/requirements-*-peer.txt):
specjax/specbench.py's docstring.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

from specjax import cli, peers, registry, specbench  # noqa: E402
from specjax.engine.spec import POLICY_HELP, DrafterSpec, PolicySpec  # noqa: E402

FLAGS = flags.FLAGS
COMMAND = "python launch/bench.py " + " ".join(sys.argv[1:])
cli.define_model_flags()
cli.define_prompt_flags(chat=True)
cli.define_sampling_flags()
cli.define_question_flags(max_prompt_tokens=2048)
flags.DEFINE_list("categories", None, "Only these categories (comma list); default all.")
flags.DEFINE_integer("per_category", 0, "Keep the first N questions of each category; 0 = all.")
flags.DEFINE_integer("max_new_tokens", 256, "New tokens per prompt (Spec-Bench uses 1024).")
flags.DEFINE_string("json_out", None, "Write all results (config, per-prompt rows, table) as JSON here.")
flags.DEFINE_string("markdown_out", None, "Write the markdown table here.")
flags.DEFINE_string("benchmarks_md", None, "Also put the run (command, table, notes) into this BENCHMARKS.md, "
                    "replacing the section between the --benchmarks_md_section markers (appended if absent).")
flags.DEFINE_string("benchmarks_md_section", "spec-bench", "Marker name of the BENCHMARKS.md section to replace.")
flags.DEFINE_bool("fail_on_mismatch", False, "Exit with status 1 if any drafter output differs from AR.")
flags.DEFINE_string("hf_python", None, "Python of a venv with torch CPU + transformers + gguf "
                    "(benchmarks/requirements-hf-peer.txt): adds the transformers peer, its greedy (prefill and "
                    "decode timed apart) and its prompt lookup, and its prefill by length (GGUF models only).")
flags.DEFINE_integer("hf_prompt_lookup_num_tokens", 10, "HF prompt_lookup_num_tokens (and llama.cpp's "
                     "num_pred_tokens).")
flags.DEFINE_integer("hf_max_matching_ngram_size", 0, "HF max_matching_ngram_size (and llama.cpp's max_ngram_size); "
                     "0 = their default (2).")
flags.DEFINE_integer("hf_threads", 2, "torch threads for the transformers peer.")
flags.DEFINE_string("hf_omp_wait_policy", None, "OMP_WAIT_POLICY for the transformers peer (torch's OpenMP threads "
                    "spin at barriers too: PASSIVE on a shared machine, where it cost torch 5x here); default: the "
                    "environment's.")
flags.DEFINE_string("llamacpp_python", None, "Python of a venv with llama-cpp-python (benchmarks/requirements-llamacpp-peer.txt): adds "
                    "the llama.cpp greedy (prefill and decode timed apart) vs llama.cpp prompt-lookup peer column "
                    "(GGUF models only).")
flags.DEFINE_integer("llamacpp_threads", 2, "llama.cpp threads (n_threads and n_threads_batch).")
flags.DEFINE_string("llamacpp_omp_wait_policy", None, "OMP_WAIT_POLICY for the llama.cpp peer (PASSIVE on a "
                    "shared machine: its OpenMP threads otherwise spin at barriers); default: the environment's.")
flags.DEFINE_list("llamacpp_batch_sizes", [], "Also run the llama.cpp peer's batch mode (parallel sequences over "
                  "all prompts) at these batch sizes; reported in the notes and the JSON.")
flags.DEFINE_list("prefill_lens", [], "Also time specjax AR prefill (best of 3, after the timed runs) on "
                  "random-token prompts of these lengths, and each peer's on the same ids.")
cli.define_drafter_flags(several=["prompt_lookup", "layer_skip"])
cli.define_forward_flags()
cli.define_policy_flags()
cli.define_prefill_flags(prefix_cache_mb=0, why_off="0 by default here: the protocol times each prompt's own "
                         "prefill; given, a warm-store run (the warm-up's prompts stored, timed prompts reuse them)")
flags.DEFINE_string("distilled_draft", None, "Also run each device drafter of --drafters with the draft distilled "
                    "into this checkpoint directory (launch/distill.py, --online_distill) as method <drafter>-distilled, "
                    "next to the untrained one.")
flags.DEFINE_bool("also_chains", False, "With heads that draft trees (--eagle_tree_width, Medusa's default "
                  "tree): also run each as chains, as method <drafter>-chain, in the same run.")
flags.DEFINE_list("policies", None, "Several policies per drafter in one run (comma list of "
                  f"{POLICY_HELP}, e.g. auto,2,4,8); default: --policy alone.")


def validate_flags():
    from specjax.errors import SpecjaxError

    if FLAGS.max_new_tokens < 1:
        raise SpecjaxError(f"--max_new_tokens must be >= 1, got {FLAGS.max_new_tokens}")
    if FLAGS.per_category < 0:
        raise SpecjaxError(f"--per_category must be >= 0 (0 = all), got {FLAGS.per_category}")
    if FLAGS.max_prompt_tokens < 1:
        raise SpecjaxError(f"--max_prompt_tokens must be >= 1, got {FLAGS.max_prompt_tokens}")
    drafters = cli.drafters_from_flags(allow_none=False)
    if FLAGS.distilled_draft and not os.path.isfile(os.path.join(FLAGS.distilled_draft, "draft.json")):
        raise SpecjaxError(f"--distilled_draft {FLAGS.distilled_draft} holds no distilled draft (no draft.json)")
    if FLAGS.policies is not None and FLAGS["policy"].present:
        raise SpecjaxError("give --policy or --policies, not both")
    raw = FLAGS.policies if FLAGS.policies is not None else [FLAGS.policy]
    if not [p for p in raw if p.strip()]:
        raise SpecjaxError("--policies is empty; give e.g. auto,2,4,8")
    # one EngineSpec per (drafter, policy) pair, each validated
    # (keyed by the policy's resolved name, which a run's tables use: "0" is "none")
    built = [(d, cli.engine_spec_from_flags(drafter=d, policy=p)) for p in raw if p.strip() for d in drafters]
    specs = {(d, sp.policy.name): sp for d, sp in built}
    policies = list(dict.fromkeys(s.policy.name for s in specs.values()))
    if len(policies) != len([p for p in raw if p.strip()]):
        raise SpecjaxError(f"--policies lists a policy twice: {[p.strip().lower() for p in raw if p.strip()]}")
    for flag in ("hf_python", "llamacpp_python"):
        peers.check_python_flag(flag, FLAGS[flag].value)
    if FLAGS.hf_python or FLAGS.llamacpp_python:
        if FLAGS.hf_prompt_lookup_num_tokens < 1:
            raise SpecjaxError("--hf_prompt_lookup_num_tokens must be >= 1")
        if min(FLAGS.hf_threads, FLAGS.llamacpp_threads) < 1:
            raise SpecjaxError("--hf_threads and --llamacpp_threads must be >= 1")
    if FLAGS.llamacpp_batch_sizes and not FLAGS.llamacpp_python:
        raise SpecjaxError("--llamacpp_batch_sizes needs --llamacpp_python")
    for flag in ("llamacpp_batch_sizes", "prefill_lens"):
        if not all(v.isdigit() and int(v) >= 1 for v in FLAGS[flag].value):
            raise SpecjaxError(f"--{flag} must list positive integers, got {','.join(FLAGS[flag].value)}")
    if FLAGS.also_chains and not any(registry.chain_of(sp.drafter) for sp in specs.values()):
        raise SpecjaxError("--also_chains needs a head drafting trees (--drafters eagle with --eagle_tree_width, "
                           "or medusa)")
    samp = cli.sampling_from_flags()
    if not samp.greedy and (FLAGS.hf_python or FLAGS.llamacpp_python):
        raise SpecjaxError("the peers run greedy only; drop --hf_python / --llamacpp_python with --temperature > 0")
    return drafters, specs, samp


def bench() -> int:
    import copy

    import jax
    from tqdm import tqdm

    from specjax.errors import SpecjaxError
    from specjax.goodput import GoodputPolicy
    from specjax.models.loader import load_model
    from specjax.simulate.backend import tree_paths_of
    from specjax.spec_generate import SpecStats

    drafters, specs, samp = validate_flags()
    greedy = samp.greedy
    policy_names = list(dict.fromkeys(s.policy.name for s in specs.values()))
    k_buckets = next(iter(specs.values())).k_buckets
    K = FLAGS.num_spec_tokens
    qfile = specbench.resolve_question_file(FLAGS.question_file, ROOT)
    questions, cat_order = specbench.load_questions(qfile, FLAGS.categories, FLAGS.per_category)
    gguf = specbench.hf_gguf_path(FLAGS.model) if FLAGS.hf_python or FLAGS.llamacpp_python else None

    model, _ = cli.load_target(next(iter(specs.values())))
    specs = {pair: sp.resolved(model) for pair, sp in specs.items()}
    fwd = next(iter(specs.values())).fwd  # (rows_kernel 0: XLA's dot on float32 weights)
    cfg, tok = model.cfg, model.tokenizer
    if FLAGS.chat and not tok.chat_template:
        raise SpecjaxError(f"model {cfg.name} has no chat template; pass --nochat to feed the raw question text")
    draft = load_model(FLAGS.draft_model, FLAGS.dtype) if FLAGS.draft_model else None  # (shared by its pairs)

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

    import numpy as np

    # random-token prompts for prefill by length (ids 100..vocab-1, as benchmarks/prefill_speed.py)
    rng = np.random.default_rng(0)
    prefill_prompts = [[int(x) for x in rng.integers(100, cfg.vocab_size, int(n))] for n in FLAGS.prefill_lens]
    # Peers first, each in its own process, before any specjax work (never concurrently).
    ngram = FLAGS.hf_max_matching_ngram_size or None
    peer_res = peers.run_requested(
        prompts, tok.eos_ids, gguf, prefill_prompts, FLAGS.max_new_tokens,
        hf=FLAGS.hf_python and dict(python=FLAGS.hf_python, threads=FLAGS.hf_threads, max_matching_ngram_size=ngram,
                                    prompt_lookup_num_tokens=FLAGS.hf_prompt_lookup_num_tokens,
                                    omp_wait_policy=FLAGS.hf_omp_wait_policy),
        llamacpp=FLAGS.llamacpp_python and dict(
            python=FLAGS.llamacpp_python, threads=FLAGS.llamacpp_threads, pld_max_ngram_size=ngram or 2,
            pld_num_pred_tokens=FLAGS.hf_prompt_lookup_num_tokens, omp_wait_policy=FLAGS.llamacpp_omp_wait_policy,
            batch_sizes=[int(b) for b in FLAGS.llamacpp_batch_sizes])) if gguf else {}
    hf = peer_res.get("hf")

    # One generator and one policy object per (drafter, policy) pair; generators whose steps
    # compile to the same code (same device draft or none) share their executables.
    ar = registry.build_generator(dataclasses.replace(next(iter(specs.values())), drafter=DrafterSpec(),
                                                      policy=PolicySpec("none")), model)
    several = len(policy_names) > 1
    methods, gens, pols = [], {}, {}
    compiled_by = {"host": ar}  # the AR baseline is the host drafters' K = 0 step
    # (drafter, method-name suffix, what the variant changes in its DrafterSpec)
    variants = ([(d, "", {}) for d in drafters]
                + [(d, "-distilled", {"draft_checkpoint": FLAGS.distilled_draft}) for d in drafters
                   if FLAGS.distilled_draft and registry.DRAFTERS[d].device]
                + [(d, "-chain", dict(registry.entry(d).chain)) for d in drafters
                   if FLAGS.also_chains and registry.chain_of(specs[(d, policy_names[0])].drafter)])
    for d, suffix, change in variants:
        for pn in policy_names:
            name = specbench.method_name(d, pn, several) + suffix
            spec = specs[(d, pn)]
            spec = dataclasses.replace(spec, drafter=dataclasses.replace(spec.drafter, **change))
            distilled = change.get("draft_checkpoint")
            pol, label = cli.policy_from_spec(spec, model)
            goodput = isinstance(pol, GoodputPolicy)
            g = registry.build_generator(spec, model, draft=draft)
            group = (d + suffix) if spec.device_draft else "host"  # (compile keys tell packed etc. apart)
            if group in compiled_by:
                g.share_compiled(compiled_by[group])
            else:
                compiled_by[group] = g
            methods.append({"name": name, "drafter": d, "policy": pn, "label": label, "goodput": goodput,
                            "distilled": distilled, "chain": suffix == "-chain",
                            "k": None if goodput else getattr(pol, "k", None)})
            gens[name], pols[name] = g, pol
    names = [m["name"] for m in methods]
    counter = specbench.CompileCounter()
    mnt = FLAGS.max_new_tokens
    # The AR baseline is the engine's K = 0 step (Generator is a SpecGenerator with no drafter).
    # (prefill by length: its prompts' shapes too, one new token each)
    warm = {"ar_compile_s": registry.warm_spec(ar, {registry.spec_shapes(ar, len(p["ids"]), mnt) for p in prompts}
                                                | {registry.spec_shapes(ar, len(ids), 1) for ids in prefill_prompts}, 0,
                                                greedy=greedy, execute=True)}
    for m in methods:
        g = gens[m["name"]]
        print(f"[compiling {m['name']} variants]", file=sys.stderr)
        k_warm = max(k_buckets) if m["k"] is None else m["k"]  # a goodput policy may choose any compiled K
        warm[f"{m['name']}_compile_s"] = registry.warm_spec(
            g, {registry.spec_shapes(g, len(p["ids"]), mnt) for p in prompts}, k_warm, greedy=greedy, execute=True)
    t0 = time.perf_counter()
    first = prompts[0]["ids"]
    ar.generate([first], sampling=samp, max_new_tokens=mnt)
    for m in methods:  # a copy of the policy: the timed one starts from its prior
        gens[m["name"]].generate([first], sampling=samp, max_new_tokens=mnt, num_spec_tokens=K, stats=SpecStats(),
                                 policy=copy.deepcopy(pols[m["name"]]))
    warm["untimed_first_prompt_s"] = time.perf_counter() - t0
    for g in gens.values():  # the warm-up output must not sit in a suffix cache when prompt 1 is timed
        g.drafter.forget_outputs()
    print("[warm-up: " + ", ".join(f"{k} {v:.1f} s" for k, v in warm.items()) + "; timing starts now]",
          file=sys.stderr)

    rows, mismatches = [], []
    bar = tqdm(total=len(prompts) * (1 + len(methods)), unit="run", desc="specjax", disable=None, file=sys.stderr)
    counter.active = True
    try:
        for i, p in enumerate(prompts):
            order = specbench.rotated(methods, i)
            row = {"key": p["key"], "question_id": p["question_id"], "category": p["category"],
                   "prompt_tokens": len(p["ids"]), "order": ["ar"] + [m["name"] for m in order]}
            t = time.perf_counter()
            r = ar.generate([p["ids"]], sampling=samp, max_new_tokens=mnt)[0]
            wall = time.perf_counter() - t
            row["ar"] = {"wall_s": wall, "new_tokens": len(r.tokens), "prefill_s": r.prefill_s,
                         "decode_s": r.decode_s, "finish_reason": r.finish_reason, "output_ids": r.tokens,
                         "step_records": specbench.step_records(ar.last_engine)}
            bar.update(1)
            for m in order:
                name, g = m["name"], gens[m["name"]]
                st = SpecStats()
                t = time.perf_counter()
                s = g.generate([p["ids"]], sampling=samp, max_new_tokens=mnt, num_spec_tokens=K, stats=st,
                               policy=pols[name])[0]
                wall = time.perf_counter() - t
                eq = s.tokens == r.tokens if greedy else None  # (sampled: two draws, not compared)
                row[name] = {"wall_s": wall, "new_tokens": len(s.tokens), "prefill_s": s.prefill_s,
                             "decode_s": s.decode_s, "finish_reason": s.finish_reason, "equal_to_ar": eq,
                             "draft_prefill": g.last_draft_prefill, "step_records": specbench.step_records(g.last_engine),
                             "_stats": st, **st.summary()}
                if eq is False:
                    j = specbench.first_diff(s.tokens, r.tokens)
                    msg = (f"MISMATCH {name} {p['key']}: output differs from the AR baseline at token {j} "
                           f"(AR {len(r.tokens)} tokens, {name} {len(s.tokens)} tokens)")
                    tqdm.write(msg, file=sys.stderr)
                    mismatches.append({"drafter": m["drafter"], "policy": m["policy"], "method": name, "key": p["key"],
                                       "first_diff": j, "ar_tokens": len(r.tokens), "drafter_tokens": len(s.tokens),
                                       "drafter_output_ids": s.tokens})
                bar.update(1)
            rows.append(row)
    finally:
        counter.active = False
        bar.close()

    # prefill by length, after the timed runs (compiled and run once by the warm-up; best of 3)
    prefill_s = {len(ids): min(ar.generate([ids], sampling=samp, max_new_tokens=1)[0].prefill_s for _ in range(3))
                 for ids in prefill_prompts}

    summary = specbench.summarize(rows, cat_order, names, skipped, {k: v["rows"] for k, v in peer_res.items()})
    table = specbench.markdown_table(summary, names)
    over = summary[-1]
    checks = specbench.goodput_checks(summary, methods)
    pols_txt = ", ".join(f"{m['name']}: {m['label']}" for m in methods) if not several else (
        f"policies {','.join(policy_names)} per drafter")
    how = "greedy" if greedy else (f"sampled (temperature {samp.temperature:g}, top_k {samp.top_k}, top_p {samp.top_p:g}, "
                                            f"seed {samp.seed})")
    head = (f"specjax Spec-Bench-style run: {cfg.name} ({FLAGS.dtype}), {how}, batch 1, policy ({pols_txt}), "
            f"max_new_tokens={mnt}, first turn, {'chat template' if FLAGS.chat else 'raw text'}, "
            f"{len(prompts)} prompts ({len(skipped)} skipped); jax {jax.__version__} on "
            f"{jax.devices()[0].platform}; wall time per prompt includes prefill; compilation excluded "
            f"(shape-exact warm-up + one untimed run; {counter.count} compile events during timing).")
    notes = ["Speedup = drafter tok/s / specjax AR tok/s per category (with identical outputs: total AR wall time / "
             "total drafter wall time); "
             "acc. tok/step = mean accepted tokens per verify step, bonus included."]
    for m in methods:
        x, d = over["drafters"][m["name"]], m["drafter"]
        pos = ", ".join(f"{v:.2f}" for v in x["per_position_acceptance"])
        spec_steps = sum(n for k, n in x["k_step_counts"].items() if k != "0")
        notes.append(f"{m['name']} ({m['label']}): acceptance rate {x['acceptance_rate']:.3f}, per-position "
                     f"acceptance [{pos}], {spec_steps}/{sum(x['k_step_counts'].values())} steps verified drafts"
                     + (f", draft prefill on {x['draft_prefills']}/{over['prompts']} prompts"
                        if registry.DRAFTERS[d].device else "")
                     + (f" (distilled draft from {m['distilled']})" if m["distilled"] else "")
                     + (" (as chains)" if m["chain"] else "")
                     + " (" + ", ".join(f"{f}={FLAGS[f].value}" for f in sorted(registry.DRAFTERS[d].reads)
                                        if f != "draft_checkpoint") + ")")
    notes.append(f"Outputs identical to the AR baseline: {'all' if not mismatches else 'NO'} "
                 f"({len(mismatches)} mismatches)." if greedy else
                 "Sampled: every side draws its own tokens (not compared token by token); speedup = tok/s over "
                 "AR's, acc. tok/step the drafts' own.")
    if ar.prefix_stats is not None:
        notes.append(f"Prefix cache on (--prefix_cache_mb {FLAGS.prefix_cache_mb:g}: a warm store, the warm-up's "
                     "prompts stored), all runs: " + "; ".join(
                         f"{n}: {g.prefix_stats.line().removeprefix('prefix cache: ')}" for n, g in [("ar", ar), *gens.items()]))
    notes += specbench.peer_notes(peer_res, over)
    notes += specbench.check_lines(checks, drafters)
    parts = [head, "", table, ""]
    if peer_res:
        dec, e2e = specbench.peer_tables(summary, names, list(peer_res))
        parts += [specbench.peers_headline(fwd, {k: v["env"] for k, v in peer_res.items()}), "",
                  "Decode against the peers (tok/s from each side's own decode steps: (new tokens - 1) / decode "
                  "seconds; agreement = prompts whose greedy output equals specjax AR's, and the share of AR's tokens "
                  "the peer reproduced before its first divergence):", "", dec, "",
                  "End to end against the peers' prompt lookup (tok/s = new tokens / wall seconds, prefill "
                  "included; the best specjax method is chosen once, by its overall tok/s):", "", e2e, ""]
    if prefill_s:
        pre = {specbench.PEER_LABELS[k]: {p["tokens"]: p["seconds"] for p in v.get("prefill", [])}
               for k, v in peer_res.items() if v.get("prefill")}
        parts += ["Prefill by length (random-token prompts, the same ids for every side, batch 1, best of 3, "
                  "logits of the last position only; specjax: Generator prefill to the first token; llama.cpp: "
                  "eval + first sample; transformers: base model + lm_head on the last position + argmax):", "",
                  specbench.prefill_table(prefill_s, pre), ""]
    if several:
        parts += ["Speedup over AR per category, every (drafter, policy) pair:", "",
                  specbench.ratio_table(summary, methods), ""]
    md = "\n".join(parts + [f"- {n}" for n in notes]) + "\n"
    print(md)
    if mismatches:
        print(f"!!! {len(mismatches)} DRAFTER OUTPUT(S) DIFFER FROM THE AR BASELINE (greedy must be lossless): "
              + ", ".join(f"{m['method']}:{m['key']}" for m in mismatches), file=sys.stderr)
    if counter.count:
        print(f"warning: {counter.count} JAX compile events during timed runs: {counter.events[:5]}",
              file=sys.stderr)
    if FLAGS.markdown_out:
        with open(FLAGS.markdown_out, "w") as f:
            f.write(md)
    if FLAGS.benchmarks_md:
        specbench.update_benchmarks_md(FLAGS.benchmarks_md, f"Command:\n\n```bash\n{COMMAND}\n```\n\n{md}",
                                       FLAGS.benchmarks_md_section)
    if FLAGS.json_out:
        for r in rows:
            for n in names:
                r[n].pop("_stats", None)
        res = {"config": {"model": cfg.name, "dtype": FLAGS.dtype, "question_file": qfile,
                          "categories": cat_order, "per_category": FLAGS.per_category, "max_new_tokens": mnt,
                          "drafters": drafters, "num_spec_tokens": K, "k_buckets": list(k_buckets),
                          "policies": policy_names, "methods": methods,
                          **{f: FLAGS[f].value for f in sorted(set().union(*(registry.DRAFTERS[d].reads
                                                                              for d in drafters)))},
                          "chat": FLAGS.chat, "system": FLAGS.system, "max_prompt_tokens": FLAGS.max_prompt_tokens,
                          "greedy": greedy, "sampling": dataclasses.asdict(samp), "batch_size": 1, "command": COMMAND},
               "env": {"jax": jax.__version__, "device": str(jax.devices()[0]), "python": platform.python_version(),
                       "machine": platform.machine(), "cpu_count": os.cpu_count(), "cpu": specbench.cpu_description(),
                       "rows_kernel": fwd.rows_kernel, "rows_activations": fwd.rows_activations, "peer_versions": specbench.peer_versions(peer_res),
                       "date": datetime.datetime.now().isoformat(timespec="seconds")},
               "timing": {"wall_includes_prefill": True, "compilation_excluded": True, "warmup": warm,
                          "compile_events_during_timing": counter.count},
               # device tree drafters' accepted paths (serve_sim --sim_tree_paths FILE:METHOD)
               "acceptance": {n: a for n in names if (a := tree_paths_of([gens[n].drafter]))},
               "summary": summary, "goodput_checks": checks, "num_mismatches": len(mismatches),
               "mismatches": mismatches, "num_skipped": len(skipped), "skipped": skipped, "prompts": rows,
               "hf": hf, "llamacpp": peer_res.get("llamacpp"), "prefill_s": prefill_s, "markdown": md,
               # the prefix store's hits and prompt tokens reused, per method (None: the store off)
               "prefix_cache": {n: (None if g.prefix_stats is None else g.prefix_stats.as_dict())
                                for n, g in [("ar", ar), *gens.items()]}}
        with open(FLAGS.json_out, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if (mismatches and FLAGS.fail_on_mismatch) else 0


def main(argv):
    cli.run_job(bench, argv)


if __name__ == "__main__":
    app.run(main)
