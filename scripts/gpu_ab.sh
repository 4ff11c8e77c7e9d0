#!/usr/bin/env bash
# A/B of two checkouts in one device call: the throughput and latency benches of OLD and NEW,
# interleaved (old, new, new, old) so that clock drift favours neither; then NEW's GPU tests
# (TESTS, pytest paths; none when empty). Logs and JSON under $OUT, a summary line per run.
#
#   OLD=.ab_old NEW=. TESTS="tests/engine/test_gpu.py" bash scripts/gpu_ab.sh
#
# THROUGHPUT_ARGS / LATENCY_ARGS add flags to both sides (the same workload on each).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_ab_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton_cache
py=${PY:-python3}
site=${SITE:-}
old=$(cd "${OLD:?OLD checkout}" && pwd); new=$(cd "${NEW:-.}" && pwd)

note() { echo "$*" | tee -a "$OUT/summary.txt"; }
bench() {  # bench SIDE WORKLOAD EXTRA...
  local dir=$1 side=$2 workload=$3; shift 3
  local module=bench; [ -d "$dir/bench" ] || module=engine.bench  # before bench/ left the engine
  (cd "$dir" && SLUICEWAY_COMMIT=$(cat "$dir/.commit" 2>/dev/null) PYTHONPATH="$dir${site:+:$site}" timeout 300 $py -m $module "$workload" --json "$OUT/$side-$workload.json" "$@" \
     > "$OUT/$side-$workload.log" 2>&1)
  note "$side $workload: $(grep -E 'output tok/s|per output token' "$OUT/$side-$workload.log" | head -1 | sed 's/^ *//')"
}
note "== $(date -u '+%F %T UTC') old $(cat "$old/.commit" 2>/dev/null) new $(cat "$new/.commit" 2>/dev/null)"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee -a "$OUT/summary.txt"
bench "$old" old throughput ${THROUGHPUT_ARGS:-}
bench "$new" new throughput ${THROUGHPUT_ARGS:-}
bench "$new" new latency ${LATENCY_ARGS:-}
bench "$old" old latency ${LATENCY_ARGS:-}
if [ -n "${TESTS:-}" ]; then
  (cd "$new" && PYTHONPATH="$new${site:+:$site}" timeout ${TESTS_TIMEOUT:-240} $py -m pytest --noconftest -p no:cacheprovider -q -rf \
     -m gpu $TESTS > "$OUT/tests.log" 2>&1)
  note "tests: $(grep -E 'passed|failed|error' "$OUT/tests.log" | tail -1)"
fi
