"""The figures launch scripts draw (matplotlib, imported when drawing; PNG files)."""

from __future__ import annotations

import os
import sys


def perf_fit(path: str, m, tgt, dr, label: str) -> None:
    """Predicted vs measured step times of a fitted StepCostModel (launch/profile.py --plot):
    target verify steps ``tgt`` and device-draft steps ``dr`` (records of profiling.profile_steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    for recs, dev, color, name in ((tgt, False, "tab:blue", "target verify"), (dr, True, "tab:orange", label)):
        if not recs:
            continue
        meas = [r["t"] * 1e3 for r in recs]
        pred = [(m.device_time(r["B"], r["K"], r["ctx_lens"]) if dev else m.target_time(r["B"], r["K"], r["ctx_lens"]))
                * 1e3 for r in recs]
        ax.scatter(meas, pred, s=8, alpha=0.6, color=color, label=name)
    lim = max(ax.get_xlim()[1], ax.get_ylim()[1])
    ax.plot([0, lim], [0, lim], "r-", lw=1)
    ax.set_xlabel("measured step time (ms)")
    ax.set_ylabel("predicted (ms)")
    ax.set_title(f"perf model fit: {label}")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"[plot: {path}]", file=sys.stderr)


def distill_curves(path: str, losses, accs, divergence: str, k: int, title: str, acc_label: str | None = None) -> None:
    """Loss per optimizer step and held-out acceptance per round (launch/distill.py --plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
    a.plot(np.arange(1, len(losses) + 1), losses, lw=0.8)
    a.set_xlabel("optimizer step")
    a.set_ylabel(f"{divergence} loss")
    b.plot(np.arange(len(accs)), accs, marker="o")
    b.set_xlabel("round (0: before training)")
    b.set_ylabel(acc_label or f"held-out acceptance, K={k}")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}", file=sys.stderr)


def head_training(path: str, history, evals, k: int, title: str) -> None:
    """A head's long run (distill.head_pipeline), redrawn as it goes: the loss (``history``:
    [step, training tokens, mean loss] per logging interval) and the held-out acceptance
    (``evals``: [step, tokens, top-1 agreement, estimated tokens per verify step, the engine's
    measured tokens per verify step or None, ...]) against the training tokens seen (log x: the
    curve of acceptance vs data). Written to a temporary name and renamed: a reader never sees a
    half-written PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 3.4))
    h = [r for r in history if r[1] > 0]
    a.plot([r[1] for r in h], [r[2] for r in h], lw=0.8)
    a.set_ylabel("training loss")
    e = [r for r in evals if r[1] > 0]
    b.plot([r[1] for r in e], [r[2] for r in e], marker=".", label="top-1 agreement (draft 1)")
    b.set_ylabel("held-out top-1 agreement")
    c.plot([r[1] for r in e], [r[3] for r in e], marker=".", label="estimate (stored held-out data)")
    eng = [r for r in e if len(r) > 4 and r[4] is not None]
    if eng:
        c.plot([r[1] for r in eng], [r[4] for r in eng], marker="o", label="engine (held-out prompts)")
    c.set_ylabel(f"tokens per verify step, K={k}")
    c.legend(fontsize=8)
    for ax in (a, b, c):
        ax.set_xlabel("training tokens")
        if h or e:
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # (labelled minor ticks overlap)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = os.path.join(os.path.dirname(path) or ".", "." + os.path.basename(path) + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def head_curve(path: str, series: dict, title: str, refs: dict | None = None) -> None:
    """Held-out tokens per verify step against training tokens (log x): ``series`` maps a label
    (a head kind and its drafting) to [(training tokens, tokens per step), ...]; ``refs`` maps a
    label to one value drawn as a dashed line (the shipped head's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    lines = {}
    for label, pts in series.items():
        pts = sorted(pts)
        lines[label] = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)[0]
    for label, y in (refs or {}).items():
        base = label.split(" (")[0]
        color = lines[base].get_color() if base in lines else "gray"
        ax.axhline(y, ls="--", lw=0.8, color=color, label=label)
    ax.set_xscale("log")
    xs = sorted({p[0] for pts in series.values() for p in pts})
    ax.set_xticks(xs, [f"{x / 1e3:.0f}k" if x < 1e6 else f"{x / 1e6:.1f}M" for x in xs])  # (the points' own)
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("training tokens")
    ax.set_ylabel("held-out tokens per verify step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
