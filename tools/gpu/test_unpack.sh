#!/usr/bin/env bash
# CPU-only test of tools/gpu/unpack.sh and sitecustomize.py with a tiny fake
# bundle in the same format as pack.sh's (3 parts + MANIFEST), in a temp dir.
# Checks: exit 3 with "have i of n parts" while parts are missing; a corrupt part
# is refused; extraction when complete; a second call skips extraction; the
# printed env makes the bundle a site dir (its .pth files are processed, also in
# a multiprocessing spawn child); a new bundle replaces stale stashed parts.
# Usage: bash tools/gpu/test_unpack.sh   (prints "N passed, M failed")
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
export SPECLAB_PARTS=$T/stash SPECLAB_DEST=$T/dest
pass=0 fail=0
ok() { echo "ok   $1"; pass=$((pass + 1)); }
bad() { echo "FAIL $1"; fail=$((fail + 1)); }

make_bundle() {  # $1: stage dir, $2: marker text
  local st=$1 w=$T/build
  rm -rf "$w" "$st"; mkdir -p "$w/site/extra_pkgs/fakepkg" "$st"
  cp "$HERE/sitecustomize.py" "$w/site/"
  echo "extra_pkgs" > "$w/site/fake.pth"
  echo "MARK = '$2'" > "$w/site/extra_pkgs/fakepkg/__init__.py"
  head -c 300000 /dev/urandom > "$w/site/blob.bin"   # so that it splits into 3 parts
  tar -C "$w" -cf - site | xz --x86 --lzma2=preset=6 > "$w/b.tar.xz"
  (cd "$w" && split -b 110000 -d -a 2 b.tar.xz part.)
  local parts=("$w"/part.*) n=${#parts[@]} i=1
  { echo "bundle_sha256 $(sha256sum "$w/b.tar.xz" | cut -d' ' -f1)"; echo "nparts $n"
    for f in "${parts[@]}"; do echo "part $i $(sha256sum "$f" | cut -d' ' -f1) $(stat -c %s "$f")"; i=$((i+1)); done
  } > "$st/MANIFEST"
  i=1; for f in "${parts[@]}"; do mkdir -p "$st/p$i"; cp "$f" "$st/p$i/part"; cp "$st/MANIFEST" "$st/p$i/"; i=$((i+1)); done
  echo "$n"
}

N=$(make_bundle "$T/all" one)
[ "$N" = 3 ] && ok "fake bundle has 3 parts" || bad "fake bundle has $N parts"
call() {  # carry only the given parts, like one device call
  rm -rf "$T/stage"; mkdir -p "$T/stage"
  for k in "$@"; do cp -r "$T/all/p$k" "$T/stage/"; done
  bash "$HERE/unpack.sh" "$T/stage" 2> "$T/err"
}
call 1 > /dev/null; rc=$?
[ $rc = 3 ] && grep -q "have 1 of 3 parts" "$T/err" && ok "call 1: exit 3, have 1 of 3" || bad "call 1: rc=$rc $(cat "$T/err")"
cp -r "$T/all/p2" "$T/p2good"; printf x >> "$T/all/p2/part"
call 2 > /dev/null; rc=$?
[ $rc = 1 ] && ok "corrupt part 2 refused" || bad "corrupt part 2: rc=$rc"
rm -rf "$T/all/p2"; cp -r "$T/p2good" "$T/all/p2"
call 2 > /dev/null; rc=$?
[ $rc = 3 ] && grep -q "have 2 of 3" "$T/err" && ok "call 2: have 2 of 3" || bad "call 2: rc=$rc $(cat "$T/err")"
call 3 > "$T/env"; rc=$?
[ $rc = 0 ] && grep -q "extracted" "$T/err" && ok "call 3: extracted" || bad "call 3: rc=$rc $(cat "$T/err")"
call > "$T/env2"; rc=$?
[ $rc = 0 ] && grep -q "already extracted" "$T/err" && ok "call 4 (no parts): skips extraction" || bad "call 4: rc=$rc $(cat "$T/err")"
cat > "$T/spawn_check.py" <<'EOF'
import multiprocessing as mp, os
def child(q):
    import fakepkg; q.put(fakepkg.MARK)
if __name__ == "__main__":
    import fakepkg
    ctx = mp.get_context("spawn"); q = ctx.Queue(); p = ctx.Process(target=child, args=(q,)); p.start()
    print(fakepkg.MARK, q.get(timeout=60), os.environ["SPECLAB_SITE"].endswith("/site"))
    p.join()
EOF
out=$( (eval "$(cat "$T/env")"; python3 "$T/spawn_check.py") 2>&1)
[ "$out" = "one one True" ] && ok ".pth processed in parent and spawn child" || bad ".pth: $out"
N=$(make_bundle "$T/all" two)
call 1 > /dev/null; rc=$?
grep -q "another bundle" "$T/err" && [ $rc = 3 ] && ok "new bundle clears stale stash" || bad "new bundle: rc=$rc $(cat "$T/err")"
call 2 3 > "$T/env"; rc=$?
out=$( (eval "$(cat "$T/env")"; python3 -c 'import fakepkg; print(fakepkg.MARK)') 2>&1)
[ $rc = 0 ] && [ "$out" = two ] && ok "new bundle extracted (parts 2+3 in one call)" || bad "new bundle: rc=$rc $out"
echo "$pass passed, $fail failed"
[ $fail = 0 ]
