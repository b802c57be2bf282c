"""The package's structure (docs/architecture.md): no import cycle among its modules, counting
imports inside functions, one module that starts or kills processes and one that writes
into run folders."""

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


WRITERS = {
    "speclab.store": "the run folder's one owner (and its atomic write, for every other file)",
    "speclab.launch": "a child process's output log: the handle the child writes to",
    "speclab.server": "`vllm serve`'s output log, handed to launch.child",
    "speclab.gpubench": "the device-side driver's state folder and its workers' logs",
    "speclab.benchworker": "a timing worker's answers, on the pipe the driver hands it",
    "speclab.mhcwarm": "a warm-up process's log in the driver's state folder",
    "speclab.steptiming": "runs inside vLLM's engine process: its own timing folder",
    "speclab.overlay": "the .pth it installs into a site directory",
    "speclab.vllm_plugins": "the dist-info it writes into a site directory",
    "speclab.vllm_matrix": "the docs it renders (README block, matrix files)",
}
"""Modules that write files other than through `store`, and what they write: none is a run
folder. `speclab.fixtures.*` build checkpoints in the fixture cache."""


def _file_writes(tree: ast.Module) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        what = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        if what in {"write_text", "write_bytes"}:
            out.append(what)
        elif what in {"to_parquet", "to_csv", "to_json"} and (node.args or any(
                k.arg in {"path", "path_or_buf"} for k in node.keywords)):
            out.append(what)  # without a path these return the text
        elif what == "savefig" and not (node.args and getattr(node.args[0], "id", "") == "buf"):
            out.append(what)  # a figure saved into a file, not into a buffer
        elif what in {"open", "fdopen"}:
            modes = [a.value for a in node.args[1:2] + [k.value for k in node.keywords
                                                      if k.arg == "mode"]
                     if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if any(set(m) & set("wax+") for m in modes):
                out.append(f"{what}({modes[0]!r})")
    return out


def test_only_the_store_writes_into_run_folders():
    """Every file write outside the listed modules goes through `store` (a run folder's
    tables, reports and figures included); the check sees writes the listed modules make."""
    writes = {name: w for name, tree in _modules().items() if (w := _file_writes(tree))}
    assert "speclab.store" in writes and "speclab.launch" in writes  # the scan sees writes
    others = {n: w for n, w in writes.items()
              if n not in WRITERS and not n.startswith("speclab.fixtures")}
    assert not others, others
    assert set(WRITERS) <= set(writes), set(WRITERS) - set(writes)  # no stale entry
