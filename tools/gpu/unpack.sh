#!/usr/bin/env bash
# Device side of tools/gpu/pack.sh: collect a bundle's parts over one or more
# calls, check them, extract once, and print the environment to use it.
#
# Usage (from the repo root, on the device):
#   eval "$(bash tools/gpu/unpack.sh [STAGE])" || exit 9
#     STAGE: where the carried parts are (default .stage/gpu, the vLLM 0.22.0
#     bundle; .stage/gpu026 is 0.26.0; .stage/ray the Ray layer, pack.sh --ray).
#     It holds p1/, p2/, ..., each with `part` and `MANIFEST`. Carry one or more pK
#     per call.
#
# Parts are stashed by their sha256 in $SPECLAB_PARTS (default /tmp/speclab_parts),
# which lasts while the machine stays warm, so a part that two bundles share (the
# `shared` layer, pack.sh step 5) is carried once for both. Each carried part is
# checked against MANIFEST. When all of a bundle's parts are there, the whole is
# checked and extracted to $SPECLAB_DEST/site; SPECLAB_DEST defaults to
# ${SPECLAB_DEST_ROOT:-/tmp}/speclab_site plus STAGE's name after "gpu"
# (/tmp/speclab_site for .stage/gpu, /tmp/speclab_site026 for .stage/gpu026), or
# plus "_" and the name for another STAGE (/tmp/speclab_site_ray for .stage/ray), so
# bundles live side by side. A later
# call for the same STAGE finds the extraction and only prints the environment (no
# parts need to be carried then).
#
# stdout: export lines only (for eval), for the bundle asked; use one bundle per
# shell (a subshell each), PYTHONPATH loses any other bundle's site dir. The Ray layer
# (manifest `kind ray`) prints only SPECLAB_RAY_SITE, its folder, which the job that
# uses Ray appends to PYTHONPATH after the bundle's site dir (studies/*.yaml).
# Messages go to stderr.
# Exit: 0 ready; 3 parts still missing ("have i of n parts"); 1 bad part/bundle;
#       2 no manifest found.
set -euo pipefail
STAGE=${1:-.stage/gpu}
NAME=$(basename "$STAGE")
STASH=${SPECLAB_PARTS:-/tmp/speclab_parts}
case $NAME in gpu*) SUFFIX=${NAME#gpu} ;; *) SUFFIX=_$NAME ;; esac
DEST=${SPECLAB_DEST:-${SPECLAB_DEST_ROOT:-/tmp}/speclab_site$SUFFIX}
log() { echo "unpack: $*" >&2; }
field() { awk -v k="$1" '$1 == k { print $2; exit }' "$2"; }

mkdir -p "$STASH"
# The manifest: from a carried part, else the one stashed for STAGE by an earlier
# call, else from a previous extraction.
MAN=""
for m in "$STAGE"/p*/MANIFEST "$STAGE/MANIFEST" "$STASH/MANIFEST.$NAME" "$DEST/MANIFEST"; do
  [ -f "$m" ] && { MAN=$m; break; }
done
[ -n "$MAN" ] || { log "no MANIFEST under $STAGE, $STASH or $DEST"; exit 2; }
SHA=$(field bundle_sha256 "$MAN")
N=$(field nparts "$MAN")
VLLM=$(awk '$1 == "wheel" && $2 ~ /^vllm==/ { sub("vllm==", "", $2); print $2; exit }' "$MAN")
KIND=$(field kind "$MAN")  # ray: the Ray layer; none: a vLLM bundle
WHAT=${VLLM:+vLLM $VLLM}
[ "$KIND" = ray ] && WHAT=$(awk '$1 == "wheel" && $2 ~ /^ray==/ { sub("==", " ", $2); print $2; exit }' "$MAN")
part_sha() { awk -v k="$1" '$1 == "part" && $2 == k { print $3 }' "$MAN"; }

print_env() {
  local site=$DEST/site py_site keep
  if [ "$KIND" = ray ]; then echo "export SPECLAB_RAY_SITE=$site"; return; fi
  py_site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null || true)
  # The bundle dir goes first on PYTHONPATH; its sitecustomize.py runs
  # site.addsitedir() on it in every Python process that inherits this
  # environment (vllm serve, engine core, spawn children), so .pth files in it
  # work: cutlass-dsl's .pth, and speclab overlays placed with
  # `speclab overlay install --site "$SPECLAB_SITE"`. Another bundle's site dir
  # already on PYTHONPATH is dropped.
  keep=$(printf '%s' "${PYTHONPATH:-}" | tr ':' '\n' | { grep -Ev '/speclab_site[^/]*/site/?$' || true; } \
         | paste -sd: -)
  echo "export PYTHONPATH=$site${keep:+:$keep}"
  echo "export SPECLAB_SITE=$site"
  echo "export SPECLAB_VLLM=$VLLM"                # the bundle's vLLM release
  # The interpreter's own site-packages (also processes .pth files; for reference).
  [ -n "$py_site" ] && echo "export SPECLAB_PY_SITE=$py_site"
  echo "export PATH=$site/bin:\$PATH"          # bin/vllm -> vllm.entrypoints.cli.main
  # DeepGEMM / TileLang / humming JIT-compile with the image's nvcc.
  [ -d /usr/local/cuda ] && echo "export CUDA_HOME=\${CUDA_HOME:-/usr/local/cuda}"
  # flashinfer is not in the bundle: keep vLLM's sampler off it.
  echo "export VLLM_USE_FLASHINFER_SAMPLER=\${VLLM_USE_FLASHINFER_SAMPLER:-0}"
}

# Already extracted from this very bundle: nothing to do.
if [ -f "$DEST/.bundle_sha256" ] && [ "$(cat "$DEST/.bundle_sha256")" = "$SHA" ] && [ -d "$DEST/site" ]; then
  log "bundle ${SHA:0:12} ($WHAT) already extracted in $DEST/site"
  print_env; exit 0
fi
cp -f "$MAN" "$STASH/MANIFEST.$NAME" 2>/dev/null || true

# Take in the carried parts, each checked against its line in the manifest.
for d in "$STAGE"/p[0-9]*; do
  [ -f "$d/part" ] || continue
  k=${d##*/p}
  want=$(part_sha "$k")
  [ -n "$want" ] || { log "$d: no part $k in the manifest"; exit 1; }
  got=$(sha256sum "$d/part" | cut -d' ' -f1)
  [ "$got" = "$want" ] || { log "$d/part: sha256 $got != manifest $want"; exit 1; }
  cp -f "$d/part" "$STASH/$want"
  log "stashed part $k of $N"
done

HAVE=0 MISSING=""
for k in $(seq 1 "$N"); do
  if [ -f "$STASH/$(part_sha "$k")" ]; then HAVE=$((HAVE + 1)); else MISSING="$MISSING p$k"; fi
done
if [ "$HAVE" -lt "$N" ]; then
  echo "have $HAVE of $N parts (missing:$MISSING); carry the next part in the next call" >&2
  exit 3
fi

cat_parts() { for k in $(seq 1 "$N"); do cat "$STASH/$(part_sha "$k")"; done; }
GOT=$(cat_parts | sha256sum | cut -d' ' -f1)
[ "$GOT" = "$SHA" ] || { log "bundle sha256 $GOT != $SHA; rm -rf $STASH and resend"; exit 1; }

t0=$(date +%s)
rm -rf "$DEST.tmp"
mkdir -p "$DEST.tmp"
# The bundle is one or more xz streams (layers), each a tar archive: tar reads on
# past each archive's end marker (-i).
if command -v xz >/dev/null; then
  cat_parts | xz -dc -T0 | tar -x -i -C "$DEST.tmp"
else  # Python's lzma reads the same streams (BCJ x86 + LZMA2)
  cat_parts | python3 -c 'import lzma, sys, tarfile
with lzma.open(sys.stdin.buffer) as xz, tarfile.open(fileobj=xz, mode="r|", ignore_zeros=True) as t:
    t.extractall(sys.argv[1], filter="fully_trusted")' "$DEST.tmp"
fi
cp "$MAN" "$DEST.tmp/MANIFEST"
echo "$SHA" > "$DEST.tmp/.bundle_sha256"
rm -rf "$DEST"
mv "$DEST.tmp" "$DEST"
log "extracted bundle ${SHA:0:12} ($WHAT, $N parts) to $DEST/site in $(( $(date +%s) - t0 ))s"
print_env
