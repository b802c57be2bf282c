#!/usr/bin/env bash
# Make what travels to the device small. The device tool sends the tracked and the
# untracked-not-ignored files, 64 MiB a call with what is carried; the committed run folders
# and figures (~45 of the tree's ~54 MiB) are never read there, and each MiB they take is a
# MiB less of a bundle carried per call (0.26: 152 MiB in 10 parts of 17 MiB, 3 calls lean
# against 18 of 9 MiB).
#   bash tools/gpu/lean.sh on [RUN...]   untrack data/runs and figures in the index (the files
#        stay on disk) and ignore them; RUN: run folders under data/runs that must travel (a
#        job appends to them, e.g. the parity run)
#        LEAN_JIT=RELTAG (e.g. vllm022): the JIT caches of other releases (data/jit/*.tar.gz
#        not named *-RELTAG-*) stay home too; jit.sh load reads only RELTAG's
#   bash tools/gpu/lean.sh off           restore the index and the ignore list
#   bash tools/gpu/lean.sh size          MiB that would travel now, without carried paths
# While it is on, a pre-commit hook refuses every commit (the index lacks those files).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
GIT=$(git rev-parse --git-dir)
MARK="# speclab lean.sh"
HOOK=$GIT/hooks/pre-commit

size() {
  { git ls-files -z; git ls-files -z -o --exclude-standard; } \
    | xargs -0 -r stat -c %s 2>/dev/null \
    | awk '{s += $1} END {printf "%.1f MiB travel\n", s / 2^20}'
}

off() {
  git reset -q -- data/runs figures data/jit
  [ ! -e "$GIT/info/exclude" ] || sed -i "/^$MARK begin\$/,/^$MARK end\$/d" "$GIT/info/exclude"
  grep -q "$MARK" "$HOOK" 2>/dev/null && rm -f "$HOOK"
  return 0
}

case "${1:-}" in
on)
  shift
  stay=()  # JIT caches of other releases than $LEAN_JIT
  if [ -n "${LEAN_JIT:-}" ]; then
    if ! compgen -G "data/jit/*-$LEAN_JIT-*.tar.gz" > /dev/null; then
      echo "lean.sh: no data/jit/*-$LEAN_JIT-*.tar.gz (LEAN_JIT names a release tag, e.g. vllm026)" >&2
      exit 2
    fi
    for t in data/jit/*.tar.gz; do
      if [[ "$t" != *-"$LEAN_JIT"-* ]]; then stay+=("$t"); fi
    done
  fi
  off
  mkdir -p "$GIT/hooks" "$GIT/info"
  [ ! -e "$HOOK" ] || { echo "lean.sh: $HOOK exists; not replacing it" >&2; exit 2; }
  printf '#!/bin/sh\n%s\necho "%s" >&2\nexit 1\n' "$MARK" \
    "tools/gpu/lean.sh is on: run it with off before committing" > "$HOOK"
  chmod +x "$HOOK"
  git rm -r -q --cached data/runs figures
  for run in "$@"; do
    [ -d "data/runs/$run" ] || { echo "lean.sh: no data/runs/$run" >&2; off; exit 2; }
    git add -f "data/runs/$run"
  done
  if [ ${#stay[@]} -gt 0 ]; then git rm -q --cached -- "${stay[@]}"; fi
  { echo "$MARK begin"; printf '%s\n' /data/runs/ /figures/
    for t in "${stay[@]}"; do echo "/$t"; done; echo "$MARK end"; } >> "$GIT/info/exclude"
  size ;;
off) off; size ;;
size) size ;;
*) sed -n 2,14p "$0"; exit 2 ;;
esac
