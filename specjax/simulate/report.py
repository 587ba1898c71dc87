"""Reports of serving sweeps (launch/serve_sim.py): runs pooled over repeated streams, the
latency/speedup and simulator-fidelity tables, the plot, and the BENCHMARKS.md section."""

from __future__ import annotations

import os
import sys


def pooled(runs: list[dict]) -> list[dict]:
    """One row per (mode, drafter, rate, policy): every repeat weighs the same (same request
    count), so the pooled mean latency is the mean of the runs' means; the spread across
    repeats is kept to show how far identical configurations drift on this machine."""
    import numpy as np

    groups: dict = {}
    for r in runs:
        groups.setdefault((r["mode"], r["drafter"], r["rate"], r["policy"]), []).append(r)
    out = []
    for (mode, d, rate, pol), rs in groups.items():
        row = dict(mode=mode, drafter=d, rate=rate, policy=pol, repeats=len(rs))
        if "real_drafter" in rs[0]:
            row["real_drafter"] = rs[0]["real_drafter"]
        for k, v in rs[0].items():
            if k not in row and k != "repeat" and isinstance(v, (int, float)):
                row[k] = float(np.mean([x[k] for x in rs]))
        lat = [x["mean_latency_s"] for x in rs]
        row["latency_runs_s"] = lat
        row["latency_spread"] = (max(lat) - min(lat)) / row["mean_latency_s"] if len(lat) > 1 else 0.0
        out.append(row)
    return out


def _is_fixed(policy: str) -> bool:
    """The baselines: no speculation and fixed K (or fixed tree node budget N)."""
    return policy == "no-SD" or policy.startswith("K=")


def speedup_table(rows, mode: str) -> str:
    """Markdown: per drafter and rate, latency of each policy and speedup over no-SD; each
    goodput policy's gap to the best fixed baseline (no-SD or a fixed K) at that rate."""
    lines = []
    drafters = sorted({r["drafter"] for r in rows if r["mode"] == mode})
    pols = []
    for r in rows:
        if r["mode"] == mode and r["policy"] not in pols:
            pols.append(r["policy"])
    chosen = [p for p in pols if not _is_fixed(p) and p != "oracle"]
    for d in drafters:
        lines.append(f"\n**{d}** ({mode}): mean request latency in s (speedup over no-SD)\n")
        lines.append("| rate (req/s) | " + " | ".join(pols) + "".join(f" | {p} vs best fixed" for p in chosen) + " |")
        lines.append("|---" * (len(pols) + len(chosen) + 1) + "|")
        for rate in sorted({r["rate"] for r in rows if r["mode"] == mode and r["drafter"] == d}):
            by = {r["policy"]: r for r in rows if r["mode"] == mode and r["drafter"] == d and r["rate"] == rate}
            base = by.get("no-SD", {}).get("mean_latency_s")
            cells = []
            for p in pols:
                lat = by[p]["mean_latency_s"] if p in by else float("nan")
                cells.append(f"{lat:.2f} ({base / lat:.2f}x)" if base else f"{lat:.2f}")
            fixed = [by[p]["mean_latency_s"] for p in by if _is_fixed(p)]
            gaps = [f"{(by[p]['mean_latency_s'] / min(fixed) - 1) * 100:+.1f}%" if p in by and fixed else ""
                    for p in chosen]
            lines.append(f"| {rate:g} | " + " | ".join(cells + gaps) + " |")
    return "\n".join(lines)


SATURATED = 0.95  # a real run whose engine was busy this share of its span had no spare capacity


def fidelity_table(rows) -> str:
    """Simulated vs measured mean latency per (rate, policy), with the real run's utilisation;
    the summary separates runs below saturation (the regime the paper's <10% claim is about)."""
    import numpy as np

    lines = ["\n**Simulator fidelity**: simulated vs measured mean latency (same requests, arrivals, output lengths)\n",
             "| drafter | rate | policy | real utilisation | measured (s) | simulated (s) | error |",
             "|---|---|---|---|---|---|---|"]
    real = {(r["drafter"], r["rate"], r["policy"]): r for r in rows if r["mode"] == "real"}
    errs: dict = {}
    for r in rows:
        if r["mode"] != "sim":
            continue
        m = real.get((r.get("real_drafter", r["drafter"]), r["rate"], r["policy"]))
        if m:
            err = r["mean_latency_s"] / m["mean_latency_s"] - 1
            sat = m["utilization"] >= SATURATED
            errs.setdefault((r["drafter"], sat), []).append(abs(err))
            lines.append(f"| {r['drafter']} | {r['rate']:g} | {r['policy']} | {m['utilization']:.2f}"
                         f"{' (saturated)' if sat else ''} | {m['mean_latency_s']:.2f} | {r['mean_latency_s']:.2f} | "
                         f"{err * 100:+.1f}% |")
    lines.append("")
    for (d, sat), e in sorted(errs.items()):
        lines.append(f"- {d}, {'saturated' if sat else 'below saturation'} (utilisation "
                     f"{'>=' if sat else '<'} {SATURATED}): mean |error| {np.mean(e) * 100:.1f}%, max "
                     f"{np.max(e) * 100:.1f}%, {sum(x <= 0.10 for x in e)} of {len(e)} runs within 10%")
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["mode"], r["drafter"]) for r in rows})
    fig, axes = plt.subplots(2, len(groups), figsize=(4.2 * len(groups), 6.5), squeeze=False)
    for j, (mode, d) in enumerate(groups):
        rs = [r for r in rows if r["mode"] == mode and r["drafter"] == d]
        rates = sorted({r["rate"] for r in rs})
        base = {r["rate"]: r["mean_latency_s"] for r in rs if r["policy"] == "no-SD"}
        pols = []
        for r in rs:
            if r["policy"] not in pols:
                pols.append(r["policy"])
        for p in pols:
            lat = [next(r["mean_latency_s"] for r in rs if r["rate"] == x and r["policy"] == p) for x in rates]
            style = dict(lw=2.5, color="k") if p == "SmartSpec" else dict(lw=1.2, ls="--" if p == "oracle" else "-")
            axes[0, j].plot(rates, lat, marker="o", ms=3, label=p, **style)
            if base:
                axes[1, j].plot(rates, [base[x] / v for x, v in zip(rates, lat)], marker="o", ms=3, label=p, **style)
        axes[0, j].set_title(f"{d} ({mode})", fontsize=9)
        axes[0, j].set_ylabel("mean request latency (s)")
        axes[1, j].set_ylabel("speedup over no-SD")
        axes[1, j].axhline(1.0, color="grey", lw=0.8)
        for ax in axes[:, j]:
            ax.set_xlabel("request rate (req/s)")
            ax.grid(alpha=0.3)
        axes[0, j].legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"[plot: {path}]", file=sys.stderr)


def replace_md_section(title: str, body: str, path: str, command: str) -> None:
    """Replace the '## title' section of ``path`` (up to the next '## ') or append it."""
    text = open(path).read() if os.path.exists(path) else ""
    head = f"## {title}"
    block = f"{head}\n\nCommand: `{command}`\n{body}\n"
    if head in text:
        start = text.index(head)
        nxt = text.find("\n## ", start + len(head))
        text = text[:start] + block + (text[nxt + 1:] if nxt >= 0 else "")
    else:
        text = text.rstrip() + "\n\n" + block
    with open(path, "w") as f:
        f.write(text)
