#!/usr/bin/env bash
# CPU-only test of tools/gpu/unpack.sh and sitecustomize.py with tiny fake
# bundles in pack.sh's format, in a temp dir: two layers (two xz streams of tar
# archives), each cut into its own parts, + MANIFEST.
# Checks: exit 3 with "have i of n parts" while parts are missing; a corrupt part
# is refused; extraction of both layers when complete; a second call skips
# extraction; the printed env makes the bundle a site dir (its .pth files are
# processed, also in a multiprocessing spawn child); a second bundle that shares
# the first layer needs only its own parts and extracts next to the first; its
# env replaces the first bundle's site dir on PYTHONPATH; a new build of a bundle
# replaces the old extraction; the Python fallback (no xz) extracts the same.
# Usage: bash tools/gpu/test_unpack.sh   (prints "N passed, M failed")
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
T=$(mktemp -d)
trap '[ -n "${KEEP:-}" ] || rm -rf "$T"' EXIT
export SPECLAB_PARTS=$T/stash SPECLAB_DEST_ROOT=$T
unset SPECLAB_DEST
pass=0 fail=0
ok() { echo "ok   $1"; pass=$((pass + 1)); }
bad() { echo "FAIL $1"; fail=$((fail + 1)); }

layer() {  # $1: out .tar.xz, $2: build dir holding site/; deterministic tar
  tar -C "$2" --owner=0 --group=0 --numeric-owner --mtime='2026-01-01 00:00:00' --sort=name \
    -cf - site | xz --x86 --lzma2=preset=6 > "$1"
}
make_bundle() {  # $1: stage dir, $2: marker text. Layer 1 is the same in every bundle.
  local st=$1 w=$T/build n=0 name f
  rm -rf "$w" "$st"; mkdir -p "$w/shared/site/shared_pkgs/sharedpkg" "$w/own/site/extra_pkgs/fakepkg" "$st"
  echo "NAME = 'shared'" > "$w/shared/site/shared_pkgs/sharedpkg/__init__.py"
  echo "shared_pkgs" > "$w/shared/site/shared.pth"
  head -c 200000 /dev/zero | tr '\0' 'x' > "$w/shared/site/pad.txt"
  openssl enc -aes-128-ctr -pass pass:speclab -nosalt -pbkdf2 < /dev/zero 2>/dev/null \
    | head -c 250000 > "$w/shared/site/blob.bin"   # fixed, incompressible: 3 parts
  cp "$HERE/sitecustomize.py" "$w/own/site/"
  echo "extra_pkgs" > "$w/own/site/fake.pth"
  echo "MARK = '$2'" > "$w/own/site/extra_pkgs/fakepkg/__init__.py"
  layer "$w/l1.tar.xz" "$w/shared"; layer "$w/l2.tar.xz" "$w/own"
  : > "$w/parts"
  for name in l1 l2; do
    (cd "$w" && split -b 110000 -d -a 2 "$name.tar.xz" "part.$name.")
    for f in "$w/part.$name".*; do
      n=$((n + 1)); mkdir -p "$st/p$n"; mv "$f" "$st/p$n/part"
      echo "part $n $(sha256sum "$st/p$n/part" | cut -d' ' -f1) $(stat -c %s "$st/p$n/part")" >> "$w/parts"
    done
  done
  { echo "bundle_sha256 $(cat "$w/l1.tar.xz" "$w/l2.tar.xz" | sha256sum | cut -d' ' -f1)"
    echo "wheel vllm==0.0.$2"; echo "nparts $n"; cat "$w/parts"; } > "$st/MANIFEST"
  for f in "$st"/p*/; do cp "$st/MANIFEST" "$f"; done
  echo "$n"
}
call() {  # $1: bundle (stage name), then the parts to carry, like one device call
  local b=$1; shift
  rm -rf "$T/stage"; mkdir -p "$T/stage/$b"
  for k in "$@"; do cp -r "$T/all/$b/p$k" "$T/stage/$b/"; done
  bash "$HERE/unpack.sh" "$T/stage/$b" 2> "$T/err"
}

N=$(make_bundle "$T/all/gpu" one)
[ "$N" = 4 ] && ok "fake bundle has 4 parts (layer 1: 3, layer 2: 1)" || bad "fake bundle has $N parts"
call gpu 1 > /dev/null; rc=$?
[ $rc = 3 ] && grep -q "have 1 of 4 parts" "$T/err" && ok "call 1: exit 3, have 1 of 4" || bad "call 1: rc=$rc $(cat "$T/err")"
cp -r "$T/all/gpu/p2" "$T/p2good"; printf x >> "$T/all/gpu/p2/part"
call gpu 2 > /dev/null; rc=$?
[ $rc = 1 ] && ok "corrupt part 2 refused" || bad "corrupt part 2: rc=$rc"
rm -rf "$T/all/gpu/p2"; cp -r "$T/p2good" "$T/all/gpu/p2"
call gpu 2 3 > /dev/null; rc=$?
[ $rc = 3 ] && grep -q "have 3 of 4 (missing: p4)\|have 3 of 4 parts (missing: p4)" "$T/err" \
  && ok "call 2: have 3 of 4 (missing: p4)" || bad "call 2: rc=$rc $(cat "$T/err")"
call gpu 4 > "$T/env"; rc=$?
[ $rc = 0 ] && grep -q "extracted" "$T/err" && [ -f "$T/speclab_site/site/blob.bin" ] \
  && [ -f "$T/speclab_site/site/fake.pth" ] && ok "call 3: both layers extracted to \$SPECLAB_DEST_ROOT/speclab_site" \
  || bad "call 3: rc=$rc $(cat "$T/err")"
call gpu > "$T/env2"; rc=$?
[ $rc = 0 ] && grep -q "already extracted" "$T/err" && cmp -s "$T/env" "$T/env2" \
  && ok "call 4 (no parts): skips extraction, same env" || bad "call 4: rc=$rc $(cat "$T/err")"
grep -qx "export SPECLAB_VLLM=0.0.one" "$T/env" && ok "env names the bundle's vLLM" || bad "env: $(cat "$T/env")"
cat > "$T/spawn_check.py" <<'EOF'
import multiprocessing as mp, os
def child(q):
    import fakepkg, sharedpkg; q.put(fakepkg.MARK + sharedpkg.NAME)
if __name__ == "__main__":
    import fakepkg, sharedpkg
    ctx = mp.get_context("spawn"); q = ctx.Queue(); p = ctx.Process(target=child, args=(q,)); p.start()
    print(fakepkg.MARK + sharedpkg.NAME, q.get(timeout=60), os.environ["SPECLAB_SITE"].endswith("/site"))
    p.join()
EOF
out=$( (eval "$(cat "$T/env")"; python3 "$T/spawn_check.py") 2>&1)
[ "$out" = "oneshared oneshared True" ] && ok ".pth of both layers processed in parent and spawn child" || bad ".pth: $out"

# A second bundle (another vLLM): same first layer, its own second layer.
N=$(make_bundle "$T/all/gpu026" two)
call gpu026 4 > "$T/env026"; rc=$?
[ $rc = 0 ] && grep -q "extracted" "$T/err" && ok "second bundle: only its own part carried (shared layer stashed)" \
  || bad "second bundle: rc=$rc $(cat "$T/err")"
[ -f "$T/speclab_site/.bundle_sha256" ] && [ -d "$T/speclab_site026/site" ] \
  && ok "second bundle extracted next to the first (\$SPECLAB_DEST_ROOT/speclab_site026)" || bad "dest dirs: $(ls "$T")"
out=$( (eval "$(cat "$T/env")"; eval "$(cat "$T/env026")"; echo "$PYTHONPATH"; python3 -c 'import fakepkg; print(fakepkg.MARK)') 2>&1)
[ "$out" = "$(printf '%s\n%s' "$T/speclab_site026/site" two)" ] \
  && ok "second env replaces the first bundle's site on PYTHONPATH" || bad "PYTHONPATH: $out"

# A new build of the first bundle (new second layer) replaces the old extraction.
N=$(make_bundle "$T/all/gpu" three)
call gpu 4 > "$T/env"; rc=$?
out=$( (eval "$(cat "$T/env")"; python3 -c 'import fakepkg; print(fakepkg.MARK)') 2>&1)
[ $rc = 0 ] && [ "$out" = three ] && ok "rebuilt bundle replaces its extraction" || bad "rebuilt: rc=$rc $out"

# Without xz on PATH: Python's lzma + tarfile read the concatenated streams.
mkdir -p "$T/noxz"
for c in bash cat tar awk sha256sum cp rm mkdir mv seq sed tr grep paste date cut basename head stat; do
  ln -sf "$(command -v "$c")" "$T/noxz/$c"
done
ln -sf "$(python3 -c 'import sys; print(sys.executable)')" "$T/noxz/python3"
rm -rf "$T/speclab_site026"
out=$(PATH=$T/noxz bash "$HERE/unpack.sh" "$T/stage/gpu026" 2>&1 >/dev/null); rc=$?
[ $rc = 0 ] && cmp -s "$T/speclab_site026/site/blob.bin" "$T/speclab_site/site/blob.bin" \
  && [ -f "$T/speclab_site026/site/fake.pth" ] && ok "no xz: Python fallback extracts both layers" || bad "no xz: rc=$rc $out"
echo "$pass passed, $fail failed"
[ $fail = 0 ]
