"""Spec-Bench-style benchmarking: the question file, per-category summaries and their markdown
table, the BENCHMARKS.md section writer, and the guard that no compilation happens while timing.
``launch/bench.py`` is the command-line leaf over this module."""

from __future__ import annotations

import json
import os

from specjax.spec_generate import SpecStats


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


def summarize(rows, cat_order, drafters, skipped, hf_rows) -> list[dict]:
    """One summary dict per category plus 'overall' (last)."""
    out = []
    hf_by_key = {r["key"]: r for r in hf_rows} if hf_rows is not None else None
    for cat in list(cat_order) + ["overall"]:
        rs = [r for r in rows if cat == "overall" or r["category"] == cat]
        sk = [s for s in skipped if cat == "overall" or s["category"] == cat]
        ar_wall = sum(r["ar"]["wall_s"] for r in rs)
        ar_tok = sum(r["ar"]["new_tokens"] for r in rs)
        e = {"category": cat, "prompts": len(rs), "skipped": len(sk), "ar": {
            "wall_s": ar_wall, "new_tokens": ar_tok, "tok_s": _ratio(ar_tok, ar_wall)}, "drafters": {}}
        mism = 0
        for d in drafters:
            w = sum(r[d]["wall_s"] for r in rs)
            t = sum(r[d]["new_tokens"] for r in rs)
            m = sum(not r[d]["equal_to_ar"] for r in rs)
            mism += m
            e["drafters"][d] = {"wall_s": w, "new_tokens": t, "tok_s": _ratio(t, w), "speedup": _ratio(ar_wall, w),
                                "mismatches": m, **SpecStats.merged([r[d]["_stats"] for r in rs]).summary()}
        e["mismatches"] = mism
        if hf_by_key is not None:
            pairs = [(hf_by_key[r["key"]], r) for r in rs if r["key"] in hf_by_key]
            hs = [h for h, _ in pairs]
            gw = sum(h["greedy"]["wall_s"] for h in hs)
            gt = sum(h["greedy"]["new_tokens"] for h in hs)
            pw = sum(h["pld"]["wall_s"] for h in hs)
            pt = sum(h["pld"]["new_tokens"] for h in hs)
            e["hf"] = {"prompts": len(hs), "greedy_wall_s": gw, "greedy_tok_s": _ratio(gt, gw), "pld_wall_s": pw,
                       "pld_tok_s": _ratio(pt, pw), "pld_speedup": _ratio(gw, pw),
                       "pld_differs_from_greedy": sum(not h["pld_equals_greedy"] for h in hs),
                       "greedy_equals_specjax_ar": sum(h["greedy"]["output_ids"] == r["ar"]["output_ids"]
                                                       for h, r in pairs)}
        out.append(e)
    return out


def markdown_table(summary, drafters, hf: bool) -> str:
    hdr = ["category", "prompts", "skipped", "AR tok/s"]
    for d in drafters:
        hdr += [f"{d} speedup", f"{d} acc. tok/step", f"{d} tok/s"]
    hdr += ["mismatches"]
    if hf:
        hdr += ["HF greedy tok/s", "HF PLD speedup", "HF PLD≠greedy"]
    lines = ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    for e in summary:
        bold = e["category"] == "overall"
        cells = [f"**{e['category']}**" if bold else e["category"], str(e["prompts"]), str(e["skipped"]),
                 f"{e['ar']['tok_s']:.1f}"]
        for d in drafters:
            x = e["drafters"][d]
            sp = f"{x['speedup']:.2f}x"
            cells += [f"**{sp}**" if bold else sp, f"{x['mean_accepted_tokens']:.2f}", f"{x['tok_s']:.1f}"]
        cells.append(str(e["mismatches"]))
        if hf:
            h = e["hf"]
            cells += [f"{h['greedy_tok_s']:.1f}", f"{h['pld_speedup']:.2f}x", str(h["pld_differs_from_greedy"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


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
