#!/usr/bin/env bash
# Device side of tools/gpu/pack.sh: collect the bundle's parts over one or more
# calls, check them, extract once, and print the environment to use it.
#
# Usage (from the repo root, on the device):
#   eval "$(bash tools/gpu/unpack.sh [STAGE])" || exit 9
#     STAGE: where the carried parts are (default .stage/gpu; holds p1/, p2/, ...,
#     each with `part` and `MANIFEST`). Carry one or more pK per call.
#
# Each call copies the parts it finds (after checking their sha256 against
# MANIFEST) into $SPECLAB_PARTS (default /tmp/speclab_parts), which lasts while
# the machine stays warm. When all parts are there, the whole is checked and
# extracted to $SPECLAB_DEST/site (default /tmp/speclab_site/site). A later call
# with the same manifest skips all that (no parts need to be carried then).
#
# stdout: export lines only (for eval). Messages go to stderr.
# Exit: 0 ready; 3 parts still missing ("have i of n parts"); 1 bad part/bundle;
#       2 no manifest found.
set -euo pipefail
STAGE=${1:-.stage/gpu}
STASH=${SPECLAB_PARTS:-/tmp/speclab_parts}
DEST=${SPECLAB_DEST:-/tmp/speclab_site}
log() { echo "unpack: $*" >&2; }
field() { awk -v k="$1" '$1 == k { print $2; exit }' "$2"; }

mkdir -p "$STASH"
# The manifest: from a carried part, else from the stash, else from a previous extraction.
MAN=""
for m in "$STAGE"/p*/MANIFEST "$STAGE/MANIFEST" "$STASH/MANIFEST" "$DEST/MANIFEST"; do
  [ -f "$m" ] && { MAN=$m; break; }
done
[ -n "$MAN" ] || { log "no MANIFEST under $STAGE, $STASH or $DEST"; exit 2; }
SHA=$(field bundle_sha256 "$MAN")
N=$(field nparts "$MAN")

print_env() {
  local site=$DEST/site py_site
  py_site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null || true)
  # The bundle dir goes first on PYTHONPATH; its sitecustomize.py runs
  # site.addsitedir() on it in every Python process that inherits this
  # environment (vllm serve, engine core, spawn children), so .pth files in it
  # work: nvidia_cutlass_dsl.pth, and speclab overlays placed with
  # `speclab overlay install --site "$SPECLAB_SITE"`.
  echo "export PYTHONPATH=$site\${PYTHONPATH:+:\$PYTHONPATH}"
  echo "export SPECLAB_SITE=$site"
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
  log "bundle ${SHA:0:12} already extracted in $DEST/site"
  print_env; exit 0
fi

# Parts of another bundle in the stash: start over.
if [ -f "$STASH/MANIFEST" ] && [ "$(field bundle_sha256 "$STASH/MANIFEST")" != "$SHA" ]; then
  log "stash held parts of another bundle; clearing $STASH"
  rm -f "$STASH"/part.* "$STASH/MANIFEST"
fi
cp -f "$MAN" "$STASH/MANIFEST" 2>/dev/null || true

# Take in the carried parts, each checked against its line in the manifest.
for d in "$STAGE"/p[0-9]*; do
  [ -f "$d/part" ] || continue
  k=${d##*/p}
  want=$(awk -v k="$k" '$1 == "part" && $2 == k { print $3 }' "$MAN")
  [ -n "$want" ] || { log "$d: no part $k in the manifest"; exit 1; }
  got=$(sha256sum "$d/part" | cut -d' ' -f1)
  [ "$got" = "$want" ] || { log "$d/part: sha256 $got != manifest $want"; exit 1; }
  cp -f "$d/part" "$STASH/part.$k"
  log "stashed part $k of $N"
done

HAVE=0 MISSING=""
for k in $(seq 1 "$N"); do
  if [ -f "$STASH/part.$k" ]; then HAVE=$((HAVE + 1)); else MISSING="$MISSING p$k"; fi
done
if [ "$HAVE" -lt "$N" ]; then
  echo "have $HAVE of $N parts (missing:$MISSING); carry the next part in the next call" >&2
  exit 3
fi

cat_parts() { for k in $(seq 1 "$N"); do cat "$STASH/part.$k"; done; }
GOT=$(cat_parts | sha256sum | cut -d' ' -f1)
[ "$GOT" = "$SHA" ] || { log "bundle sha256 $GOT != $SHA; rm -rf $STASH and resend"; exit 1; }

t0=$(date +%s)
rm -rf "$DEST.tmp"
mkdir -p "$DEST.tmp"
if command -v xz >/dev/null; then
  cat_parts | xz -dc -T0 | tar -x -C "$DEST.tmp"
else  # Python's lzma reads the same stream (BCJ x86 + LZMA2)
  cat_parts | python3 -c 'import sys, tarfile
tarfile.open(fileobj=sys.stdin.buffer, mode="r|xz").extractall(sys.argv[1])' "$DEST.tmp"
fi
cp "$MAN" "$DEST.tmp/MANIFEST"
echo "$SHA" > "$DEST.tmp/.bundle_sha256"
rm -rf "$DEST"
mv "$DEST.tmp" "$DEST"
log "extracted bundle ${SHA:0:12} ($N parts) to $DEST/site in $(( $(date +%s) - t0 ))s"
print_env
