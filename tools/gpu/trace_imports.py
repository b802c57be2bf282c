#!/usr/bin/env python3
"""Static import trace of vLLM: which third-party modules does a code path import?

We cannot import vLLM's CUDA build on the CPU machine, so we read the sources
instead. Starting from a few root modules, we follow `import vllm...` statements
through the vLLM package and record every third-party top-level module we meet,
classified by how it is imported (the weakest link on the best path from a
root decides):

  hard      at module level, unconditionally: importing the root fails without it
  cond      at module level under an `if` (e.g. `if has_deep_ep():`,
            `if current_platform.is_cuda():`) or in an `except` branch: review
  optional  at module level inside `try:`, or via vLLM's LazyLoader: a missing
            package is tolerated at import time
  lazy      inside a function: only needed when that function runs

vLLM-internal imports are followed at module level (hard, cond, optional). For
the root modules themselves, function-level vLLM imports are followed too, one
level deep and counted as `cond`, because `vllm serve` wires its routers up
inside functions (cli main(), build_app, init_app_state). `if TYPE_CHECKING:`
blocks are skipped.

It under-approximates dynamic imports (importlib.import_module of registries,
e.g. model classes, tool and reasoning parsers): list those modules as roots.
The result is a list to review; check_bundle.py maps it to packages.

Usage: trace_imports.py VLLM_PKG_DIR [--roots a.b,c.d] [--json OUT]
   or: trace_imports.py SITE/mistral_common --roots mistral_common.x,... --deep ""
       (any package: its own imports are the "internal" ones)
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import sys
from collections import defaultdict

# Root modules of the code paths speclab uses (offline LLM, `vllm serve`,
# EAGLE-3, DeepSeek-V4 with FP8, FlashMLA, FA3, Triton attention).
DEFAULT_ROOTS = [
    "vllm",
    "vllm.entrypoints.llm",
    # `vllm serve`: console script -> cli.main.main(), which imports these
    "vllm.entrypoints.cli.main",
    "vllm.entrypoints.cli.serve",
    "vllm.entrypoints.cli.openai",
    "vllm.entrypoints.cli.launch",
    "vllm.entrypoints.cli.collect_env",
    "vllm.entrypoints.cli.run_batch",
    "vllm.entrypoints.cli.benchmark.main",
    "vllm.entrypoints.openai.api_server",
    "vllm.entrypoints.launcher",
    "vllm.entrypoints.serve",
    # engine core, workers, spec decode
    "vllm.v1.engine.core",
    "vllm.v1.engine.core_client",
    "vllm.v1.engine.async_llm",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.spec_decode.eagle",
    "vllm.v1.spec_decode.llm_base_proposer",
    "vllm.v1.structured_output",
    "vllm.v1.structured_output.backend_xgrammar",
    "vllm.v1.structured_output.backend_guidance",
    "vllm.v1.sample.sampler",
    "vllm.platforms.cuda",
    # models
    "vllm.model_executor.models.llama",
    "vllm.model_executor.models.llama_eagle3",
    "vllm.models.deepseek_v4",
    "vllm.models.deepseek_v4.compressor",
    "vllm.models.deepseek_v4.nvidia.ops.sparse_attn_compress_cutedsl",
    # every quantization method is imported by get_quantization_config()
    "vllm.model_executor.layers.quantization",
    "vllm.model_executor.layers.quantization.fp8",
    "vllm.model_executor.layers.fused_moe",
    # attention backends used on Hopper by these models
    "vllm.v1.attention.backends.flash_attn",
    "vllm.v1.attention.backends.triton_attn",
    "vllm.v1.attention.backends.mla.flashmla",
    "vllm.v1.attention.backends.mla.flashmla_sparse",
    "vllm.model_executor.model_loader",
]

# `vllm serve` attaches its routers and serving classes inside functions that
# run at start-up (build_app, init_app_state, register_*_api_routers): follow
# function-level vLLM imports under these prefixes as if they were module level.
DEEP_PREFIXES = [
    "vllm.entrypoints.cli",
    "vllm.entrypoints.openai",
    "vllm.entrypoints.serve",
    "vllm.entrypoints.anthropic",
    "vllm.entrypoints.sagemaker",
]


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


# Import kinds, from "surely needed" to "maybe needed". A module's kind is
# the weakest link on its best path from a root.
HARD, COND, OPTIONAL, LAZY = range(4)
KIND_NAMES = ["hard", "cond", "optional", "lazy"]


class Tracer:
    def __init__(self, pkg_dir: str):
        self.root = os.path.dirname(os.path.abspath(pkg_dir))  # dir holding the package
        self.pkg = os.path.basename(os.path.abspath(pkg_dir))  # e.g. "vllm"
        self.level: dict[str, int] = {}  # vllm module -> best reach kind
        self.parent: dict[str, str] = {}  # vllm module -> who imported it (best path)
        # third-party top-level name -> best kind, and (module, kind) pairs importing it
        self.third: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
        self.stdlib = set(sys.stdlib_module_names)
        self._scans: dict[str, list[tuple[str, int]]] = {}

    # -- module resolution -------------------------------------------------
    def path_of(self, mod: str) -> str | None:
        base = os.path.join(self.root, *mod.split("."))
        for p in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(p):
                return p
        if os.path.isdir(base):  # namespace package
            return base
        return None

    def is_pkg(self, mod: str) -> bool:
        p = self.path_of(mod)
        return bool(p) and (p.endswith("__init__.py") or os.path.isdir(p))

    def resolve_from(self, mod: str, node: ast.ImportFrom) -> list[str]:
        """Absolute module names an ImportFrom statement may load."""
        if node.level:
            parts = mod.split(".")
            if not self.is_pkg(mod):
                parts = parts[:-1]
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join(parts + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        out = [base]
        for alias in node.names:  # `from pkg import submodule`
            cand = f"{base}.{alias.name}"
            if base.split(".")[0] == self.pkg and self.path_of(cand):
                out.append(cand)
        return out

    # -- scanning one file -------------------------------------------------
    def scan(self, mod: str) -> list[tuple[str, int]]:
        """(imported module name, kind) for every import statement in mod."""
        if mod in self._scans:
            return self._scans[mod]
        out: list[tuple[str, int]] = []
        path = self.path_of(mod)
        if path is None or os.path.isdir(path):
            self._scans[mod] = out
            return out
        tree = ast.parse(open(path, encoding="utf-8").read(), path)

        def visit(nodes, kind):
            for n in nodes:
                if isinstance(n, ast.Import):
                    out.extend((a.name, kind) for a in n.names)
                elif isinstance(n, ast.ImportFrom):
                    out.extend((name, kind) for name in self.resolve_from(mod, n))
                elif isinstance(n, ast.If):
                    if is_type_checking(n.test):
                        visit(n.orelse, kind)
                    else:
                        visit(n.body, max(kind, COND))
                        visit(n.orelse, max(kind, COND))
                elif isinstance(n, ast.Try):
                    visit(n.body, max(kind, OPTIONAL))
                    for h in n.handlers:
                        visit(h.body, max(kind, COND))
                    visit(n.orelse, max(kind, OPTIONAL))
                    visit(n.finalbody, kind)
                elif isinstance(n, (ast.With, ast.AsyncWith, ast.ClassDef)):
                    visit(n.body, kind)
                elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    visit(n.body, LAZY)
                elif isinstance(n, (ast.For, ast.While)):
                    visit(n.body, max(kind, COND))
                    visit(n.orelse, max(kind, COND))
                # vLLM's LazyLoader("name", globals(), "pkg.mod"): optional
                if isinstance(n, (ast.Assign, ast.Expr)):
                    for c in ast.walk(n):
                        if (isinstance(c, ast.Call) and getattr(c.func, "id", "") == "LazyLoader"
                                and len(c.args) >= 3 and isinstance(c.args[2], ast.Constant)):
                            out.append((str(c.args[2].value), max(kind, OPTIONAL)))

        visit(tree.body, HARD)
        self._scans[mod] = out
        return out

    # -- the walk ------------------------------------------------------------
    def run(self, roots: list[str], deep: tuple[str, ...] = ()) -> list[str]:
        """deep: module-name prefixes whose function-level vLLM imports are
        followed like a root's (the API server builds its app in functions)."""
        missing = [r for r in roots if not self.path_of(r)]
        todo = [(r, HARD, "<root>") for r in roots if self.path_of(r)]
        root_set = set(roots)
        while todo:  # relax until no module gets a better (lower) kind
            mod, lvl, par = todo.pop()
            if self.level.get(mod, 99) <= lvl:
                continue
            self.level[mod] = lvl
            self.parent[mod] = par
            for name, kind in self.scan(mod):
                top = name.split(".")[0]
                if not top or top in self.stdlib or top == "__future__":
                    continue
                if kind == LAZY and (mod in root_set or mod.startswith(deep)):
                    kind = COND  # an entry point's functions run: follow them
                eff = max(lvl, kind)
                if top != self.pkg:
                    continue
                if eff == LAZY:
                    continue  # lazy vLLM imports of non-roots are not followed
                parts = name.split(".")
                for i in range(1, len(parts) + 1):  # a.b.c imports a and a.b too
                    sub = ".".join(parts[:i])
                    if self.path_of(sub):
                        todo.append((sub, eff, mod))
        # third-party imports of every visited module, with their effective kind
        for mod, lvl in self.level.items():
            for name, kind in self.scan(mod):
                top = name.split(".")[0]
                if not top or top in self.stdlib or top in ("__future__", self.pkg):
                    continue
                if kind == LAZY and mod in root_set:
                    kind = COND
                self.third[top][KIND_NAMES[max(lvl, kind)]].add(mod)
        return missing

    def chain(self, mod: str) -> list[str]:
        out = [mod]
        while self.parent.get(out[-1], "<root>") != "<root>":
            out.append(self.parent[out[-1]])
        return out[::-1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pkg_dir", help="path to the package directory (vllm/, or another one)")
    ap.add_argument("--roots", help="comma-separated root modules (default: speclab's set)")
    ap.add_argument("--deep", default=",".join(DEEP_PREFIXES),
                    help="module prefixes whose function-level vLLM imports are followed")
    ap.add_argument("--json", help="write the result as JSON here")
    a = ap.parse_args()
    roots = a.roots.split(",") if a.roots else DEFAULT_ROOTS
    t = Tracer(a.pkg_dir)
    missing = t.run(roots, tuple(x for x in a.deep.split(",") if x))
    res = {
        "roots": roots,
        "roots_not_found": missing,
        "modules_visited": len(t.level),
        "third_party": {
            top: {k: sorted(v) for k, v in kinds.items()} for top, kinds in sorted(t.third.items())
        },
        # best import chain (root first) to the first module of each package's strongest kind
        "chains": {
            top: t.chain(min(kinds[min(kinds, key=KIND_NAMES.index)]))
            for top, kinds in sorted(t.third.items())
        },
    }
    if a.json:
        json.dump(res, open(a.json, "w"), indent=1)
    print(f"visited {len(t.level)} {t.pkg} modules; roots not found: {missing or 'none'}")
    for top, kinds in res["third_party"].items():
        desc = ", ".join(f"{k}:{len(kinds[k])}" for k in KIND_NAMES if k in kinds)
        print(f"  {top:32s} {desc}")


if __name__ == "__main__":
    main()
