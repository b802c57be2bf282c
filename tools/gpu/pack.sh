#!/usr/bin/env bash
# Build speclab's vLLM 0.22.0 bundle for the offline H200 device, on the CPU machine.
#
# What it makes: .stage/gpu/p1, p2, ... (one folder per part, each with the
# part file `part` and a copy of MANIFEST), plus .stage/gpu/MANIFEST. Each part
# is at most 45 MiB so that one device call can carry it next to the working
# tree (64 MiB per call in all). tools/gpu/unpack.sh puts them back together.
#
# What is in the bundle: tools/gpu/requirements-vllm022.txt (vLLM 0.22.0 + what
# the device image lacks for the offline engine, EAGLE-3, DeepSeek-V4 with the
# stock CuTe-DSL compressor, and `vllm serve`), laid out as one site directory
# `site/` with our sitecustomize.py (turns it into a real site dir, so .pth
# files in it work) and a `bin/vllm` launcher. See tools/gpu/README.md.
#
# Usage: tools/gpu/pack.sh [--out DIR] [--arch 90] [--part-mib 45] [--tree-only]
#   --out DIR     where the parts go (default: <repo>/.stage/gpu)
#   --arch N      GPU arch whose code is kept in vLLM's fat binaries (90 = H100/H200)
#   --part-mib N  part size limit in MiB (default 45)
#   --tree-only   stop after laying out and pruning the tree (for check_bundle.py)
# Env: WORK (default /tmp/speclab_gpu_pack): wheel cache ($WORK/whl, reused) and
#      the tree ($WORK/tree/site). VLLM_WHEEL_DIR (default /tmp/wheels/v22): a
#      folder that may already hold the vLLM wheel (copied instead of downloaded).
#      XZ_THREADS (default 2).
# Needs: pip (reaches PyPI), python3, xz, tar, strip, sha256sum, split.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
OUT=$REPO/.stage/gpu
ARCH=90
PART_MIB=45
TREE_ONLY=0
while [ $# -gt 0 ]; do
  case $1 in
    --out) OUT=$2; shift 2 ;;
    --arch) ARCH=$2; shift 2 ;;
    --part-mib) PART_MIB=$2; shift 2 ;;
    --tree-only) TREE_ONLY=1; shift ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "unknown option: $1" >&2; exit 2 ;;
  esac
done
WORK=${WORK:-/tmp/speclab_gpu_pack}
VLLM_WHEEL_DIR=${VLLM_WHEEL_DIR:-/tmp/wheels/v22}
XZ_THREADS=${XZ_THREADS:-2}
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore
REQS=$HERE/requirements-vllm022.txt
T0=$(date +%s)
step() { echo "== [$(( $(date +%s) - T0 ))s] $*"; }

# ---------------------------------------------------------------------------
step "1/6 wheels -> $WORK/whl (cached)"
mkdir -p "$WORK/whl"
grep -Ev '^\s*(#|$)' "$REQS" | sed 's/\s*#.*//' > "$WORK/reqs.txt"
# The vLLM wheel is 250 MB: reuse a copy already on this machine.
for f in "$VLLM_WHEEL_DIR"/vllm-0.22.0-*.whl; do
  [ -f "$f" ] && [ ! -f "$WORK/whl/$(basename "$f")" ] && cp "$f" "$WORK/whl/"
done
# The device: CPython 3.12, glibc 2.39, x86_64. pip picks cp312/abi3 wheels
# for it without running anything.
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
      --abi cp312 --abi abi3 --abi none)
for n in 39 35 34 31 28 27 26 24 17 12 5; do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done
PLAT+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# Ask pip only for wheels not yet in the cache (pip download re-checks the index otherwise).
"$PY" - "$WORK" <<'EOF' > "$WORK/to_download.txt"
import os, re, sys
work = sys.argv[1]
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
have = {(norm(f.split("-")[0]), f.split("-")[1]) for f in os.listdir(f"{work}/whl") if f.endswith(".whl")}
for line in open(f"{work}/reqs.txt"):
    name, ver = line.strip().split("==")
    if (norm(name), ver) not in have:
        print(line.strip())
EOF
if [ -s "$WORK/to_download.txt" ]; then
  "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$WORK/whl" -r "$WORK/to_download.txt"
fi
# Exactly one wheel per pinned requirement (a stale extra one would be installed too).
"$PY" - "$WORK" <<'EOF'
import os, re, sys
work = sys.argv[1]
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
want = {}
for line in open(f"{work}/reqs.txt"):
    name, ver = line.strip().split("==")
    want[norm(name)] = ver
picked = {}
for f in sorted(os.listdir(f"{work}/whl")):
    n, v = norm(f.split("-")[0]), f.split("-")[1]
    if f.endswith(".whl") and want.get(n) == v:
        picked[n] = f
missing = sorted(set(want) - set(picked))
if missing:
    sys.exit(f"missing wheels: {missing}")
with open(f"{work}/wheels.txt", "w") as fh:
    for n, f in sorted(picked.items()):
        fh.write(f"{n} {work}/whl/{f}\n")
print(f"{len(picked)} wheels")
EOF

# ---------------------------------------------------------------------------
step "2/6 install into $WORK/tree/site"
S=$WORK/tree/site
rm -rf "$WORK/tree"
mkdir -p "$S"
# nvidia-cutlass-dsl-libs-cu13 ships every file of libs-base (same paths, cu13
# builds) plus a few more; installing both would let the install order decide
# which binary wins. So: libs-cu13 in full, and only the dist-info of libs-base
# (keeps the metadata complete for nvidia-cutlass-dsl's requirement).
grep -v '^nvidia-cutlass-dsl-libs-base ' "$WORK/wheels.txt" | cut -d' ' -f2 > "$WORK/install.txt"
xargs -a "$WORK/install.txt" "$PY" -m pip install -q --no-deps --no-compile --no-index \
  "${PLAT[@]}" --target "$S"
"$PY" - "$S" "$(grep '^nvidia-cutlass-dsl-libs-base ' "$WORK/wheels.txt" | cut -d' ' -f2)" <<'EOF'
import sys, zipfile
site, whl = sys.argv[1:]
with zipfile.ZipFile(whl) as z:
    names = [n for n in z.namelist() if n.split("/")[0].endswith(".dist-info")]
    z.extractall(site, names)
print(f"libs-base: extracted {len(names)} dist-info files only")
EOF
du -sh "$S"

# ---------------------------------------------------------------------------
step "3/6 prune"
# Console scripts: their shebangs point at this machine's python. We ship our own bin/vllm.
rm -rf "$S/bin"
# vLLM: the Rust API-server frontend (not used by `vllm serve`'s Python server),
# DeepGEMM's extension for other Pythons, and FA2 (Hopper runs FA3; FA2 only
# matters for ALiBi and similar, and for pre-Hopper GPUs).
rm -rf "$S/vllm/vllm-rs"
rm -f "$S"/vllm/third_party/deep_gemm/_C.cpython-3{10,11,13,14}-*.so
rm -f "$S/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"
# xgrammar: a 70 MB static library used only to build against it.
rm -rf "$S/xgrammar/lib"
# TileLang: AMD Composable Kernel headers and TVM's C++ sources are not used by
# its CUDA JIT (which needs tl_templates, cutlass/cute headers and tvm python).
rm -rf "$S/tilelang/3rdparty/composable_kernel" "$S/tilelang/3rdparty/tvm/src"
# z3-solver: keep only libz3.so, in tilelang/lib (libtvm.so NEEDs it; RUNPATH
# $ORIGIN). No z3/ folder may stay: torch's dynamo does `import z3` in a try
# block, and a half z3/ imports as a namespace package and then breaks
# ("module 'z3' has no attribute 'ExprRef'", seen on the device).
mv "$S/z3/lib/libz3.so" "$S/tilelang/lib/libz3.so"
rm -rf "$S/z3" "$S"/z3_solver-*.dist-info
# pycountry: gettext translations of country/language names (~30 MB); the
# databases that pydantic-extra-types reads stay.
rm -rf "$S/pycountry/locales"
# mistral_common: its bundled test tokenizers (MistralTokenizer.v1()..v7(),
# 36 MB); vLLM imports mistral_common for its classes only and reads a Mistral
# model's tokenizer from the model folder.
rm -rf "$S/mistral_common/data"
find "$S" -name __pycache__ -prune -exec rm -rf {} +
# Debug info (not symbols) of binaries outside vLLM (xgrammar carries ~50 MB).
# vLLM's own files are handled by prune_fatbin; cutlass-dsl's are already stripped.
find "$S" -name '*.so*' -type f ! -path "$S/vllm/*" ! -path "$S/nvidia_cutlass_dsl/*" \
  -exec strip --strip-debug {} + 2>/dev/null || true
# GPU code for other archs, in every fat binary (sm_$ARCH SASS, else PTX).
find "$S" -name '*.so*' -type f ! -path "$S/nvidia_cutlass_dsl/*" -print0 \
  | xargs -0 "$PY" "$HERE/prune_fatbin.py" "$ARCH" | tail -n 1

# ---------------------------------------------------------------------------
step "4/6 add speclab files"
cp "$HERE/sitecustomize.py" "$S/sitecustomize.py"
mkdir -p "$S/bin"
cat > "$S/bin/vllm" <<'EOF'
#!/usr/bin/env bash
# vLLM's console script, for the speclab bundle (PYTHONPATH must hold this site dir).
exec "${PYTHON:-python3}" -c 'import sys; from vllm.entrypoints.cli.main import main; sys.argv[0] = "vllm"; sys.exit(main())' "$@"
EOF
chmod +x "$S/bin/vllm"
# Identical files (e.g. CUTLASS headers in DeepGEMM and TileLang) become hard
# links: tar stores the second copy as a link; both are real files again on
# extraction.
"$PY" - "$S" <<'EOF'
import hashlib, os, sys
site, seen, saved, n = sys.argv[1], {}, 0, 0
for root, dirs, files in os.walk(site):
    dirs.sort()
    for f in sorted(files):
        p = os.path.join(root, f)
        if os.path.islink(p) or os.path.getsize(p) < 1024:
            continue
        h = hashlib.sha256(open(p, "rb").read()).hexdigest()
        if h in seen:
            os.unlink(p); os.link(seen[h], p)
            saved += os.path.getsize(p); n += 1
        else:
            seen[h] = p
print(f"hard-linked {n} duplicate files ({saved / 2**20:.1f} MiB)")
EOF
du -sh "$S"
if [ "$TREE_ONLY" = 1 ]; then step "tree ready: $S (--tree-only)"; exit 0; fi

# ---------------------------------------------------------------------------
step "5/6 tar | xz --x86 -9e (threads: $XZ_THREADS)"
rm -rf "$WORK/out"
mkdir -p "$WORK/out"
# Member order: all directories, then files grouped by kind (ELF binaries,
# then text by extension, then the rest), so that similar bytes sit close
# together in the xz window. Deterministic: fixed owner and mtime.
(cd "$WORK/tree" && "$PY" - > "$WORK/out/members.txt") <<'EOF'
import os
dirs, files = [], []
for root, ds, fs in os.walk("site"):
    dirs.append(root)
    files += [os.path.join(root, f) for f in fs]
def kind(p):
    name = os.path.basename(p)
    ext = name.rsplit(".", 1)[-1] if "." in name else ""
    if ".so" in name or ext in ("a", "o"):
        return (0, "")  # ELF binaries (host x86 code + CUDA fat binaries)
    if ext in ("py", "pyi", "h", "hpp", "cuh", "cu", "c", "cc", "cpp", "inl", "txt",
               "md", "json", "toml", "cfg", "jinja", "typed", "pth"):
        return (1, ext)  # text, grouped by extension
    return (2, ext)
for d in sorted(dirs):
    print(d)
for f in sorted(files, key=lambda p: (kind(p), p)):
    print(f)
EOF
# xz: BCJ x86 filter in front of LZMA2 preset 9e (measured here: -3% on x86
# code, +1.4% on CUDA SASS, neutral on text; a net gain for this mix).
tar -C "$WORK/tree" --no-recursion -T "$WORK/out/members.txt" --owner=0 --group=0 \
    --numeric-owner --mtime='2026-01-01 00:00:00' -cf - \
  | xz --x86 --lzma2=preset=9e -T"$XZ_THREADS" --memlimit-compress=12GiB \
  > "$WORK/out/bundle.tar.xz"
BYTES=$(stat -c %s "$WORK/out/bundle.tar.xz")
SHA=$(sha256sum "$WORK/out/bundle.tar.xz" | cut -d' ' -f1)
echo "bundle.tar.xz: $BYTES bytes ($(( BYTES / 1048576 )) MiB), sha256 $SHA"

# ---------------------------------------------------------------------------
step "6/6 split into ${PART_MIB} MiB parts -> $OUT"
(cd "$WORK/out" && split -b "${PART_MIB}M" -d -a 2 bundle.tar.xz part.)
rm -rf "$OUT"
mkdir -p "$OUT"
parts=("$WORK"/out/part.*)
N=${#parts[@]}
{
  echo "# speclab GPU bundle (tools/gpu/pack.sh); checked by tools/gpu/unpack.sh"
  echo "bundle_sha256 $SHA"
  echo "bundle_bytes $BYTES"
  echo "unpacked_bytes $(du -sb "$S" | cut -f1)"
  echo "nparts $N"
  i=1
  for f in "${parts[@]}"; do
    echo "part $i $(sha256sum "$f" | cut -d' ' -f1) $(stat -c %s "$f")"
    i=$((i + 1))
  done
  echo "arch sm_$ARCH"
  echo "created $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  sed 's/^/wheel /' "$WORK/reqs.txt"
} > "$OUT/MANIFEST"
i=1
for f in "${parts[@]}"; do
  mkdir -p "$OUT/p$i"
  mv "$f" "$OUT/p$i/part"
  cp "$OUT/MANIFEST" "$OUT/p$i/MANIFEST"
  i=$((i + 1))
done
rm -f "$WORK/out/bundle.tar.xz"
ls -l "$OUT"/p*/part
step "done: $N part(s), bundle sha256 $SHA, manifest $OUT/MANIFEST"
