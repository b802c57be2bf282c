"""The package's structure (docs/architecture.md): no import cycle among its modules, counting
imports inside functions, and one module that starts or kills processes."""

import ast
from pathlib import Path

import speclab

PKG = Path(speclab.__file__).parent


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text())
    return out


def _imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    pkg = name if name in {"speclab", "speclab.fixtures"} else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                      for a in node.names}
    return {m for m in found if m in known and m != name and m != "speclab"}


def test_no_import_cycle():
    mods = _modules()
    graph = {m: _imports(m, t, set(mods)) for m, t in mods.items()}
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(m):] + [m]))
        if m in done:
            return
        for n in sorted(graph[m]):
            visit(n, path + [m])
        done.add(m)

    for m in sorted(graph):
        visit(m, [])
    assert graph["speclab.store"] and graph["speclab.cli"], "the graph is empty: parse broke"


def test_only_launch_starts_or_kills_processes():
    calls = {}
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                what = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                if what in {"Popen", "killpg", "prctl", "_PRCTL"}:
                    calls.setdefault(name, set()).add(what)
    assert set(calls) == {"speclab.launch"}, calls


def _layers() -> dict[str, int]:
    """Module -> its row in docs/architecture.md's layer table (0: leaves)."""
    rows = [line.split("|")[2] for line in
            (PKG.parents[1] / "docs" / "architecture.md").read_text().splitlines()
            if line.startswith("| ") and line.count("|") >= 4 and "`" in line.split("|")[2]]
    out = {}
    for i, cell in enumerate(rows):
        for name in cell.split("`")[1::2]:
            out["speclab." + name.rstrip("/")] = i
    return out


def test_imports_run_down_the_layer_table():
    layer = _layers()
    mods = _modules()
    listed = {m for m in mods if m.count(".") == 1 or m == "speclab.fixtures"}
    assert listed - {"speclab.__main__"} <= set(layer), "a module missing from the table"
    against = []
    for m, tree in mods.items():
        src = m if m in layer else "speclab.fixtures" if m.startswith("speclab.fixtures") else None
        for n in _imports(m, tree, set(mods)):
            dst = "speclab.fixtures" if n.startswith("speclab.fixtures") else n
            if src in layer and dst in layer and layer[dst] > layer[src]:
                against.append(f"{m} -> {n}")
    assert not against, against
