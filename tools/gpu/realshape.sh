#!/usr/bin/env bash
# Device side of the real-shape timing study (tools/gpu/README.md "Real shape"), vLLM 0.26.
#   bash tools/gpu/realshape.sh carry              collect the carried bundle parts (unpack.sh)
#   bash tools/gpu/realshape.sh start MIN [PLAN [ROUNDS]]   set up once (bundle, overlay, step-timing
#        plugin, carried JIT caches), then start `python -m speclab.gpubench drive` (first
#        compiling the mHC kernel variants in $WARM processes, default 8; $TOKENS greedy
#        tokens a request in each pass, default 128) in a
#        session of its own with a deadline MIN minutes from now; returns at once
#   bash tools/gpu/realshape.sh collect SECONDS [jit]   wait up to SECONDS while the driver
#        runs (copying its results to $OUT every $COPY_EVERY s, default 30), then copy its
#        results and logs (and with `jit` the JIT caches) to $OUT
# The driver outlives each call (setsid) while the machine stays warm; its state is
# /tmp/speclab_realshape (results.jsonl, engines.jsonl, driver.log, logs/).
set -o pipefail
cd "$(dirname "$0")/../.."
STAGE=${STAGE:-.stage/gpu026}
STATE=${STATE:-/tmp/speclab_realshape}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export VLLM_DEEP_GEMM_WARMUP=skip   # the relax warm-up JIT-compiles ~1800 DeepGEMM kernels
T0=$(date +%s)

env_for_bundle() {
  local envs
  envs=$(bash tools/gpu/unpack.sh "$STAGE") || return $?
  eval "$envs"
  export PYTHONPATH="$PWD/src:$PYTHONPATH"
}

case "${1:-}" in
carry)
  bash tools/gpu/unpack.sh "$STAGE" >/dev/null; rc=$?
  echo "unpack rc=$rc ($(( $(date +%s) - T0 )) s)"; exit "$rc" ;;
start)
  env_for_bundle || { echo "bundle incomplete (rc $?)"; exit 3; }
  mkdir -p "$STATE"
  if [ ! -e "$STATE/setup.done" ]; then
    python3 -m speclab overlay install --site "$SPECLAB_SITE" || exit 4
    python3 tools/gpu/gpu_env.py install --site "$SPECLAB_SITE" || exit 4
    python3 -c "import sys; from speclab import vllm_plugins; vllm_plugins.write_dist(sys.argv[1])" "$SPECLAB_SITE" || exit 4
    bash tools/gpu/jit.sh load vllm026
    free=$(df --output=avail -B1G /dev/shm | tail -1)
    cache=/tmp/speclab_cache; [ "$free" -ge 48 ] && cache=/dev/shm/speclab_cache
    echo "$cache" > "$STATE/cache_dir"
    python3 tools/gpu/gpu_env.py report --out "$STATE/env.json" >/dev/null 2>&1
    date -u +%FT%TZ > "$STATE/setup.done"
  fi
  export SPECLAB_CACHE=$(cat "$STATE/cache_dir")
  deadline=$(( $(date +%s) + ${2:?minutes} * 60 ))
  setsid nohup python3 -m speclab.gpubench drive --state "$STATE" --deadline "$deadline" \
    --plan "${3:-timing-eagle31}" --rounds "${4:-5}" --warm "${WARM:-8}" --tokens "${TOKENS:-128}" > "$STATE/daemon.out" 2>&1 < /dev/null &
  echo "driver pid $! until $(date -d @$deadline +%T) (cache $SPECLAB_CACHE); setup $(( $(date +%s) - T0 )) s"
  sleep 20; tail -n 5 "$STATE/daemon.out" ;;
collect)
  # the results so far, each file whole, every $COPY_EVERY s (default 30) while waiting: a call
  # cut by its own time limit still brings back the latest
  copy_out() {
    for f in results.jsonl engines.jsonl driver.log env.json host.jsonl; do
      [ -f "$STATE/$f" ] && cp "$STATE/$f" "$OUT/.copying" && mv -f "$OUT/.copying" "$OUT/$f"
    done
  }
  end=$(( T0 + ${2:?seconds} )) last=0
  while [ "$(date +%s)" -lt "$end" ] && pgrep -f "speclab.gpubench drive" >/dev/null; do
    [ $(( $(date +%s) - last )) -ge "${COPY_EVERY:-30}" ] && { copy_out; last=$(date +%s); }
    sleep 5
  done
  copy_out
  tail -n 200 "$STATE/daemon.out" > "$OUT/daemon.out" 2>/dev/null
  (cd "$STATE" && tar czf "$OUT/.logs.tar.gz" logs steptiming 2>/dev/null)
  [ -e "$OUT/.logs.tar.gz" ] && mv -f "$OUT/.logs.tar.gz" "$OUT/logs.tar.gz"
  if [ "${3:-}" = jit ]; then
    bash tools/gpu/jit.sh save "$OUT/.jit.tar.gz" && [ -e "$OUT/.jit.tar.gz" ] \
      && mv -f "$OUT/.jit.tar.gz" "$OUT/jit-cache-vllm026.tar.gz"
  fi
  nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv,noheader
  pgrep -f "speclab.gpubench drive" >/dev/null && echo "driver still running" || echo "driver ended"
  tail -n 25 "$STATE/driver.log" ;;
*)
  sed -n 2,9p "$0"; exit 2 ;;
esac
