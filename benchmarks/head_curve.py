"""The head-training curve: held-out tokens per verify step against the training tokens a head has
seen, for each snapshot a pipeline run kept (``launch/distill.py --pipeline``, its
``CHECKPOINT_DIR/snapshots/tokens-N``), drafting chains at K = ``--k`` and trees.

Held-out prompts, none of them in the training data: Spec-Bench first turns (``--per_category``
of each of its 13 categories), GSM8K test questions (``--gsm8k``, the shared test subset; the
pipeline's GSM8K prompts come from the train split) and, with ``--data_dir``, the data set's own
held-out prompts (prompts no training shard has). Greedy, chat template, through the engine
(distill.heads_offline.HeldOut: every output checked token-identical to AR). Tokens per step =
1 + accepted drafts / steps, per group and overall; ``chat`` = Spec-Bench's writing, roleplay,
reasoning, stem, humanities and qa.

  python benchmarks/head_curve.py --run eagle=/work/runs/eagle-run1 --run medusa=/work/runs/medusa-run1 \\
      --data_dir /work/runs/eagle-data --out_dir /work/runs/curve

Writes curve.json, curve.md and curve.png to ``--out_dir`` (the JSON after every point: a killed
run keeps what it measured, and a rerun skips the points it has). Runs measured apart, say side
by side, go into one table and plot with ``--merge OTHER/curve.json --nomeasure``.
"""

from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_multi_string("run", [], "KIND=CHECKPOINT_DIR of a pipeline run (eagle or medusa), its snapshots "
                              "measured.")
    flags.DEFINE_string("shared_dir", os.path.join(ROOT, "..", "shared"), "The shared folder (data/spec_bench, "
                        "data/gsm8k).")
    flags.DEFINE_string("data_dir", None, "A pipeline data set whose held-out prompts join the measurement.")
    flags.DEFINE_integer("per_category", 2, "Spec-Bench first turns per category.")
    flags.DEFINE_integer("gsm8k", 8, "GSM8K test questions.")
    flags.DEFINE_integer("data_prompts", 8, "The data set's held-out prompts (with --data_dir).")
    flags.DEFINE_integer("max_new_tokens", 96, "New tokens per prompt.")
    flags.DEFINE_integer("k", 3, "Chain drafts per step.")
    flags.DEFINE_integer("tree_nodes", 6, "Tree drafts per step (0: no tree); eagle's trees are --tree_width x "
                         "--tree_depth dynamic ones, medusa's its saved tree.")
    flags.DEFINE_integer("tree_width", 3, "eagle: the dynamic tree's width.")
    flags.DEFINE_integer("tree_depth", 3, "eagle: the dynamic tree's depth.")
    flags.DEFINE_integer("points", 0, "At most this many snapshots per run, spread evenly in log tokens (0: all).")
    flags.DEFINE_bool("shipped", True, "Also measure the shipped head of each kind (a dashed line on the plot).")
    flags.DEFINE_string("out_dir", None, "Where curve.json, curve.md and curve.png go.")
    flags.DEFINE_multi_string("merge", [], "Also take the points of these curve.json files (other runs measured "
                              "the same way, say in parallel), measuring nothing they have.")
    flags.DEFINE_bool("measure", True, "--nomeasure: only write the table and the plot from what is measured.")


CHAT = ("writing", "roleplay", "reasoning", "stem", "humanities", "qa")


def pick(snapshots: list[tuple[int, str]], n: int) -> list[tuple[int, str]]:
    """At most n of (tokens, dir) sorted by tokens, spread evenly in log tokens, the first and the
    last always kept."""
    import math

    if n <= 0 or len(snapshots) <= n:
        return snapshots
    lo, hi = math.log(snapshots[0][0]), math.log(snapshots[-1][0])
    keep = []
    for i in range(n):
        want = lo + (hi - lo) * i / (n - 1)
        best = min((s for s in snapshots if s not in keep), key=lambda s: abs(math.log(s[0]) - want))
        keep.append(best)
    return sorted(keep)


def prompts(model) -> tuple[list[list[int]], list[str]]:
    """The held-out prompts' tokens and each one's group (a Spec-Bench category, gsm8k, data)."""
    from specjax.distill.offline import prompt_encoder
    from specjax.specbench import load_questions

    encode = prompt_encoder(model, True, None, 1024, FLAGS.max_new_tokens)
    qs, _ = load_questions(os.path.join(FLAGS.shared_dir, "data", "spec_bench", "question.jsonl"), None,
                           FLAGS.per_category)
    toks, groups = [encode(q["text"]) for q in qs], [q["category"] for q in qs]
    with open(os.path.join(FLAGS.shared_dir, "data", "gsm8k", "test_shared_200.jsonl"), encoding="utf-8") as f:
        gsm = [json.loads(x)["question"] for x in f if x.strip()][:FLAGS.gsm8k]
    toks += [encode(q) for q in gsm]
    groups += ["gsm8k"] * len(gsm)
    if FLAGS.data_dir:
        from specjax.distill.head_data import DataSet

        ev = DataSet.open(FLAGS.data_dir, lambda m: None).eval
        n = min(FLAGS.data_prompts, len(ev))
        toks += [list(map(int, ev.prompt(i))) for i in range(n)]
        groups += ["data held-out"] * n
    return toks, groups


def summarize(rows: list[tuple[int, int, bool]], groups: list[str]) -> dict:
    """Tokens per step overall, on the chat categories and per group, and the identical count."""
    def tps(sel):
        steps = sum(rows[i][0] for i in sel)
        return 1.0 + sum(rows[i][1] for i in sel) / max(steps, 1)

    every = range(len(rows))
    out = {"overall": tps(every), "chat": tps([i for i in every if groups[i] in CHAT]),
           "identical": sum(r[2] for r in rows), "prompts": len(rows)}
    for g in dict.fromkeys(groups):
        out[g] = tps([i for i in every if groups[i] == g])
    return out


def drafter(kind: str, model, head: str, tree: bool):
    if kind == "eagle":
        from specjax.drafters import eagle

        return eagle.build(model, head, FLAGS.tree_width if tree else 0, FLAGS.tree_depth)
    from specjax.drafters import medusa

    return medusa.build(model, head, tree=tree)


def shipped(kind: str, model) -> tuple[str | None, str | None]:
    """The head of ``kind`` shipped for ``model``: (its directory, the hash its spec file's record
    holds, which tells one shipped head from the next), or (None, None)."""
    from specjax.drafters import heads

    spec = __import__(f"specjax.drafters.{kind}", fromlist=["KIND"]).KIND
    d = heads.shipped_head(spec, model.cfg)
    if d is None:
        return None, None
    with open(os.path.join(d, spec.file + ".sha256")) as f:
        return d, next(w for w in f.read().split() if len(w) == 64)[:16]


def head_label(p: dict, current: dict) -> str:
    """A point's head: its training tokens, else the shipped head (or the one shipped before it)."""
    if p["tokens"] is not None:
        return f"{p['tokens']:,}"
    return "shipped" if p.get("head") == current.get(p["kind"]) else "earlier shipped head"


def table(points: list[dict], groups: list[str], current: dict) -> str:
    cols = ["overall", "chat"] + list(dict.fromkeys(groups))
    lines = ["| head | drafting | training tokens | " + " | ".join(cols) + " | identical to AR |",
             "|" + "---|" * (len(cols) + 4)]
    for p in points:
        tok = head_label(p, current)
        lines.append(f"| {p['kind']} | {p['mode']} | {tok} | " + " | ".join(f"{p[c]:.2f}" for c in cols)
                     + f" | {p['identical']}/{p['prompts']} |")
    return "\n".join(lines)


def run() -> int:
    from specjax import plots
    from specjax.distill.heads_offline import HeldOut
    from specjax.errors import SpecjaxError
    from specjax.models.loader import load_model

    if not (FLAGS.run or not FLAGS.measure) or not FLAGS.out_dir:
        raise SpecjaxError("give --run KIND=DIR (one or more; none with --nomeasure) and --out_dir")
    runs = []
    for r in FLAGS.run:
        kind, _, d = r.partition("=")
        if kind not in ("eagle", "medusa") or not os.path.isdir(os.path.join(d, "snapshots")):
            raise SpecjaxError(f"--run {r}: expected eagle=DIR or medusa=DIR of a pipeline run with snapshots/")
        snaps = sorted((int(n.split("-")[1]), os.path.join(d, "snapshots", n))
                       for n in os.listdir(os.path.join(d, "snapshots")) if n.startswith("tokens-"))
        runs.append((kind, d, pick(snaps, FLAGS.points)))
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    out_json = os.path.join(FLAGS.out_dir, "curve.json")
    kept = ("run", "per_category", "gsm8k", "data_prompts", "max_new_tokens", "k", "tree_nodes", "tree_width",
            "tree_depth")
    settings = {x: FLAGS[x].value for x in kept if x != "run"}

    def measured_alike(path: str, what: str) -> list[dict]:
        """The points of curve.json ``path``, refused if measured with other settings."""
        with open(path) as f:
            got = json.load(f)
        if {x: got["flags"].get(x) for x in settings} != settings:
            raise SpecjaxError(f"{what} was measured with other settings ({got['flags']}): give the same ones")
        return got["points"]

    # (a rerun goes on with the points it has, if measured the same way)
    done = measured_alike(out_json, f"{out_json} (or give another --out_dir)") if os.path.exists(out_json) else []
    for path in FLAGS.merge:
        done += [p for p in measured_alike(path, f"--merge {path}") if p not in done]
    model = load_model()
    toks, groups = prompts(model)
    if not FLAGS.measure:
        runs = []
    print(f"[{len(toks)} held-out prompts: {', '.join(f'{g} {groups.count(g)}' for g in dict.fromkeys(groups))}]",
          file=sys.stderr)
    modes = [("chain", False, FLAGS.k)] + ([("tree", True, FLAGS.tree_nodes)] if FLAGS.tree_nodes else [])
    ref, points = None, list(done)

    def save(points):
        with open(out_json + ".tmp", "w") as f:
            json.dump({"flags": {x: FLAGS[x].value for x in kept}, "groups": groups, "points": points}, f, indent=1)
        os.replace(out_json + ".tmp", out_json)

    t0 = time.perf_counter()
    for kind, d, snaps in runs:
        todo = [(n, s) for n, s in snaps] + ([(None, None)] if FLAGS.shipped else [])
        for mode, tree, k in modes:
            for n, head in todo:
                label = {"kind": kind, "mode": f"{mode} K={k}", "tokens": n, "run": d}
                if n is None:  # (measured again once another head ships)
                    head, label["head"] = shipped(kind, model)
                    if head is None:
                        continue
                if any(all(p.get(x) == label[x] for x in label) for p in done):
                    continue
                held = HeldOut(model, drafter(kind, model, head, tree), toks, FLAGS.max_new_tokens, k, ref=ref)
                ref = held.ref
                s = summarize(held.per_prompt(), groups)
                points.append({**label, **s})
                print(f"[{kind} {mode} K={k} at {'shipped' if n is None else f'{n:,} tokens'}: overall "
                      f"{s['overall']:.3f}, chat {s['chat']:.3f}, {s['identical']}/{s['prompts']} identical; "
                      f"{time.perf_counter() - t0:.0f} s]", file=sys.stderr)
                save(points)
    save(points)  # (with --merge: every point in one file)
    current = {kind: shipped(kind, model)[1] for kind in {p["kind"] for p in points}}
    md = table(points, groups, current)
    with open(os.path.join(FLAGS.out_dir, "curve.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    series, refs = {}, {}
    for p in points:
        lab = f"{p['kind']} {p['mode']}"
        if p["tokens"] is None:
            refs[f"{lab} ({head_label(p, current)})"] = p["overall"]
        else:
            series.setdefault(lab, []).append((p["tokens"], p["overall"]))
    plots.head_curve(os.path.join(FLAGS.out_dir, "curve.png"), series,
                     f"{model.cfg.name}: held-out tokens per verify step ({len(toks)} prompts, greedy)", refs)
    return 0


def main(argv):
    from specjax import cli

    cli.run_job(run, argv)


if __name__ == "__main__":
    define_flags()
    app.run(main)
