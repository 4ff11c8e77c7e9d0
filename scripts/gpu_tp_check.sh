#!/usr/bin/env bash
# Tensor parallelism on a two-GPU machine (nvidia-h200-x2), one stage per device call so
# that each fits the call's limit. Logs and JSON go under $OUT; a summary line per stage.
#
#   STAGES=tests      bash scripts/gpu_tp_check.sh   # TP=2 vs TP=1 greedy, NCCL failure paths (~3 min)
#   STAGES=scaling    bash scripts/gpu_tp_check.sh   # llama3-8b throughput at TP=1 and TP=2 (~6 min)
#   STAGES=big        bash scripts/gpu_tp_check.sh   # llama3-70b throughput at TP=2 (~6 min)
#
# SCALING_ARGS / BIG_ARGS add flags to `python -m bench.tp` (e.g. "-n 512",
# "--no-async-scheduling" to compare with synchronous steps).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_tp_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton_cache NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export SLUICEWAY_COMMIT=${SLUICEWAY_COMMIT:-$(git describe --always --dirty --abbrev=7 2>/dev/null || echo unknown)}
STAGES=${STAGES:-tests}
py=${PY:-python3}
mkdir -p "$TRITON_CACHE_DIR"
[ -f .cache/triton_cache.tgz ] && tar xzf .cache/triton_cache.tgz -C "$TRITON_CACHE_DIR"

note() { echo "$*" | tee -a "$OUT/summary.txt"; }
note "== $(date -u '+%F %T UTC') commit $SLUICEWAY_COMMIT stages: $STAGES"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee -a "$OUT/summary.txt"
nvidia-smi topo -m 2>/dev/null | head -4 | tee -a "$OUT/summary.txt"

for stage in $STAGES; do
  start=$(date +%s)
  case $stage in
    tests)
      timeout 540 $py -m pytest --noconftest -p no:cacheprovider -q -rf -o faulthandler_timeout=240 -m gpu tests/engine/executor/test_tensor_parallel_gpu.py \
        2>&1 | tee -a "$OUT/tests.log" | tail -25
      note "tests: $(grep -E 'passed|failed|error|skipped' "$OUT/tests.log" | tail -1)";;
    scaling)
      timeout 570 $py -m bench.tp --big-model none --json "$OUT/tp_scaling.json" ${SCALING_ARGS:-} \
        2>&1 | tee -a "$OUT/bench.log" | grep -E '^(tp|  )' | tail -4;;
    big)
      timeout 570 $py -m bench.tp --tp none --json "$OUT/tp_big.json" ${BIG_ARGS:-} \
        2>&1 | tee -a "$OUT/bench.log" | grep -E '^(tp|  )' | tail -3;;
    *) note "unknown stage $stage";;
  esac
  note "stage $stage: $(( $(date +%s) - start )) s"
done
grep -E '^  .*TP=' "$OUT/bench.log" 2>/dev/null | tee -a "$OUT/summary.txt"
tar czf "$OUT/triton_cache.tgz" -C "$TRITON_CACHE_DIR" . 2>/dev/null
