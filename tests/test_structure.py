"""The code's structure, checked from its source (nothing is imported or run): no import circles
among specjax's modules, no arrow from the drafters back up into the engine, the engine's spec
free of the registry, and no drafter-name tests outside the registry and the drafters."""

from __future__ import annotations

import ast
import collections
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules() -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(os.path.join(ROOT, "specjax")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the specjax modules it imports anywhere in its source (function bodies and
    TYPE_CHECKING blocks included: a lazy import is still an arrow)."""
    mods = _modules()

    def known(name: str) -> str | None:
        while name not in mods and "." in name:
            name = name.rsplit(".", 1)[0]
        return name if name in mods else None

    graph = collections.defaultdict(set)
    for m, path in mods.items():
        package = m if path.endswith("__init__.py") else m.rsplit(".", 1)[0]
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = (package.rsplit(".", node.level - 1)[0] if node.level > 1 else package) if node.level else ""
                mod = ".".join(filter(None, [base, node.module]))
                targets = [f"{mod}.{a.name}" for a in node.names]
            for t in targets:
                if t.startswith("specjax") and (k := known(t)) and k != m:
                    graph[m].add(k)
    return graph


def cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles_and_no_arrows_back_up():
    graph = import_graph()
    assert cycles(graph) == []
    back = sorted(f"{m} -> {n}" for m, ns in graph.items() if m.startswith("specjax.drafters")
                  for n in ns if n.startswith(("specjax.engine", "specjax.registry")))
    assert back == []
    assert "specjax.registry" not in graph["specjax.engine.spec"]


def test_no_drafter_name_tests_outside_the_registry_and_the_drafters():
    """A kind's name compared or looked up by hand (``== "eagle"``, ``in ("eagle", ...)``) anywhere
    but specjax/registry.py and specjax/drafters/: what a kind is comes from its table entry."""
    from specjax.drafters.table import DRAFTERS

    names = "|".join(re.escape(n) for n in DRAFTERS if n != "none")
    test = re.compile(rf"""(==|!=)\s*["']({names})["']|["']({names})["']\s*(==|!=)|in\s*[\(\[{{][^)\]}}]*["']({names})["']""")
    found = []
    for top in ("specjax", "launch"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, ROOT)
                if not f.endswith(".py") or rel == os.path.join("specjax", "registry.py") or \
                        rel.startswith(os.path.join("specjax", "drafters") + os.sep):
                    continue
                with open(path, encoding="utf-8") as fh:
                    for i, line in enumerate(fh, 1):
                        if test.search(line.split("#")[0]):
                            found.append(f"{rel}:{i}: {line.strip()}")
    assert found == []
