"""The shape of the code, checked: data and imports flow one way, and no door is one giant function.

The import graph holds every ``import`` statement of the package, lazy ones inside functions
included (a lazy import still ties two modules together).
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "flashasr"


def _modules() -> dict[str, tuple[Path, bool]]:
    mods = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)
    return mods


def _targets(mod: str, is_pkg: bool, node, mods) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.startswith("flashasr")]
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    if node.level:
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if not target.startswith("flashasr"):
        return []
    return [f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target for a in node.names]


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {}
    for m, (p, is_pkg) in mods.items():
        edges = set()
        for n in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                edges |= {t for t in _targets(m, is_pkg, n, mods) if t in mods and t != m}
        graph[m] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return out


def test_the_import_graph_has_no_loops():
    assert _cycles(import_graph()) == []


def test_cycle_finder_finds_a_loop():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_layers_import_downward_only():
    """models/ knows no engine, audio or anything above it; the engine and the pipeline know no door."""
    above = {
        "flashasr.models": ("flashasr.engine", "flashasr.audio", "flashasr.pipeline", "flashasr.jobs",
                            "flashasr.serve", "flashasr.cli", "flashasr.random_models"),
        "flashasr.engine": ("flashasr.pipeline", "flashasr.jobs", "flashasr.serve", "flashasr.cli"),
        "flashasr.audio": ("flashasr.models", "flashasr.engine", "flashasr.pipeline", "flashasr.jobs",
                           "flashasr.serve"),
        "flashasr.pipeline": ("flashasr.jobs", "flashasr.serve", "flashasr.cli"),
        "flashasr.options": ("flashasr.models", "flashasr.engine", "flashasr.pipeline", "flashasr.audio"),
    }
    bad = []
    for mod, edges in import_graph().items():
        for layer, forbidden in above.items():
            if mod == layer or mod.startswith(layer + "."):
                bad += [(mod, e) for e in edges if e.startswith(forbidden)]
    assert bad == []


def test_no_function_in_the_doors_is_a_whole_subsystem():
    """Doors (jobs/, serve/, cli.py) are short conductors over classes: no function over 150 lines."""
    long = []
    for p in [*(PKG / "jobs").glob("*.py"), *(PKG / "serve").glob("*.py"), PKG / "cli.py"]:
        for n in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 150:
                long.append(f"{p.name}:{n.name} ({n.end_lineno - n.lineno + 1} lines)")
    assert long == []
