#!/usr/bin/env bash
# Build one of speclab's vLLM bundles for the offline H200 device, on the CPU machine, or
# (--ray) the Ray layer that `speclab sweep --executor ray` needs there.
#
# What it makes: STAGE/p1, p2, ... (one folder per part, each with the part file
# `part` and a copy of MANIFEST), plus STAGE/MANIFEST. Each part is at most
# --part-mib MiB (default 42) so that one device call can carry it next to the
# working tree (64 MiB per call in all; keep >= 20 MiB for the tree).
# tools/gpu/unpack.sh STAGE puts them back together.
#
# What is in a bundle: tools/gpu/requirements-vllmNNN.txt for the release asked
# (vLLM + what the device image lacks on our code paths; see the file's header),
# laid out as one site directory `site/` with our sitecustomize.py (turns it into
# a real site dir, so .pth files in it work) and a `bin/vllm` launcher. See
# tools/gpu/README.md.
#
# The Ray layer (--ray): tools/gpu/requirements-ray.txt (Ray and msgpack), pruned to Ray's
# core, one layer whose manifest says `kind ray`; unpack.sh then exports SPECLAB_RAY_SITE
# instead of a bundle's environment (README "Ray on the device").
#
# Usage: tools/gpu/pack.sh [--vllm 0.22.0 | --ray] [--out DIR] [--arch 90] [--part-mib 42]
#                          [--tree-only | --resplit | --from-cache]
#   --vllm X.Y.Z  the release: reads requirements-vllm0YY.txt (0.22.0, 0.26.0)
#   --ray         the Ray layer instead of a vLLM bundle
#   --out DIR     where the parts go (default: <repo>/.stage/gpu for 0.22.0, whose
#                 parts predate the option, <repo>/.stage/gpu0YY for the others,
#                 <repo>/.stage/ray for --ray)
#   --arch N      GPU arch whose code is kept in the CUDA fat binaries (90 = H100/H200)
#   --part-mib N  part size limit in MiB (default 42)
#   --tree-only   stop after laying out and pruning the tree (for check_bundle.py)
#   --resplit     only cut the bundle already in --out into parts of --part-mib
#                 (checks its sha256; no download, no compression; seconds)
#   --from-cache  cut the newest layers of this release in the layer cache
#                 (LAYER_CACHE, below) into parts: a machine that packed before
#                 re-makes .stage without downloading or compressing (seconds)
# Env: WORK (default /tmp/speclab_gpu_pack for 0.22.0, /tmp/speclab_gpu_pack0YY
#      otherwise, /tmp/speclab_gpu_pack_ray for --ray): wheel cache ($WORK/whl, reused)
#      and the tree ($WORK/tree/site).
#      VLLM_WHEEL_DIR (default /tmp/wheels/v22): a folder that may already hold the
#      vLLM wheel, like ${SPECLAB_CACHE:-~/.cache/speclab}/wheels (copied, not
#      downloaded). XZ_THREADS (default 2). XZ_PRESET (default 9e; 6 compresses
#      several times faster for parts about 10% larger).
# Needs: pip (reaches PyPI), python3, xz, tar, strip, sha256sum, split.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
VLLM=""
RAY=0
OUT=""
ARCH=90
PART_MIB=42
TREE_ONLY=0
RESPLIT=0
FROM_CACHE=0
while [ $# -gt 0 ]; do
  case $1 in
    --vllm) VLLM=$2; shift 2 ;;
    --ray) RAY=1; shift ;;
    --out) OUT=$2; shift 2 ;;
    --arch) ARCH=$2; shift 2 ;;
    --part-mib) PART_MIB=$2; shift 2 ;;
    --tree-only) TREE_ONLY=1; shift ;;
    --resplit) RESPLIT=1; shift ;;
    --from-cache) FROM_CACHE=1; shift ;;
    -h|--help) sed -n '2,/^# Needs:/p' "$0"; exit 0 ;;
    *) echo "unknown option: $1" >&2; exit 2 ;;
  esac
done
pins() { { grep -Ev '^\s*(#|$)' "$1" || true; } | sed 's/\s*#.*//'; }
if [ "$RAY" = 1 ]; then
  [ -z "$VLLM" ] || { echo "--ray and --vllm: one at a time" >&2; exit 2; }
  REQS=$HERE/requirements-ray.txt
  SHARED_REQS=/dev/null  # one layer, no shared one
  RAYVER=$(pins "$REQS" | sed -n 's/^ray==//p')
  LAYERS=("ray$RAYVER")
  SUFFIX=_ray
  OUT=${OUT:-$REPO/.stage/ray}
else
  VLLM=${VLLM:-0.22.0}
  [[ $VLLM =~ ^0\.([0-9]+)\.[0-9]+$ ]] || { echo "--vllm wants a release like 0.26.0, got $VLLM" >&2; exit 2; }
  TAG=0${BASH_REMATCH[1]}
  REQS=$HERE/requirements-vllm$TAG.txt
  SHARED_REQS=$HERE/requirements-shared.txt
  [ -f "$REQS" ] || { echo "no $REQS: no bundle recipe for vLLM $VLLM" >&2; exit 2; }
  grep -qx "vllm==$VLLM" "$REQS" || { echo "$REQS does not pin vllm==$VLLM" >&2; exit 2; }
  LAYERS=(shared "vllm$VLLM")
  if [ "$TAG" = 022 ]; then SUFFIX=""; else SUFFIX=$TAG; fi
  OUT=${OUT:-$REPO/.stage/gpu$SUFFIX}
fi
WORK=${WORK:-/tmp/speclab_gpu_pack$SUFFIX}
VLLM_WHEEL_DIR=${VLLM_WHEEL_DIR:-/tmp/wheels/v22}
XZ_THREADS=${XZ_THREADS:-2}
XZ_PRESET=${XZ_PRESET:-9e}
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore
T0=$(date +%s)
step() { echo "== [$(( $(date +%s) - T0 ))s] $*"; }
# What unpack.sh is given: a vLLM bundle for one GPU arch, or the Ray layer.
kind_line() { if [ "$RAY" = 1 ]; then echo "kind ray"; else echo "arch sm_$ARCH"; fi; }

# Cut the layer archives DIR/layer.NAME.tar.xz (names in DIR/layers, in order)
# into parts OUT/pK/part, each layer on its own parts (so a layer's parts are
# the same files in every bundle that has it), each part with the MANIFEST:
# DIR/manifest.info, the bundle's sha256 (of all layers concatenated: one valid
# multi-stream xz file holding concatenated tar archives), the layers and the
# parts. Removes the archives from DIR.
write_parts() {
  local dir=$1 name parts n=0 first f sha
  rm -rf "$OUT" "$dir"/part.*
  mkdir -p "$OUT"
  : > "$dir/parts"
  sha=$(while read -r name; do cat "$dir/layer.$name.tar.xz"; done < "$dir/layers" | sha256sum | cut -d' ' -f1)
  {
    echo "# speclab GPU bundle (tools/gpu/pack.sh); checked by tools/gpu/unpack.sh"
    echo "bundle_sha256 $sha"
    echo "bundle_bytes $(while read -r name; do cat "$dir/layer.$name.tar.xz"; done < "$dir/layers" | wc -c)"
    cat "$dir/manifest.info"
    echo "part_mib $PART_MIB"
  } > "$dir/MANIFEST"
  while read -r name; do
    (cd "$dir" && split -b "${PART_MIB}M" -d -a 2 "layer.$name.tar.xz" "part.$name.")
    parts=("$dir/part.$name."*)
    first=$((n + 1))
    for f in "${parts[@]}"; do
      n=$((n + 1))
      mkdir -p "$OUT/p$n"
      mv "$f" "$OUT/p$n/part"
      echo "part $n $(sha256sum "$OUT/p$n/part" | cut -d' ' -f1) $(stat -c %s "$OUT/p$n/part")" >> "$dir/parts"
    done
    echo "layer $name $(sha256sum "$dir/layer.$name.tar.xz" | cut -d' ' -f1) $(stat -c %s "$dir/layer.$name.tar.xz") p$first-p$n" >> "$dir/MANIFEST"
    rm -f "$dir/layer.$name.tar.xz"
  done < "$dir/layers"
  { cat "$dir/MANIFEST"; echo "nparts $n"; cat "$dir/parts"; } > "$OUT/MANIFEST"
  rm -f "$dir/parts" "$dir/MANIFEST"
  for f in "$OUT"/p*/; do cp "$OUT/MANIFEST" "$f/MANIFEST"; done
  ls -l "$OUT"/p*/part
  grep '^layer ' "$OUT/MANIFEST"
  step "done: $n part(s), bundle sha256 $sha, manifest $OUT/MANIFEST"
}

if [ "$RESPLIT" = 1 ]; then
  # The parts already in OUT, joined and checked, cut again layer by layer (in a
  # scratch dir: WORK may belong to a pack that is running). A manifest without
  # `layer` lines (bundles before 2026-12) is one layer, named `all`.
  [ -f "$OUT/MANIFEST" ] || { echo "--resplit: no $OUT/MANIFEST" >&2; exit 2; }
  TMP=$(mktemp -d)
  trap 'rm -rf "$TMP"' EXIT
  n=$(awk '$1 == "nparts" {print $2}' "$OUT/MANIFEST")
  for k in $(seq 1 "$n"); do cat "$OUT/p$k/part"; done > "$TMP/bundle"
  want=$(awk '$1 == "bundle_sha256" {print $2}' "$OUT/MANIFEST")
  got=$(sha256sum "$TMP/bundle" | cut -d' ' -f1)
  [ "$got" = "$want" ] || { echo "--resplit: joined parts have sha256 $got, manifest says $want" >&2; exit 1; }
  if grep -q '^layer ' "$OUT/MANIFEST"; then
    off=0
    while read -r _ name _ bytes _; do
      dd if="$TMP/bundle" of="$TMP/layer.$name.tar.xz" bs=1M iflag=skip_bytes,count_bytes \
         skip="$off" count="$bytes" status=none  # (tail | head dies of SIGPIPE under pipefail)
      echo "$name" >> "$TMP/layers"
      off=$((off + bytes))
    done < <(grep '^layer ' "$OUT/MANIFEST")
  else
    mv "$TMP/bundle" "$TMP/layer.all.tar.xz"
    echo all > "$TMP/layers"
  fi
  rm -f "$TMP/bundle"
  grep -Ev '^(#|bundle_sha256 |bundle_bytes |nparts |part |part_mib |layer )' "$OUT/MANIFEST" > "$TMP/manifest.info"
  step "resplit: $n part(s) -> ${PART_MIB} MiB parts"
  write_parts "$TMP"
  exit 0
fi

if [ "$FROM_CACHE" = 1 ]; then
  # The layers a full pack left in the cache (named NAME-<sha256 of the tar stream>),
  # the newest of each; the manifest's wheel lines come from the requirements files.
  LAYER_CACHE=${LAYER_CACHE:-${SPECLAB_CACHE:-$HOME/.cache/speclab}/gpu-layers}
  TMP=$(mktemp -d)
  trap 'rm -rf "$TMP"' EXIT
  for name in "${LAYERS[@]}"; do
    f=$(ls -t "$LAYER_CACHE/$name"-*.tar.xz 2>/dev/null | head -n 1)
    [ -n "$f" ] || { echo "--from-cache: no $name layer in $LAYER_CACHE (run a full pack)" >&2; exit 2; }
    xz -t "$f" || { echo "--from-cache: $f is damaged" >&2; exit 1; }
    cp "$f" "$TMP/layer.$name.tar.xz"
    echo "$name" >> "$TMP/layers"
    step "layer $name: $f"
  done
  {
    kind_line
    echo "created $(date -u +%Y-%m-%dT%H:%M:%SZ) (from the layer cache)"
    { pins "$SHARED_REQS"; pins "$REQS"; } | sed 's/^/wheel /'
  } > "$TMP/manifest.info"
  write_parts "$TMP"
  exit 0
fi

# ---------------------------------------------------------------------------
step "1/6 wheels -> $WORK/whl (cached)"
mkdir -p "$WORK/whl"
pins "$SHARED_REQS" > "$WORK/shared_reqs.txt"
{ cat "$WORK/shared_reqs.txt"; pins "$REQS"; } > "$WORK/reqs.txt"
DUP=$(sed 's/==.*//' "$WORK/reqs.txt" | tr 'A-Z_.' 'a-z--' | sort | uniq -d)
[ -z "$DUP" ] || { echo "pinned twice (shared and $REQS): $DUP" >&2; exit 2; }
# Lines marked `# pack: metadata-only`: only the wheel's dist-info is laid out (step 2).
{ grep -hE '#\s*pack:\s*metadata-only' "$SHARED_REQS" "$REQS" || true; } | sed 's/==.*//' \
  > "$WORK/metadata_only.txt"
# The vLLM wheel is 250-300 MB: reuse a copy already on this machine.
for f in "$VLLM_WHEEL_DIR"/vllm-"$VLLM"-*.whl \
         "${SPECLAB_CACHE:-$HOME/.cache/speclab}"/wheels/vllm-"$VLLM"-*.whl; do
  if [ -f "$f" ] && [ ! -f "$WORK/whl/$(basename "$f")" ]; then cp "$f" "$WORK/whl/"; fi
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
# Distributions marked `# pack: metadata-only` in the requirements file get only
# their dist-info, which keeps the Requires-Dist metadata complete.
# nvidia-cutlass-dsl 4.5.2: libs-cu13 ships every file of libs-base (same paths,
# cu13 builds), so installing both would let the install order decide which
# binary wins. 4.6.0: nvidia-cutlass-dsl requires libs-cu12 with no marker; only
# the cu13 build is carried (cutlass loads the flavour the driver supports).
"$PY" - "$WORK" <<'EOF'
import re, sys
work = sys.argv[1]
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
skip = {norm(l.strip()) for l in open(f"{work}/metadata_only.txt") if l.strip()}
with open(f"{work}/install.txt", "w") as inst, open(f"{work}/meta_only_whl.txt", "w") as meta:
    for line in open(f"{work}/wheels.txt"):
        name, path = line.split()
        (meta if name in skip else inst).write(path + "\n")
EOF
xargs -a "$WORK/install.txt" "$PY" -m pip install -q --no-deps --no-compile --no-index \
  "${PLAT[@]}" --target "$S"
"$PY" - "$S" "$WORK/meta_only_whl.txt" <<'EOF'
import sys, zipfile
site, listing = sys.argv[1:]
for whl in open(listing).read().split():
    with zipfile.ZipFile(whl) as z:
        names = [n for n in z.namelist() if n.split("/")[0].endswith(".dist-info")]
        z.extractall(site, names)
    print(f"{whl.rsplit('/', 1)[-1]}: dist-info only ({len(names)} files)")
EOF
du -sh "$S"

# ---------------------------------------------------------------------------
step "3/6 prune"
# Console scripts: their shebangs point at this machine's python. We ship our own bin/vllm.
rm -rf "$S/bin"
prune_ray() {
  # Ray's libraries on top of its core (RLlib, Tune, Train, Serve, Data, LLM, Workflows),
  # the Java jar (cross-language workers) and the dashboard's web client: the Ray executor
  # uses the core only (ray.init, tasks, placement groups: src/speclab/executor_ray.py) and
  # starts no dashboard. Ray 2.60.0's ray/__init__.py imports data, workflow and autoscaler
  # lazily (its module __getattr__), so their absence costs nothing at import.
  rm -rf "$S"/ray/{rllib,tune,train,serve,data,llm,workflow,jars,dashboard/client}
}
prune_vllm() {
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
}
if [ "$RAY" = 1 ]; then prune_ray; else prune_vllm; fi
find "$S" -name __pycache__ -prune -exec rm -rf {} +
# pip's direct_url.json holds this machine's wheel path (and RECORD its hash): both go,
# so that the same wheels give the same bytes whatever WORK is (the shared layer).
find "$S" -path '*.dist-info/direct_url.json' -delete
sed -i '/\.dist-info\/direct_url\.json,/d' "$S"/*.dist-info/RECORD
# Debug info (not symbols) of binaries outside vLLM (xgrammar carries ~50 MB).
# vLLM's own files are handled by prune_fatbin; cutlass-dsl's are already stripped.
find "$S" -name '*.so*' -type f ! -path "$S/vllm/*" ! -path "$S/nvidia_cutlass_dsl/*" \
  -exec strip --strip-debug {} + 2>/dev/null || true
# GPU code for other archs, in every fat binary (sm_$ARCH SASS, else PTX); Ray has none.
[ "$RAY" = 1 ] || find "$S" -name '*.so*' -type f ! -path "$S/nvidia_cutlass_dsl/*" -print0 \
  | xargs -0 "$PY" "$HERE/prune_fatbin.py" "$ARCH" | tail -n 1

# ---------------------------------------------------------------------------
step "4/6 add speclab files"
# The Ray layer is plain PYTHONPATH entries after a bundle's site dir (which has these).
if [ "$RAY" = 0 ]; then
cp "$HERE/sitecustomize.py" "$S/sitecustomize.py"
mkdir -p "$S/bin"
cat > "$S/bin/vllm" <<'EOF'
#!/usr/bin/env bash
# vLLM's console script, for the speclab bundle (PYTHONPATH must hold this site dir).
exec "${PYTHON:-python3}" -c 'import sys; from vllm.entrypoints.cli.main import main; sys.argv[0] = "vllm"; sys.exit(main())' "$@"
EOF
chmod +x "$S/bin/vllm"
fi
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
step "5/6 ${#LAYERS[@]} layer(s), each tar | xz --x86 -$XZ_PRESET (threads: $XZ_THREADS)"
# Layer `shared`: the top-level entries of site/ that only distributions of
# requirements-shared.txt own (their RECORDs say which). Layer `vllm$VLLM`: all
# the rest, speclab's files included. Member order within a layer: directories,
# then files grouped by kind (ELF binaries, then text by extension, then the
# rest), so that similar bytes sit close together in the xz window. --ray: one layer, all
# of site/ (no shared requirements: every entry is "own").
# Deterministic: fixed owner and mtime, so the shared layer's archive is the same
# bytes in every bundle built from the same commit. Each layer is compressed once
# and kept in $LAYER_CACHE by the sha256 of its tar stream (a re-run whose layer
# did not change reuses it). The tree must not change while tar reads it (tar
# fails on a changed file; a new hard link to a file changes its ctime).
rm -rf "$WORK/out"
mkdir -p "$WORK/out"
(cd "$WORK/tree" && "$PY" - "$WORK/shared_reqs.txt" "$WORK/out") <<'EOF'
import csv, os, re, sys
shared_reqs, out = sys.argv[1:]
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
shared = {norm(l.split("==")[0]) for l in open(shared_reqs) if l.strip()}
owners = {}  # top-level entry of site/ -> the layers of the distributions that own it
for d in os.listdir("site"):
    if d.endswith(".dist-info"):
        layer = "shared" if norm(d[: -len(".dist-info")].rsplit("-", 1)[0]) in shared else "own"
        owners.setdefault(d, set()).add(layer)
        for row in csv.reader(open(f"site/{d}/RECORD")):
            owners.setdefault(row[0].split("/")[0], set()).add(layer)
for speclab_file in ("sitecustomize.py", "bin"):
    owners[speclab_file] = {"own"}
def kind(p):
    name = os.path.basename(p)
    ext = name.rsplit(".", 1)[-1] if "." in name else ""
    if ".so" in name or ext in ("a", "o"):
        return (0, "")  # ELF binaries (host x86 code + CUDA fat binaries)
    if ext in ("py", "pyi", "h", "hpp", "cuh", "cu", "c", "cc", "cpp", "inl", "txt",
               "md", "json", "toml", "cfg", "jinja", "typed", "pth"):
        return (1, ext)  # text, grouped by extension
    return (2, ext)
members = {"shared": (["site"], []), "own": (["site"], [])}
for top in sorted(os.listdir("site")):
    layer = "shared" if owners.get(top) == {"shared"} else "own"
    dirs, files = members[layer]
    path = os.path.join("site", top)
    if not os.path.isdir(path):
        files.append(path)
        continue
    for root, ds, fs in os.walk(path):
        dirs.append(root)
        files += [os.path.join(root, f) for f in fs]
for layer, (dirs, files) in members.items():
    with open(f"{out}/members.{layer}.txt", "w") as fh:
        fh.writelines(p + "\n" for p in sorted(dirs) + sorted(files, key=lambda p: (kind(p), p)))
    print(f"layer {layer}: {len(files)} files")
EOF
tar_layer() {
  tar -C "$WORK/tree" --no-recursion -T "$WORK/out/members.$1.txt" --owner=0 --group=0 \
      --numeric-owner --mtime='2026-01-01 00:00:00' -cf -
}
# xz: BCJ x86 filter in front of LZMA2 preset 9e (measured here: -3% on x86
# code, +1.4% on CUDA SASS, neutral on text; a net gain for this mix).
compress() { xz --x86 --lzma2=preset="$XZ_PRESET" -T"$XZ_THREADS" --memlimit-compress=12GiB; }
LAYER_CACHE=${LAYER_CACHE:-${SPECLAB_CACHE:-$HOME/.cache/speclab}/gpu-layers}
mkdir -p "$LAYER_CACHE"
layer() {  # $1: member list (shared, own), $2: layer name in the bundle
  local key cached
  key=$(tar_layer "$1" | sha256sum | cut -d' ' -f1)
  cached=$LAYER_CACHE/$2-$key.tar.xz
  if [ -f "$cached" ]; then
    echo "layer $2: reusing $cached"
  else
    tar_layer "$1" | compress > "$cached.tmp.$$"
    mv "$cached.tmp.$$" "$cached"
  fi
  cp "$cached" "$WORK/out/layer.$2.tar.xz"
  echo "$2" >> "$WORK/out/layers"
}
if [ "$RAY" = 1 ]; then
  layer own "${LAYERS[0]}"
else
  layer shared shared
  layer own "vllm$VLLM"
fi
ls -l "$WORK"/out/layer.*

# ---------------------------------------------------------------------------
step "6/6 split into ${PART_MIB} MiB parts -> $OUT"
{
  echo "unpacked_bytes $(du -sb "$S" | cut -f1)"
  kind_line
  echo "created $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  sed 's/^/wheel /' "$WORK/reqs.txt"
} > "$WORK/out/manifest.info"
write_parts "$WORK/out"
