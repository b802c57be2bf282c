#!/usr/bin/env bash
# One device call, two releases: lab.py for vLLM 0.22 (+ overlay) and for 0.26 side by side on
# the same GPU, each in its own subshell (its bundle's PYTHONPATH), state dir and HOME (so the
# two never share a JIT-cache or fixture-cache directory), each with --slots jobs at once.
# Both bundles must be extracted already (tools/gpu/unpack.sh) or complete in the stash.
#
#   J22=job,job J26=job,job [KV_GIB=4] bash tools/gpu/two_labs.sh OUT DEADLINE [SLOTS]
#
# Every job shares the GPU, so each engine gets a fixed KV cache of KV_GIB (lab.py --kv-gib):
# vLLM then skips its memory profiling, which the other lab's allocations would upset. The
# dial fixtures at max_model_len 4096 with a draft need more than the default 4 (6.73 GiB).
#
# Writes OUT/v022/ and OUT/v026/ (lab.py's results.tar.gz, summary.json, driver.log) and
# OUT/v022.log, OUT/v026.log. JIT-cache tarballs are dropped (the call returns at most 8 files).
set -uo pipefail
OUT=$1 DEADLINE=$2 SLOTS=${3:-3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
lab() {  # lab REL STAGE JOBS
  local rel=$1 stage=$2 jobs=$3
  [ -n "$jobs" ] || return 0
  eval "$(bash tools/gpu/unpack.sh "$stage")" || return 9
  python3 tools/gpu/lab.py --vllm "$rel" --out "$OUT/v${rel/./}" --deadline "$DEADLINE" \
    --slots "$SLOTS" --kv-gib "${KV_GIB:-4}" --warm-first --only "$jobs"
}
mkdir -p "$OUT"
(lab 0.22 .stage/gpu "${J22:-}") > "$OUT/v022.log" 2>&1 &
(export HOME=/tmp/home026 LAB_STATE=/tmp/speclab_lab026; mkdir -p "$HOME"
 sleep 15; lab 0.26 .stage/gpu026 "${J26:-}") > "$OUT/v026.log" 2>&1 &
wait
rm -f "$OUT"/v*/jit-cache*
for f in "$OUT"/v022.log "$OUT"/v026.log; do echo "=== $f"; grep -E "^\[|rc=|FAIL|Error" "$f" | tail -25; done
