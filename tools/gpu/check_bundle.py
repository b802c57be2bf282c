#!/usr/bin/env python3
"""Local smoke check of a GPU bundle tree (no GPU, no CUDA imports needed).

Run after `tools/gpu/pack.sh --vllm X --tree-only` (or a full pack), which lays the
bundle's wheels out with `pip install --no-deps --target $WORK/tree/site`:

  python3 tools/gpu/check_bundle.py [--vllm 0.22.0] [--site DIR] [--vllm-src DIR]
        --kinds KINDS.md [--json OUT]

Two checks, each against "the device image (KINDS.md) + the bundle":

1. Requires-Dist closure. For every distribution in the bundle (vLLM first), each
   requirement whose marker holds on the device (CPython 3.12, Linux x86_64, no
   extras) must be met by a bundled distribution of a matching version, or by an
   image package (its version is checked where KINDS.md gives it). Requirements
   we knowingly leave out are listed under WAIVED with the reason; anything else
   unmet is a FAIL.

2. Imports. trace_imports.py walks vLLM's sources from the entry points speclab
   uses (offline LLM, `vllm serve`, EAGLE-3, DeepSeek-V4, quantization); every
   third-party module imported at module level ("hard"), or under an `if`
   ("cond"), must come from the bundle or the image, unless WAIVED.

Exit status 0 when nothing FAILs.
"""
from __future__ import annotations

import argparse
import email.parser
import json
import os
import re
import subprocess
import sys
import tempfile

try:
    from packaging.requirements import Requirement
    from packaging.version import Version
except ImportError:  # pip vendors it
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.version import Version

HERE = os.path.dirname(os.path.abspath(__file__))

# The device interpreter, for environment markers.
DEVICE_ENV = {
    "python_version": "3.12", "python_full_version": "3.12.3", "os_name": "posix",
    "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
    "platform_python_implementation": "CPython", "implementation_name": "cpython",
    "implementation_version": "3.12.3", "platform_release": "", "platform_version": "",
    "extra": "",
}

# Distributions of the image whose import name differs from the dist name.
IMPORT_NAMES = {
    "pillow": ["PIL"], "pyyaml": ["yaml"], "opencv-python-headless": ["cv2"],
    "py-cpuinfo": ["cpuinfo"], "protobuf": ["google"], "scikit-learn": ["sklearn"],
    "scikit-image": ["skimage"], "python-dateutil": ["dateutil"], "attrs": ["attr", "attrs"],
    "nvidia-ml-py": ["pynvml"], "cuda-bindings": ["cuda"], "cuda-core": ["cuda"],
    "cuda-pathfinder": ["cuda"], "hf-xet": ["hf_xet"], "opt-einsum": ["opt_einsum"],
    "typing-extensions": ["typing_extensions"], "huggingface-hub": ["huggingface_hub"],
    "ml-dtypes": ["ml_dtypes"], "jax-cuda13-plugin": ["jax_cuda13_plugin"],
    "tensorboard-data-server": ["tensorboard_data_server"],
    "pytorch-lightning": ["pytorch_lightning"],
    "lightning-utilities": ["lightning_utilities"],
    "sentence-transformers": ["sentence_transformers"],
    "torch-geometric": ["torch_geometric"], "nvidia-cudnn-cu13": ["nvidia"],
}

# Knowingly not carried. key: normalized dist name or top-level import name.
WAIVED = {
    # -- vLLM Requires-Dist --------------------------------------------------
    "flashinfer-python": "FlashInfer backend/sampler not used on our paths; set "
        "VLLM_USE_FLASHINFER_SAMPLER=0 (unpack.sh exports it). ~600 MB of cubins/JIT sources",
    "flashinfer-cubin": "see flashinfer-python",
    "flashinfer": "imported lazily or under has_flashinfer()/backend selection; "
        "VLLM_USE_FLASHINFER_SAMPLER=0",
    "tokenspeed-mla": "MLA prefill registry entry, not used by DeepSeek-V4 (seen on the device)",
    "fastsafetensors": "optional loader (load_format=fastsafetensors); try/except import",
    "nvidia-cudnn-frontend": "cuDNN attention backends only; not imported on our paths",
    "lm-format-enforcer": "structured-output backend lm-format-enforcer; LazyLoader, "
        "only if chosen (xgrammar/guidance are carried)",
    "outlines-core": "structured-output backend outlines; LazyLoader, only if chosen",
    "lark": "only used by the outlines backend / some tool parsers; not imported on our paths",
    "anthropic": "vLLM never imports the anthropic SDK: /v1/messages uses vLLM's own "
        "protocol classes (entrypoints/anthropic)",
    "mcp": "imported only by MCPToolServer (`vllm serve --tool-server URL`)",
    "opentelemetry-sdk": "tracing only (--otlp-traces-endpoint); try/except in vllm.tracing.otel",
    "opentelemetry-exporter-otlp": "see opentelemetry-sdk",
    "opentelemetry-semantic-conventions-ai": "see opentelemetry-sdk",
    "opentelemetry": "opentelemetry-api is carried; sdk/exporters only for tracing (try/except)",
    "python-json-logger": "only with a VLLM_LOGGING_CONFIG_PATH that names its formatter",
    "torch-c-dlpack-ext": "torch 2.11 has the DLPack C exchange API built in (tilelang, quack)",
    "supervisor": "model-hosting-container-standards' process supervisor; its sagemaker "
        "routes (what vLLM imports) never import it",
    "cuda-python": "metapackage; the image has its parts cuda-bindings, cuda-core, cuda-pathfinder",
    "nvidia-cutlass-dsl-libs-base": "files superseded by libs-cu13 (superset); dist-info carried",
    "z3-solver": "only libz3.so is carried, inside tilelang/lib (see pack.sh)",
    # -- extras of carried packages (requirement `pkg[extra]`), not carried ----
    "fastapi-cli": "fastapi[standard]: the `fastapi` CLI; vLLM does not import it",
    "fastar": "fastapi[standard]: fastapi-cloud tooling; not imported",
    "email-validator": "fastapi[standard]: pydantic EmailStr; vLLM defines no email fields",
    "pydantic-settings": "fastapi[standard]; not imported by vLLM",
    "opentelemetry-exporter-otlp-proto-http": "fastapi[standard] tracing; not imported",
    "httptools": "uvicorn[standard]: faster HTTP parser; uvicorn falls back to h11 (image)",
    "websockets": "uvicorn[standard]: websocket protocol; no websocket routes on our paths",
    "python-dotenv": "uvicorn[standard]: --env-file support; not used",
    "nvidia-cuda-cccl": "humming-kernels[cu13]: headers for humming's JIT; the image's "
        "/usr/local/cuda (nvcc 13.0) has CCCL; humming only runs for humming-quantized models",
    "nvidia-cuda-nvcc": "humming-kernels[cu13]: the image has nvcc 13.0 in /usr/local/cuda",
    # -- version conflicts with the image, tolerated (key: "dist: requirement") --
    "mistral-common: numpy": "mistral_common asks numpy<2.4 on py3.12; the image has 2.5.2. "
        "vLLM uses its tokenizer/protocol classes (pure Python) at import; NOT seen on the device",
    "xgrammar: transformers": "xgrammar 0.2.5.post1's metadata says transformers<5; it imports and "
        "runs with 5.17 (seen on the device, shared recipe)",
    # -- imports on other platforms / optional features --------------------------
    "deep_ep": "under has_deep_ep() (expert-parallel all2all)",
    "mori": "under has_mori() (ROCm)", "nixl_ep": "under has_nixl_ep()",
    "vllm_xpu_kernels": "Intel XPU only", "vllm_omni": "`vllm --omni` only",
    "modelscope": "only with VLLM_USE_MODELSCOPE=1", "ray": "only with Ray executor",
    "torchao": "torchao quantization only (module imported under `if`)",
    "humming-kernels[cu13]": ("humming-kernels is carried; the cu13 extra's kernels JIT with the "
                              "image's CUDA"),
    # -- vLLM 0.26.0 --------------------------------------------------------------
    "nvidia-cutlass-dsl-libs-cu12": "cutlass-dsl 4.6.0 loads the flavour the driver supports "
        "(CUDA 13 on the device: libs-cu13, carried); dist-info carried",
    "nvidia-cuda-nvdisasm": "cutlass-dsl libs 4.6.0 metadata only: no file of cutlass-dsl "
        "4.6.0 names nvdisasm; the image has it in /usr/local/cuda/bin",
    "torchcodec": "video decoding for multimodal inputs (try/except and function-level imports)",
    "pynvvideocodec": "NVIDIA video decoding for multimodal inputs (function-level import)",
    "nvtx": "only vllm/v1/utils.py's NVTX profiling range (function-level import)",
}

# The tree pack.sh lays out for each release.
SITES = {
    "0.22.0": "/tmp/speclab_gpu_pack/tree/site",
    "0.26.0": "/tmp/speclab_gpu_pack026/tree/site",
}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def kinds_image(path: str) -> tuple[set[str], dict[str, str]]:
    """Package names (normalized) and known versions of the device image, from KINDS.md."""
    text = open(path, encoding="utf-8").read()
    m = re.search(r"## Python packages already there.*?Packages: (.*?)\.\s*$", text, re.S | re.M)
    names = {norm(x.strip()) for x in m.group(1).split(",")} if m else set()
    versions = {}
    m = re.search(r"\| pip list, as a session saw it \|(.*?)\|\n", text)
    if m:
        for name, ver in re.findall(r"([A-Za-z0-9_.\-]+) (\d[\w.+]*)",
                                    m.group(1).split("names it asked for:")[-1]):
            versions[norm(name)] = ver
    return names, versions


def bundle_dists(site: str) -> dict[str, dict]:
    out = {}
    for d in sorted(os.listdir(site)):
        if not d.endswith(".dist-info"):
            continue
        meta = email.parser.Parser().parse(open(os.path.join(site, d, "METADATA"),
                                                encoding="utf-8"))
        out[norm(meta["Name"])] = {
            "version": meta["Version"],
            "requires": meta.get_all("Requires-Dist") or [],
        }
    return out


def bundle_modules(site: str) -> set[str]:
    mods = set()
    for e in os.listdir(site):
        p = os.path.join(site, e)
        if e.endswith((".dist-info", ".libs")) or e in ("bin", "__pycache__"):
            continue
        if os.path.isdir(p):
            mods.add(e)
        elif e.endswith(".py") or ".so" in e:
            mods.add(e.split(".")[0])
    # .pth-added dirs: a path line (cutlass-dsl 4.5: nvidia_cutlass_dsl/python_packages),
    # or an import line that joins a quoted folder name onto a package in the site
    # (4.6: os.path.join(nvidia_cutlass_dsl.__path__[0], 'dsl_packages'))
    for e in os.listdir(site):
        if not e.endswith(".pth"):
            continue
        for line in open(os.path.join(site, e)):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("import"):
                dirs = [os.path.join(site, pkg, sub)
                        for pkg in re.findall(r"import [\w, ]*?(\w+);", line)
                        for sub in re.findall(r"['\"]([\w.-]+)['\"]", line)]
            else:
                dirs = [os.path.join(site, line)]
            for d in filter(os.path.isdir, dirs):
                mods |= {x.split(".")[0] for x in os.listdir(d)}
    return mods


def active_requirements(requires: list[str], extras=()):
    """Requirements whose marker holds on the device; with extras, only those the
    extras add (marker true with extra=X, false without)."""
    out = []
    for raw in requires:
        r = Requirement(raw)
        base = r.marker is None or r.marker.evaluate(DEVICE_ENV)
        if not extras:
            if base:
                out.append(r)
        elif not base and any(r.marker.evaluate({**DEVICE_ENV, "extra": x}) for x in extras):
            out.append(r)
    return out


def check_requires(site: str, image: set[str], image_ver: dict[str, str]):
    dists = bundle_dists(site)
    rows = []
    todo = [(d, info["requires"], ()) for d, info in
            sorted(dists.items(), key=lambda kv: (kv[0] != "vllm", kv[0]))]
    done_extras = set()
    while todo:
        dname, requires, extras = todo.pop(0)
        for r in active_requirements(requires, extras):
            n = norm(r.name)
            spec = str(r.specifier)
            label = f"{r.name}{'[' + ','.join(sorted(r.extras)) + ']' if r.extras else ''}{spec}"
            if n in dists:
                v = dists[n]["version"]
                ok = not spec or r.specifier.contains(v, prereleases=True)
                status = ("ok", f"bundle {v}") if ok else ("FAIL", f"bundle has {v}")
            elif n in image:
                v = image_ver.get(n)
                if v is None:
                    status = ("ok?", "image (version not listed in KINDS.md)")
                elif not spec or r.specifier.contains(Version(v.split("+")[0]), prereleases=True):
                    status = ("ok", f"image {v}")
                else:
                    status = ("FAIL", f"image has {v}")
            else:
                status = ("FAIL", "missing")
            if status[0] == "FAIL":
                for key in (f"{dname}: {n}", n):
                    if key in WAIVED:
                        status = ("WAIVED", WAIVED[key])
                        break
            # `pkg[extra]`: check what the extra adds, once per (pkg, extra)
            if r.extras and n in dists and (n, tuple(sorted(r.extras))) not in done_extras:
                done_extras.add((n, tuple(sorted(r.extras))))
                todo.append((f"{n}[{','.join(sorted(r.extras))}]", dists[n]["requires"],
                             tuple(sorted(r.extras))))
            rows.append((dname + (" (via extras)" if extras else ""), label, *status))
    return dists, rows


def check_imports(trace: dict, site_mods: set[str], image: set[str]):
    image_mods = set()
    for n in image:
        image_mods |= set(IMPORT_NAMES.get(n, [n.replace("-", "_")]))
    rows = []
    order = ["hard", "cond", "optional", "lazy"]
    for top, kinds in sorted(trace["third_party"].items()):
        best = min(kinds, key=order.index)
        if best in ("optional", "lazy"):
            continue
        where = "bundle" if top in site_mods else "image" if top in image_mods else None
        if where:
            status = ("ok", where)
        elif top in WAIVED:
            status = ("WAIVED", WAIVED[top])
        else:
            status = ("FAIL", "not in bundle or image")
        chain = " <- ".join(reversed(trace["chains"].get(top, [])))
        rows.append((top, best, *status, chain))
    return rows


def main():
    ap = argparse.ArgumentParser(description="smoke-check the speclab GPU bundle tree")
    ap.add_argument("--vllm", default="0.22.0", choices=sorted(SITES),
                    help="which bundle's tree to check")
    ap.add_argument("--site", help="the laid-out tree (default: pack.sh's for --vllm)")
    ap.add_argument("--vllm-src", help="vllm package dir to trace (default: SITE/vllm)")
    ap.add_argument("--kinds", required=True, help="the device machine's description "
                    "(KINDS.md of the device tool): its image's package list")
    ap.add_argument("--json", help="write all rows here")
    a = ap.parse_args()

    site = a.site or SITES[a.vllm]
    if not os.path.isdir(os.path.join(site, "vllm")):
        sys.exit(f"no vllm/ in {site}: run tools/gpu/pack.sh --vllm {a.vllm} --tree-only first")
    image, image_ver = kinds_image(a.kinds)
    if not image:
        sys.exit(f"no package list found in {a.kinds}")
    dists, req_rows = check_requires(site, image, image_ver)
    if dists.get("vllm", {}).get("version") != a.vllm:
        sys.exit(f"{site} holds vLLM {dists.get('vllm', {}).get('version')}, not {a.vllm}")
    vsrc = a.vllm_src or os.path.join(site, "vllm")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, os.path.join(HERE, "trace_imports.py"), vsrc,
                        "--json", f"{tmp}/trace.json"], check=True, capture_output=True)
        trace = json.load(open(f"{tmp}/trace.json"))
    imp_rows = check_imports(trace, bundle_modules(site), image)

    print(f"bundle: vLLM {a.vllm}, {len(dists)} distributions; image: {len(image)} packages "
          f"({len(image_ver)} with versions)")
    print("\n## Requires-Dist (markers for CPython 3.12 / Linux x86_64)")
    for dname, label, st, why in req_rows:
        if st != "ok" or dname == "vllm":
            print(f"  {st:6s} {dname:34s} {label:48s} {why}")
    print("\n## Third-party imports on speclab's vLLM paths (hard/cond)")
    for top, kind, st, why, chain in imp_rows:
        if st != "ok":
            print(f"  {st:6s} {top:28s} {kind:5s} {why}\n         via {chain[:160]}")
    n_ok = sum(1 for r in imp_rows if r[2] == "ok")
    print(f"  ok: {n_ok} modules ({', '.join(sorted(r[0] for r in imp_rows if r[2] == 'ok'))})")
    fails = [r for r in req_rows if r[2] == "FAIL"] + [r for r in imp_rows if r[2] == "FAIL"]
    if a.json:
        json.dump({"requires": req_rows, "imports": imp_rows}, open(a.json, "w"), indent=1)
    print(f"\n{len(fails)} FAIL, "
          f"{sum(1 for r in req_rows + imp_rows if r[2] == 'WAIVED')} WAIVED")
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
