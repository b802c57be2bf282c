#!/usr/bin/env bash
# lab.py detached: it keeps running between device calls while the machine stays warm, so a
# job longer than one call is not cut at each call's end (a point in flight is not lost).
#   bash tools/gpu/labd.sh start STAGE RELEASE MINUTES JOBS [LAB_ARGS]   e.g. .stage/gpu026 0.26 22
#        mtp-026 (JOBS: comma-separated; LAB_ARGS go to lab.py, e.g. --slots 2; STAGE: the
#        bundle's, then any more, comma-separated, e.g. .stage/gpu026,.stage/ray for the Ray
#        layer: unpack.sh's environment of each, in that order)
#   bash tools/gpu/labd.sh collect SECONDS                   wait (returns early when lab.py
#        is done), copying results.tar.gz, summary.json, driver.log, JIT caches to $OUT every
#        $COPY_EVERY s (default 30) and at the end, so a call cut by its own time limit still
#        brings back the latest; then print the driver log's tail and the checks' verdicts;
#        exits 0 when lab.py has ended, 5 while it still runs
# The device copies the working tree afresh for every call and drops untracked files, so the
# detached lab.py runs from a copy of the tree in $LABD (default /tmp/speclab_labd), with the
# bundle's environment and the carried JIT caches (jit.sh load). lab.py is run again while a
# job is not done and time is left (a job's own timeout may be shorter than the minutes
# given; the sweep resumes its points).
set -o pipefail
cd "$(dirname "$0")/../.."
LABD=${LABD:-/tmp/speclab_labd}
T0=$(date +%s)
# until lab.py has ended or the clock reaches $1, looking every $2 s
wait_done() {
  while [ "$(date +%s)" -lt "$1" ] && ! grep -q "^labd done" "$LABD/labd.out" 2>/dev/null; do
    sleep "$2"
  done
}
# copy lab.py's outputs to $OUT, each file whole (a call cut mid-copy keeps the last good one)
copy_out() {
  for f in "$LABD"/out/*; do
    [ -f "$f" ] && cp "$f" "$OUT/.copying" && mv -f "$OUT/.copying" "$OUT/$(basename "$f")"
  done
  tail -n 100 "$LABD/labd.out" > "$OUT/.copying" 2>/dev/null && mv -f "$OUT/.copying" "$OUT/labd.out"
}
case "${1:-}" in
start)
  stage=${2:?stage} rel=${3:?release} minutes=${4:?minutes} jobs=${5:?jobs}
  shift 5; extra=""; [ $# -gt 0 ] && extra=$(printf ' %q' "$@")
  envs=""
  for st in ${stage//,/ }; do
    e=$(bash tools/gpu/unpack.sh "$st") || { echo "$st incomplete (rc $?)"; exit 3; }
    envs+=$e$'\n'
  done
  mkdir -p "$LABD/repo" "$LABD/out"
  tar --exclude=./.stage --exclude=./.git -cf - . | tar -xf - -C "$LABD/repo"
  bash tools/gpu/jit.sh load "vllm${rel//./}"
  deadline=$(( T0 + minutes * 60 ))
  cat > "$LABD/run.sh" <<RUN
set -o pipefail
$envs
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
cd "$LABD/repo"
for i in 1 2 3; do
  left=\$(( $deadline - \$(date +%s) ))
  [ "\$left" -gt 120 ] || break
  python3 tools/gpu/lab.py --vllm $rel --out "$LABD/out" --deadline "\$left" --only $jobs$extra
  python3 -c "import json,sys; d=set(json.load(open(sys.argv[2]))); sys.exit(0 if set(sys.argv[1].split(','))<=d else 1)" $jobs "\${LAB_STATE:-/tmp/speclab_lab}/done.json" 2>/dev/null && break
done
echo "labd done \$(date -u +%FT%TZ)"
RUN
  setsid nohup bash "$LABD/run.sh" > "$LABD/labd.out" 2>&1 < /dev/null &
  echo "labd pid $! until $(date -d @$deadline +%T); setup $(( $(date +%s) - T0 )) s"
  # its first lines (up to 15 s; at once when lab.py already ended, e.g. on a bad job name)
  wait_done $(( $(date +%s) + 15 )) 1
  tail -n 5 "$LABD/labd.out" ;;
collect)
  # a fresh machine (the warm one was given back) has no lab.py to wait for: say so at once
  [ -e "$LABD/labd.out" ] || { echo "no detached lab.py on this machine (a fresh one?)"; exit 4; }
  end=$(( T0 + ${2:?seconds} )) last=0
  while [ "$(date +%s)" -lt "$end" ] && ! grep -q "^labd done" "$LABD/labd.out"; do
    [ $(( $(date +%s) - last )) -ge "${COPY_EVERY:-30}" ] && { copy_out; last=$(date +%s); }
    sleep 2
  done
  copy_out
  rc=5; grep -q "^labd done" "$LABD/labd.out" && rc=0
  [ "$rc" = 0 ] && echo "labd ended" || echo "labd still running"
  tail -n 30 "$LABD/out/driver.log"
  # each job's progress so far (the sweep's one line per point), so a call need not go look
  for log in "${LAB_STATE:-/tmp/speclab_lab}"/logs/*.log; do
    [ -e "$log" ] || continue
    echo "== $(basename "$log" .log)"
    grep -E "^\[speclab\] (sweep|point)|points ok|^=== " "$log" | tail -n 6 | cut -c1-220
  done
  cat "$LABD"/repo/data/runs/*/mtp_check.json 2>/dev/null | head -60
  # compare_counters.py's verdicts (the Ray jobs): its lines end with this summary
  grep -h -B 4 "shared points identical" "${LAB_STATE:-/tmp/speclab_lab}"/logs/*.log \
    2>/dev/null | tail -n 20
  exit "$rc" ;;
*)
  sed -n 2,6p "$0"; exit 2 ;;
esac
