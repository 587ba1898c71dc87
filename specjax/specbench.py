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
- Greedy, batch 1, both sides stop at EOS. One process runs the specjax AR baseline
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

- speedup = (total AR wall time) / (total drafter wall time) over the category's prompts
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

Peer column (``--hf_python``): before the specjax runs (never concurrently) the ``hf_pld`` peer
(``specjax.peers``) runs ``benchmarks/hf_pld.py`` in that Python (torch CPU + transformers; specjax never imports torch)
on the same chat-template token ids (passed in a temp JSON), doing HF greedy and HF prompt
lookup (``prompt_lookup_num_tokens`` = ``--hf_prompt_lookup_num_tokens``) with
``--hf_threads`` torch threads; the table adds HF greedy tok/s, HF PLD speedup vs HF greedy
(ratio of total wall times) and how many HF PLD outputs differ from HF greedy.
``--llamacpp_python`` adds the ``llamacpp`` peer (benchmarks/llamacpp_peer.py) the same way: its
greedy and prompt-lookup rows have hf_pld's layout, and since it times prefill and decode apart,
the table adds the specjax AR decode tok/s ((new tokens - 1) / decode seconds), llama.cpp's, and
their ratio. ``--prefill_lens`` adds a prefill-by-length table (``prefill_table``).
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


# Peers' summary keys and table labels; their rows share hf_pld's layout: "greedy" and "pld" runs
# ({"new_tokens", "wall_s", "output_ids"}, llama.cpp's greedy adds "prefill_s" / "decode_s") and
# "pld_equals_greedy".
PEER_LABELS = {"hf": "HF", "llamacpp": "llama.cpp"}


def _peer_summary(by_key: dict, rs: list) -> dict:
    pairs = [(by_key[r["key"]], r) for r in rs if r["key"] in by_key]
    hs = [h for h, _ in pairs]
    gw = sum(h["greedy"]["wall_s"] for h in hs)
    gt = sum(h["greedy"]["new_tokens"] for h in hs)
    e = {"prompts": len(hs), "greedy_wall_s": gw, "greedy_tok_s": _ratio(gt, gw),
         "greedy_equals_specjax_ar": sum(h["greedy"]["output_ids"] == r["ar"]["output_ids"] for h, r in pairs)}
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
            m = sum(not r[d]["equal_to_ar"] for r in rs)
            mism += m
            ks: dict = {}
            for r in rs:
                for k in r[d].get("step_records", {}).get("k_step", []):
                    ks[k] = ks.get(k, 0) + 1
            e["drafters"][d] = {"wall_s": w, "new_tokens": t, "tok_s": _ratio(t, w), "speedup": _ratio(ar_wall, w),
                                "mismatches": m, "k_step_counts": {str(k): ks[k] for k in sorted(ks)},
                                "draft_prefills": sum(bool(r[d].get("draft_prefill")) for r in rs),
                                **SpecStats.merged([r[d]["_stats"] for r in rs]).summary()}
        e["mismatches"] = mism
        for name, by_key in peer_by_key.items():
            e[name] = _peer_summary(by_key, rs)
        out.append(e)
    return out


def markdown_table(summary, methods, peers=()) -> str:
    """``peers``: the summary keys of the peers to add columns for (PEER_LABELS)."""
    decode = any("greedy_decode_tok_s" in summary[-1][p] for p in peers)
    hdr = ["category", "prompts", "skipped", "AR tok/s"] + (["AR decode tok/s"] if decode else [])
    for d in methods:
        hdr += [f"{d} speedup", f"{d} acc. tok/step", f"{d} tok/s"]
    hdr += ["mismatches"]
    for p in peers:
        lb, x = PEER_LABELS[p], summary[-1][p]
        hdr += [f"{lb} greedy tok/s"]
        if "greedy_decode_tok_s" in x:
            hdr += [f"{lb} decode tok/s", f"specjax AR / {lb} decode"]
        if "pld_speedup" in x:
            hdr += [f"{lb} PLD speedup", f"{lb} PLD≠greedy"]
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
        for p in peers:
            h = e[p]
            cells += [f"{h['greedy_tok_s']:.1f}"]
            if "greedy_decode_tok_s" in summary[-1][p]:
                r = f"{h['specjax_ar_decode_ratio']:.2f}x"
                cells += [f"{h['greedy_decode_tok_s']:.1f}", f"**{r}**" if bold else r]
            if "pld_speedup" in summary[-1][p]:
                cells += [f"{h['pld_speedup']:.2f}x", str(h["pld_differs_from_greedy"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


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
