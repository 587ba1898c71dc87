"""notebooks/kernel_bench.ipynb runs headless at its tiny size on CPU (interpret mode) and
produces its table, JSON and plot, with the kernel agreeing with the reference."""

from __future__ import annotations

import json
import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "kernel_bench.ipynb"


def test_kernel_bench_notebook_runs_headless(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECJAX_KERNEL_BENCH", "tiny")
    monkeypatch.setenv("SPECJAX_BENCH_OUT", str(tmp_path))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    result = json.loads((tmp_path / "kernel_bench_tiny.json").read_text())
    assert len(result["rows"]) == 2 * 2 * 2
    assert all(r["kernel_ms"] > 0 and r["xla_ms"] > 0 and r["max_abs_err"] <= 5e-2 for r in result["rows"])
    assert (tmp_path / "kernel_bench_tiny.png").stat().st_size > 10_000
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "| context | N | batch |" in text
