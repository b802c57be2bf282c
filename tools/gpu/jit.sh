#!/usr/bin/env bash
# The JIT caches a device machine compiled (Triton, TileLang, DeepGEMM, vLLM), carried between
# fresh machines as data/jit/jit-cache-<reltag>-h200.tar.gz.
#   bash tools/gpu/jit.sh load RELTAG     extract data/jit/*-RELTAG-*.tar.gz (and .jit/*.tar.gz)
#   bash tools/gpu/jit.sh save FILE       tar the caches into FILE (members relative to $HOME;
#        lab.py and realshape.sh save through it; none there: no FILE)
# load takes both layouts in use: members relative to $HOME (`save`, realshape.sh) and
# absolute ones stored as root/... (what lab.py wrote before it saved through `save`).
set -o pipefail
cd "$(dirname "$0")/../.."
DIRS=".triton .tilelang .deep_gemm .cache/tilelang .cache/vllm"
case "${1:-}" in
load)
  for t in data/jit/*-"${2:?reltag}"-*.tar.gz .jit/*.tar.gz; do
    [ -e "$t" ] || continue
    first=$(tar tzf "$t" | head -n 1)
    case "$first" in
      "${HOME#/}"/*) tar xzf "$t" -C / ;;
      *) tar xzf "$t" -C "$HOME" ;;
    esac && echo "JIT caches from $t"
  done
  (cd "$HOME" && du -sh $(for d in $DIRS; do [ -d "$d" ] && echo "$d"; done) 2>/dev/null) ;;
save)
  have=$(cd "$HOME" && for d in $DIRS; do [ -d "$d" ] && echo "$d"; done)
  [ -n "$have" ] || { echo "no JIT caches under $HOME"; exit 0; }
  (cd "$HOME" && tar czf "${2:?file}" $have && du -sh $have) ;;
*)
  sed -n 2,7p "$0"; exit 2 ;;
esac
