"""Spec-Bench-style benchmarking: the question file, per-category summaries and their markdown
tables, the goodput policy's pass/fail checks against AR and the best fixed K, the BENCHMARKS.md
section writer, and the guard that no compilation happens while timing. ``launch/bench.py`` is
the command-line leaf over this module, and runs this protocol:

Protocol (Spec-Bench conventions where they apply; differences are stated):

- Questions: ``--question_file`` (default ``../shared/data/spec_bench/question.jsonl`` relative
  to the repo root), **first turn only**, wrapped in the model's chat template (``--nochat`` to
  feed raw text); ``--categories`` filters, ``--per_category N`` keeps the first N of each
  category (file order). Prompts longer than ``--max_prompt_tokens``, or that cannot fit
  prompt + ``--max_new_tokens`` + max(K bucket) + 1 in the context, are skipped and counted
  (per category in the table, listed in the JSON), never dropped silently.
- Greedy by default (``--temperature T`` > 0: every side samples, with ``--top_k``, ``--top_p``
  and ``--seed``; outputs are then samples of one distribution, not compared token by token:
  losslessness at T > 0 is the chi-square tests' to show), batch 1, both sides stop at EOS. One process runs the specjax AR baseline
  (``Generator``, the engine's K = 0 step) and every (drafter, policy) pair of ``--drafters`` x
  ``--policies`` (default: ``--policy`` alone). A policy is ``auto`` (SmartSpec's goodput
  choice when a performance model exists, else fixed K = ``--num_spec_tokens``), a named goodput
  policy (``smartspec``, ``smartspec-req``, ``smartspec-conf``: device drafters only), ``none``
  or an integer K; every goodput policy is checked against the best fixed K. For each prompt the AR baseline runs first, then every pair, in an
  order rotated by one pair per prompt (interleaving per prompt keeps slow machine drift out of
  the ratios; rotating keeps any pair from always running right after AR).
- Each pair has its own generator and drafter (a suffix tree learns only from the outputs of
  its own pair), whose proposals are capped at the largest K the policy may run (a fixed K,
  or the largest K bucket for a goodput policy), and ONE policy object for the whole timed run: SmartSpec learns acceptance
  across prompts, as a server would; with a device drafter its prefill gate persists too, so
  once drafts are learnt not to pay, later prompts skip the draft prefill. Generators that
  differ only in their host drafter share compiled executables (AR included).
- Warm-up before any timing: every prefill/decode/spec-step variant the selected prompts need is
  compiled ahead of time (shape-exact, from the same bucket rules the generators use; every K
  bucket for a goodput policy, K buckets <= K for a fixed K), then each method generates the
  first prompt once untimed (Spec-Bench warms up on its first question too), under a copy of
  its policy: the timed policies start from their prior. **Compilation is excluded from every
  timing.** The script counts JAX trace/compile events during the timed runs and reports the
  number (expected 0).
- Wall time per prompt is measured around the whole ``generate`` call, **prefill included**
  (as Spec-Bench does).
- Losslessness check: every drafter's output token ids must equal the AR baseline's; each
  mismatch is printed as ``MISMATCH ...`` when it happens, counted per category and listed in
  the JSON (``--fail_on_mismatch`` makes the exit status 1).

Metrics per category and overall:

- speedup = (drafter tok/s) / (AR tok/s) over the category's prompts, i.e. total AR wall time /
  total drafter wall time when the outputs are identical (greedy)
  (Spec-Bench instead averages per-prompt tok/s and takes the ratio of the means; with
  identical outputs the two differ only in how prompts are weighted);
- mean accepted tokens per step = tokens committed per verify step, bonus included
  (Spec-Bench's "#Mean accepted tokens"; 1.0 = no gain possible);
- tok/s = total new tokens / total wall time.

With a goodput (SmartSpec) policy and at least one fixed K per drafter (``--policies
auto,2,4,8``), the notes end with the issue's checks: PASS/FAIL per drafter for "no category
below 0.97x AR" and "overall speedup >= the best fixed K's (same run)", and a verdict over all
drafters; with several policies a compact table of every pair's speedup per category precedes
them. The JSON has every prompt's per-step records (K chosen, K run, milliseconds, drafts).

Peers (``--hf_python``, ``--llamacpp_python``): before the specjax runs, one after the other and
never concurrently, each peer (``specjax.peers``) runs in its own venv on the same GGUF and the
same chat-template token ids (never re-tokenized), batch 1, greedy, stopping at the same EOS ids:
transformers (``hf_pld``: benchmarks/hf_pld.py, the GGUF dequantized to float32, ``--hf_threads``)
and llama.cpp (``llamacpp``: benchmarks/llamacpp_peer.py, the GGUF's blocks, ``--llamacpp_threads``).
Each runs its greedy decoding (prefill with logits of the last position only, then decode
steps timed apart: decode tok/s = (new tokens - 1) / decode seconds, as the AR decode column) and
its own prompt-lookup decoding (``--hf_prompt_lookup_num_tokens``, timed whole, prefill
included). ``peer_tables`` gives two tables per category: decode against specjax AR (with how far
each peer's greedy output agrees with specjax AR's: identical prompts, and the share of AR's
tokens reproduced before the first divergence; informational, as different arithmetic may break
near-ties differently), and end to end (tok/s of specjax AR and every method, each peer's greedy
and prompt lookup, and specjax's best method, chosen once by overall tok/s, over each peer's
prompt lookup). ``peers_headline`` says what differs (bytes read per step, arithmetic, threads,
machine). ``--prefill_lens`` adds prefill by length for every side on the same random ids
(``prefill_table``).
"""

from __future__ import annotations

import json
import os

from specjax.spec_generate import SpecStats


def resolve_question_file(path: str, root: str) -> str:
    """The question file (a relative path: relative to ``root``); SpecjaxError if it is missing."""
    from specjax.errors import SpecjaxError

    p = os.path.normpath(path if os.path.isabs(path) else os.path.join(root, path))
    if not os.path.isfile(p):
        raise SpecjaxError(f"question file not found: {p} (Spec-Bench's question.jsonl; pass --question_file)")
    return p


def first_diff(a, b) -> int:
    """The first index where two token lists differ (the shorter length if one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def load_questions(path: str, categories, per_category: int) -> tuple[list[dict], list[str]]:
    """Questions (dicts with question_id, category, text = first turn) and the category order."""
    from specjax.errors import SpecjaxError

    qs, order = [], []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise SpecjaxError(f"{path} line {lineno}: malformed JSON ({e.msg})") from None
            turns = rec.get("turns") if isinstance(rec, dict) else None
            if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or "category" not in rec:
                raise SpecjaxError(f"{path} line {lineno}: expected an object with 'category' and a non-empty "
                                   "'turns' list of strings")
            cat = str(rec["category"])
            if cat not in order:
                order.append(cat)
            qs.append({"question_id": rec.get("question_id", lineno), "category": cat, "text": turns[0]})
    if not qs:
        raise SpecjaxError(f"{path} has no questions")
    if categories:
        unknown = [c for c in categories if c not in order]
        if unknown:
            raise SpecjaxError(f"unknown categories {unknown}; the file has: {', '.join(order)}")
        order = [c for c in order if c in categories]
    out = []
    for cat in order:
        sel = [q for q in qs if q["category"] == cat]
        out.extend(sel[:per_category] if per_category > 0 else sel)
    return out, order


def hf_gguf_path(model: str) -> str:
    from specjax.config import available_models, get_model_config
    from specjax.errors import SpecjaxError
    from specjax.models.loader import find_packaged_file

    if model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise SpecjaxError(f"GGUF file not found: {model}")
        return os.path.abspath(model)
    if model in available_models():
        w = get_model_config(model).weights
        if w.kind == "gguf_package":
            return find_packaged_file(w.package, w.file, w.install_hint)
    raise SpecjaxError(f"--hf_python needs a GGUF target (a .gguf file or a named model shipped as GGUF); "
                       f"{model!r} is not one")


class CompileCounter:
    """Counts JAX trace/lower/compile events while ``active`` (expected 0 during timing)."""

    def __init__(self):
        import jax

        self.active = False
        self.count = 0
        self.events: list[str] = []

        def listener(event, duration, **kw):
            if self.active and event.startswith("/jax/core/compile/"):
                self.count += 1
                self.events.append(f"{event} {kw.get('fun_name', '')}".strip())

        jax.monitoring.register_event_duration_secs_listener(listener)


def _ratio(a, b):
    return a / b if b else float("nan")


MIN_CATEGORY_RATIO = 0.97  # the goodput policy's floor per category, as a fraction of AR speed


def method_name(drafter: str, policy: str, several_policies: bool) -> str:
    """A (drafter, policy) pair's key in rows, summaries and table headers: the drafter alone
    when the run has one policy (the key earlier runs used), else ``drafter@policy``."""
    return f"{drafter}@{policy}" if several_policies else drafter


def rotated(items: list, i: int) -> list:
    """``items`` started at position ``i`` (mod its length): prompt i runs the pairs in this order,
    so no pair always runs right after AR (or after a particular other pair)."""
    if not items:
        return []
    j = i % len(items)
    return items[j:] + items[:j]


def step_records(engine) -> dict:
    """An engine run's steps as columns (k chosen, k_step run, backend and loop milliseconds,
    drafts and acceptances): what it takes to see where a policy spends its time."""
    st = engine.steps
    return {"k": [s.k for s in st], "k_step": [s.k_step for s in st],
            "elapsed_ms": [round(s.elapsed * 1e3, 3) for s in st], "wall_ms": [round(s.wall * 1e3, 3) for s in st],
            "drafted": [s.drafted for s in st], "accepted": [s.accepted for s in st]}


# Peers' summary keys and table labels; their rows share one layout: "greedy" and "pld" runs
# ({"new_tokens", "wall_s", "output_ids"}; a greedy timed from the peer's own steps adds
# "prefill_s" / "decode_s") and "pld_equals_greedy".
PEER_LABELS = {"hf": "transformers", "llamacpp": "llama.cpp"}


def _peer_summary(by_key: dict, rs: list) -> dict:
    pairs = [(by_key[r["key"]], r) for r in rs if r["key"] in by_key]
    hs = [h for h, _ in pairs]
    gw = sum(h["greedy"]["wall_s"] for h in hs)
    gt = sum(h["greedy"]["new_tokens"] for h in hs)
    # agreement with specjax AR: whole outputs, and the share of AR's tokens the peer reproduced
    # before its first divergence (different arithmetic makes some divergence legitimate)
    e = {"prompts": len(hs), "greedy_wall_s": gw, "greedy_tok_s": _ratio(gt, gw),
         "greedy_equals_specjax_ar": sum(h["greedy"]["output_ids"] == r["ar"]["output_ids"] for h, r in pairs),
         "greedy_token_agreement": _ratio(sum(first_diff(h["greedy"]["output_ids"], r["ar"]["output_ids"])
                                              for h, r in pairs), sum(len(r["ar"]["output_ids"]) for _, r in pairs))}
    if all("pld" in h for h in hs):
        pw = sum(h["pld"]["wall_s"] for h in hs)
        pt = sum(h["pld"]["new_tokens"] for h in hs)
        e.update(pld_wall_s=pw, pld_tok_s=_ratio(pt, pw), pld_speedup=_ratio(gw, pw),
                 pld_differs_from_greedy=sum(not h["pld_equals_greedy"] for h in hs))
    if all("decode_s" in h["greedy"] for h in hs):
        # decode timed from the peer's own steps: tokens after the first (which the prefill gives)
        dd = sum(h["greedy"]["decode_s"] for h in hs)
        e["greedy_decode_tok_s"] = _ratio(sum(h["greedy"]["new_tokens"] - 1 for h in hs), dd)
        e["greedy_prefill_tok_s"] = _ratio(sum(r["prompt_tokens"] for _, r in pairs),
                                           sum(h["greedy"]["prefill_s"] for h in hs))
        sd = sum(r["ar"]["decode_s"] for _, r in pairs)
        e["specjax_ar_decode_ratio"] = _ratio(_ratio(sum(r["ar"]["new_tokens"] - 1 for _, r in pairs), sd),
                                              e["greedy_decode_tok_s"])
    return e


def summarize(rows, cat_order, methods, skipped, peer_rows=None) -> list[dict]:
    """One summary dict per category plus 'overall' (last). ``methods``: the row keys of the
    speculative runs (method_name); their entries go under 'drafters' (the name earlier JSON
    used). ``peer_rows``: {summary key (PEER_LABELS): the peer's rows}, each summarized under its key."""
    out = []
    peer_by_key = {name: {r["key"]: r for r in prs} for name, prs in (peer_rows or {}).items()}
    for cat in list(cat_order) + ["overall"]:
        rs = [r for r in rows if cat == "overall" or r["category"] == cat]
        sk = [s for s in skipped if cat == "overall" or s["category"] == cat]
        ar_wall = sum(r["ar"]["wall_s"] for r in rs)
        ar_tok = sum(r["ar"]["new_tokens"] for r in rs)
        ar_dec = sum(r["ar"].get("decode_s", 0.0) for r in rs)  # (nan tok/s for rows without it)
        e = {"category": cat, "prompts": len(rs), "skipped": len(sk), "ar": {
            "wall_s": ar_wall, "new_tokens": ar_tok, "tok_s": _ratio(ar_tok, ar_wall),
            "decode_tok_s": _ratio(sum(r["ar"]["new_tokens"] - 1 for r in rs), ar_dec)}, "drafters": {}}
        mism = 0
        for d in methods:
            w = sum(r[d]["wall_s"] for r in rs)
            t = sum(r[d]["new_tokens"] for r in rs)
            m = sum(r[d]["equal_to_ar"] is False for r in rs)  # (None: sampled, not compared)
            mism += m
            ks: dict = {}
            for r in rs:
                for k in r[d].get("step_records", {}).get("k_step", []):
                    ks[k] = ks.get(k, 0) + 1
            e["drafters"][d] = {"wall_s": w, "new_tokens": t, "tok_s": _ratio(t, w),
                                "speedup": _ratio(_ratio(t, w), _ratio(ar_tok, ar_wall)),
                                "mismatches": m, "k_step_counts": {str(k): ks[k] for k in sorted(ks)},
                                "draft_prefills": sum(bool(r[d].get("draft_prefill")) for r in rs),
                                **SpecStats.merged([r[d]["_stats"] for r in rs]).summary()}
        e["mismatches"] = mism
        for name, by_key in peer_by_key.items():
            e[name] = _peer_summary(by_key, rs)
        out.append(e)
    return out


def markdown_table(summary, methods, decode=True) -> str:
    """specjax's table: AR (and its decode tok/s, when ``decode``) and every method of ``methods``."""
    hdr = ["category", "prompts", "skipped", "AR tok/s"] + (["AR decode tok/s"] if decode else [])
    for d in methods:
        hdr += [f"{d} speedup", f"{d} acc. tok/step", f"{d} tok/s"]
    hdr += ["mismatches"]
    lines = ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    for e in summary:
        bold = e["category"] == "overall"
        cells = [f"**{e['category']}**" if bold else e["category"], str(e["prompts"]), str(e["skipped"]),
                 f"{e['ar']['tok_s']:.1f}"] + ([f"{e['ar']['decode_tok_s']:.1f}"] if decode else [])
        for d in methods:
            x = e["drafters"][d]
            sp = f"{x['speedup']:.2f}x"
            cells += [f"**{sp}**" if bold else sp, f"{x['mean_accepted_tokens']:.2f}", f"{x['tok_s']:.1f}"]
        cells.append(str(e["mismatches"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def best_method(summary, methods):
    """The method of ``methods`` with the highest overall tok/s (None without methods): the one
    peer comparisons name, chosen once over all categories, never per category."""
    return max(methods, key=lambda d: summary[-1]["drafters"][d]["tok_s"], default=None)


def _bold(text: str, on: bool) -> str:
    return f"**{text}**" if on else text


def peer_tables(summary, methods, peers) -> tuple[str, str]:
    """Two tables per category against the peers (summary keys, PEER_LABELS): decode (AR decode
    tok/s from each side's own steps, the ratio, and how far each peer's greedy output agrees
    with specjax AR: identical prompts / prompts, and the share of AR's tokens reproduced before
    the first divergence), and end to end (tok/s, prefill included: specjax AR and every method,
    each peer's greedy and prompt lookup, specjax's best method / each peer's prompt lookup)."""
    dec = [p for p in peers if "greedy_decode_tok_s" in summary[-1][p]]
    hdr = ["category", "prompts", "specjax AR decode tok/s"]
    for p in dec:
        hdr += [f"{PEER_LABELS[p]} decode tok/s", f"specjax / {PEER_LABELS[p]}"]
    hdr += [f"{PEER_LABELS[p]} = specjax AR (prompts, tokens)" for p in peers]
    a = ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    best = best_method(summary, methods)
    pld = [p for p in peers if "pld_tok_s" in summary[-1][p]]
    hdr = ["category", "specjax AR tok/s"] + [f"{d} tok/s" for d in methods]
    for p in peers:
        hdr += [f"{PEER_LABELS[p]} greedy tok/s"] + ([f"{PEER_LABELS[p]} PLD tok/s"] if p in pld else [])
    hdr += [f"{best} / {PEER_LABELS[p]} PLD" for p in pld if best]
    b = ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    for e in summary:
        bold = e["category"] == "overall"
        cells = [_bold(e["category"], bold), str(e["prompts"]), f"{e['ar']['decode_tok_s']:.1f}"]
        for p in dec:
            cells += [f"{e[p]['greedy_decode_tok_s']:.1f}", _bold(f"{e[p]['specjax_ar_decode_ratio']:.2f}x", bold)]
        cells += [f"{e[p]['greedy_equals_specjax_ar']}/{e[p]['prompts']}, {e[p]['greedy_token_agreement']:.0%}"
                  for p in peers]
        a.append("| " + " | ".join(cells) + " |")
        cells = [_bold(e["category"], bold), f"{e['ar']['tok_s']:.1f}"] + [
            f"{e['drafters'][d]['tok_s']:.1f}" for d in methods]
        for p in peers:
            cells += [f"{e[p]['greedy_tok_s']:.1f}"] + ([f"{e[p]['pld_tok_s']:.1f}"] if p in pld else [])
        cells += [_bold(f"{_ratio(e['drafters'][best]['tok_s'], e[p]['pld_tok_s']):.2f}x", bold)
                  for p in pld if best]
        b.append("| " + " | ".join(cells) + " |")
    return "\n".join(a), "\n".join(b)


def cpu_description() -> str:
    """This machine in one line, for a benchmark's headline: CPU model, cores, the SIMD a CPU
    kernel may use (from /proc/cpuinfo; the platform's name where that is absent)."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    field = {k.strip(): v.strip() for k, v in (ln.split(":", 1) for ln in info.splitlines() if ":" in ln)}
    flags = set(field.get("flags", "").split())
    simd = [f.upper() for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni") if f in flags]
    return (f"{field.get('model name', platform.machine())}, {os.cpu_count()} cores, "
            f"{' '.join(simd) or 'no AVX2'}{'' if 'avx512f' in flags else ', no AVX-512'}")


def peer_versions(peer_res: dict) -> dict:
    """{peer summary key: the versions its env recorded} (what a result must say it ran with)."""
    keys = ("llama_cpp_python", "torch", "transformers", "gguf_package", "numpy", "system_info",
            "torch_cpu_capability")
    return {k: {f: v["env"][f] for f in keys if f in v.get("env", {})} for k, v in peer_res.items()}


def peers_headline(fwd, envs: dict) -> str:
    """What differs between specjax (its resolved ForwardOptions ``fwd``) and the peers of ``envs``
    ({summary key: the peer's env}): which bytes each reads per step, its arithmetic, its threads,
    the machine."""
    cpu = cpu_description()
    arith = {"int8": "activations rounded to int8 per group of 32, as llama.cpp does, integer products; attention "
                     "through specjax's CPU kernel",
             "bfloat16": "activations rounded to bfloat16, products summed in float32; attention through specjax's "
                         "CPU kernel"}.get(fwd.rows_activations, "float32 arithmetic on them")
    span = "every decode and verify block" if fwd.rows_low else f"decode and verify blocks of up to {fwd.rows_kernel} rows"
    rest = ("prefill chunks run the same kernel, with XLA's attention" if fwd.rows_low
            else "longer blocks, prefill, read float32 copies through XLA's dot")
    reads = [(f"specjax reads the GGUF's quantized blocks (Q4_1/Q8_0) through its CPU rows kernel in {span} ({arith}; "
              f"{rest})") if fwd.rows_kernel else
             "specjax reads float32 copies of the weights through XLA's dot (rows kernel off)"]
    threads = [f"specjax: XLA:CPU's thread pool on all {os.cpu_count()} cores"]
    if "llamacpp" in envs:
        e = envs["llamacpp"]
        reads.append("llama.cpp reads the same blocks with its own kernels (activations quantized to 8 bits; built "
                     f"for: {e.get('system_info', '?')})")
        threads.append(f"llama.cpp: n_threads = n_threads_batch = {e.get('threads')}, OMP_WAIT_POLICY "
                       f"{e.get('omp_wait_policy')}")
    if "hf" in envs:
        e = envs["hf"]
        reads.append("transformers dequantizes every weight to float32 at load and reads float32 (torch "
                     f"{e.get('torch')}, CPU capability {e.get('torch_cpu_capability')})")
        threads.append(f"transformers: torch.set_num_threads({e.get('threads')}), OMP_WAIT_POLICY "
                       f"{e.get('omp_wait_policy')}")
    return ("What differs between the sides (same GGUF file, same token ids, batch 1, greedy): "
            + "; ".join(reads) + ". Threads: " + "; ".join(threads) + f". Machine: {cpu}. "
            "The same weights in another arithmetic (8-bit activations, another summation order) may flip a "
            "near-tie between two tokens, after which greedy outputs diverge legitimately: agreement with "
            "specjax AR is informational; what is checked is each specjax drafter's identity with specjax AR.")


def peer_notes(peer_res: dict, over: dict) -> list[str]:
    """What each peer of a run was (versions, threads, how it decodes and prompt-looks-up) and how
    often its prompt lookup's output differed from its own greedy: the notes under a bench table
    (``over``: the summary's overall row)."""
    notes = []
    hf = peer_res.get("hf")
    if hf:
        he, x = hf["env"], over["hf"]
        notes.append(f"transformers peer: transformers {he['transformers']}, torch {he['torch']} (CPU capability "
                     f"{he['torch_cpu_capability']}), gguf {he['gguf_package']}, {he['threads']} threads, "
                     f"OMP_WAIT_POLICY {he['omp_wait_policy']}, the GGUF "
                     "dequantized to float32; greedy = its own KV-cache loop (base model + lm_head on the last "
                     "position, argmax), prefill and decode timed apart; PLD = generate(prompt_lookup_num_tokens="
                     f"{he['prompt_lookup_num_tokens']}) timed whole (generate's per-step overhead included, which the "
                     f"loop does not pay); its PLD output differs from its greedy on {x.get('pld_differs_from_greedy')}"
                     f"/{x['prompts']} prompts.")
    lc = peer_res.get("llamacpp")
    if lc:
        le, x = lc["env"], over["llamacpp"]
        pld = (f"; PLD = LlamaPromptLookupDecoding(max_ngram_size={le['pld']['max_ngram_size']}, num_pred_tokens="
               f"{le['pld']['num_pred_tokens']}) through Llama.generate, which forces logits_all=True; PLD speedup = "
               "llama.cpp greedy wall / PLD wall") if "pld" in le else ""
        notes.append(f"llama.cpp peer: llama-cpp-python {le['llama_cpp_python']}, {le['threads']} threads, n_batch "
                     f"{le['n_batch']}, n_ubatch {le['n_ubatch']}, flash_attn {le['flash_attn']}, OMP_WAIT_POLICY "
                     f"{le['omp_wait_policy']}; system info: "
                     f"`{le['system_info']}`; greedy = eval + sample(temp=0) per token, prefill with logits of the "
                     "last position only, decode tok/s from its own steps ((new tokens - 1) / decode seconds, like "
                     f"the AR decode column){pld}; its PLD output differs from its greedy on "
                     f"{x.get('pld_differs_from_greedy')}/{x['prompts']} prompts.")
        for b in lc.get("batch", []):
            notes.append(f"llama.cpp batch {b['batch_size']} (parallel sequences, low-level API): {b['tok_s']:.1f} "
                         f"tok/s over {over['prompts']} prompts ({b['new_tokens']} tokens, {b['wall_s']:.1f} s, "
                         f"prefills included), output equals its greedy on {b['equal_to_greedy']}.")
    return notes


def prefill_table(specjax_s: dict, peers: dict) -> str:
    """Prefill tok/s by prompt length: ``specjax_s`` {tokens: seconds}, ``peers`` {label: {tokens:
    seconds}}; a ratio column per peer (specjax / peer)."""
    hdr = ["prompt tokens", "specjax AR prefill tok/s"]
    for lb in peers:
        hdr += [f"{lb} prefill tok/s", f"specjax / {lb}"]
    lines = ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    for n, s in specjax_s.items():
        cells = [str(n), f"{n / s:.0f}"]
        for p in peers.values():
            cells += [f"{n / p[n]:.0f}", f"{p[n] / s:.2f}x"] if n in p else ["-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratio_table(summary, methods: list[dict]) -> str:
    """Speedup over AR per category (columns) for every (drafter, policy) pair (rows): the
    compact view of a several-policy run. ``methods``: dicts with name, drafter, label."""
    cats = [e for e in summary if e["prompts"]]
    hdr = ["drafter", "policy"] + [e["category"] for e in cats]
    lines = ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    for m in methods:
        cells = [m["drafter"], m["label"]]
        for e in cats:
            r = f"{e['drafters'][m['name']]['speedup']:.2f}"
            cells.append(f"**{r}**" if e["category"] == "overall" else r)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def goodput_checks(summary, methods: list[dict], min_ratio: float = MIN_CATEGORY_RATIO) -> list[dict]:
    """For every goodput-policy pair: its lowest category ratio to AR (the issue's floor:
    ``min_ratio``) and its overall speedup against the best fixed K > 0 of the same drafter in
    the same run. ``methods``: dicts with name, drafter, label, goodput (bool) and k (the
    fixed K, None for a goodput policy). ``overall_pass`` is None when the run has no fixed K
    for that drafter."""
    over = summary[-1]["drafters"]
    out = []
    for m in methods:
        if not m["goodput"]:
            continue
        cats = [(e["category"], e["drafters"][m["name"]]["speedup"]) for e in summary[:-1] if e["prompts"]]
        low_cat, low = min(cats, key=lambda c: c[1])
        fixed = [f for f in methods if f["drafter"] == m["drafter"] and not f["goodput"] and (f["k"] or 0) > 0]
        best = max(fixed, key=lambda f: over[f["name"]]["speedup"], default=None)
        sp = over[m["name"]]["speedup"]
        bsp = over[best["name"]]["speedup"] if best else None
        out.append({"drafter": m["drafter"], "method": m["name"], "label": m["label"], "min_ratio": min_ratio,
                    "lowest_category": low_cat, "lowest_ratio": low, "categories_pass": low >= min_ratio,
                    "below_floor": {c: r for c, r in cats if r < min_ratio}, "overall_speedup": sp,
                    "best_fixed": best["name"] if best else None, "best_fixed_label": best["label"] if best else None,
                    "best_fixed_speedup": bsp, "overall_pass": None if best is None else sp >= bsp})
    return out


def check_lines(checks: list[dict], drafters) -> list[str]:
    """PASS/FAIL lines of goodput_checks, then the verdict over every drafter of the run."""
    lines = []
    for c in checks:
        who = f"{c['drafter']} under {c['label']}"
        lines.append(f"{'PASS' if c['categories_pass'] else 'FAIL'}: {who}: no category below {c['min_ratio']:.2f}x AR "
                     f"(lowest {c['lowest_ratio']:.3f}x, {c['lowest_category']}"
                     + (f"; below: {', '.join(f'{k} {v:.3f}x' for k, v in c['below_floor'].items())}"
                        if len(c["below_floor"]) > 1 else "") + ")")
        if c["overall_pass"] is None:
            lines.append(f"N/A: {who}: overall {c['overall_speedup']:.3f}x; no fixed K for {c['drafter']} in this run "
                         "to compare with (add integers to --policies)")
        else:
            lines.append(f"{'PASS' if c['overall_pass'] else 'FAIL'}: {who}: overall {c['overall_speedup']:.3f}x "
                         f"{'>=' if c['overall_pass'] else '<'} best fixed {c['best_fixed_label']} "
                         f"{c['best_fixed_speedup']:.3f}x")
    if not checks:
        return lines
    missing = [d for d in drafters if not any(c["drafter"] == d for c in checks)]
    if any(not c["categories_pass"] or c["overall_pass"] is False for c in checks):
        verdict = "FAIL"
    elif missing or any(c["overall_pass"] is None for c in checks):
        verdict = "INCOMPLETE"
    else:
        verdict = "PASS"
    lines.append(f"Goodput check over every drafter (each category >= {checks[0]['min_ratio']:.2f}x AR and overall >= "
                 f"the best fixed K): {verdict}"
                 + (f" (no goodput policy for: {', '.join(missing)})" if missing else ""))
    return lines


def update_benchmarks_md(path: str, section: str, name: str = "spec-bench", writer: str = "launch/bench.py") -> None:
    """Replace the section marked ``name`` in ``path`` (or append one), leaving the rest as is."""
    BEGIN_MARK = f"<!-- {name}:begin (written by {writer} --benchmarks_md) -->"
    END_MARK = f"<!-- {name}:end -->"
    text = open(path, encoding="utf-8").read() if os.path.isfile(path) else "# Benchmarks\n"
    block = f"{BEGIN_MARK}\n{section.rstrip()}\n{END_MARK}"
    i, j = text.find(BEGIN_MARK), text.find(END_MARK)
    if i >= 0 and j > i:
        text = text[:i] + block + text[j + len(END_MARK):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
