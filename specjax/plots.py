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
