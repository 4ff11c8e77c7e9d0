#!/usr/bin/env bash
# One device call that runs what the card it landed on is for (issues 22, 23, 28): on an H200 the
# steps named by H200, on an H100 those named by H100 (both default to "targets"). Everything
# under $OUT ends up in $OUT/all.tgz (TorchInductor's and Triton's caches beside it), also when the
# steps run past LIMIT seconds (default 570).
# Steps:
#   targets   issues 22 and 23 on one card: the throughput workload bf16 and FP8 (15,500 tok/s and
#             1.42x), batch 1 bf16, FP8, the five-kernel layer and the norms and SiLU-mul in o's and
#             down's launches (4.2 ms, 380 tok/s, at most 200 launches), then gpt-fast at batch 1
#             (1.2x; its compile takes 147-213 s of the call without .cache/inductor.tgz)
#   mixed     issue 28's bench mixed four ways (MODES; --swap-space auto, the cache of 7,969 blocks)
#   sweep     scripts/decode_split_sweep.py: decode attention per tile, split and EARLY_READS (issue 23)
#   early     bench latency with EARLY_READS off and on (a stage of scripts/gpu_small_batch_ab.sh)
#   swap      bench swap (swap against recompute), swaptests the GPU swap tests
#   tput, pdl, splits, gptfast   those stages of scripts/gpu_small_batch_ab.sh (with their settings here)
#   any other: that stage of scripts/gpu_small_batch_ab.sh as it runs there (fp8silu, tests, gputests, ...)
#
#   SLUICEWAY_COMMIT=<commit> H200="targets" H100="tput" bash scripts/gpu_dispatch.sh   # the first H200 call
#   SLUICEWAY_COMMIT=<commit> H200="mixed" bash scripts/gpu_dispatch.sh                  # the second
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_dispatch_out}
mkdir -p "$OUT/w"
if [ -z "${_DISPATCH_INNER:-}" ]; then  # the steps under one limit, so that the tar below always runs
  OUT=$OUT _DISPATCH_INNER=1 timeout -k 5 "${LIMIT:-570}" bash "$0"
  echo "== steps ended (rc $?) $(date -u '+%T UTC')"
  # the caches the stages hand back travel beside the logs, one of each (16 MiB a file comes back)
  find "$OUT/w" -name inductor.tgz | head -1 | xargs -r -I{} mv {} "$OUT/inductor.tgz"
  find "$OUT/w" -name triton_cache.tgz | tail -1 | xargs -r -I{} mv {} "$OUT/triton_cache.tgz"
  find "$OUT/w" -name '*.tgz' -delete
  tar czf "$OUT/all.tgz" -C "$OUT/w" . && rm -rf "$OUT/w"
  exit 0
fi
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "gpu: $gpu; commit ${SLUICEWAY_COMMIT:-unknown}; $(date -u '+%F %T UTC')"
case $gpu in *H200*) plan=${H200:-targets};; *) plan=${H100:-targets};; esac
for step in $plan; do
  start=$(date +%s)
  case $step in
    targets) OUT=$OUT/w/targets STAGES="tput pdl folds gptfast" TPUT_RUNS="on fp8_on" PDL_RUNS="on fp8_on five_on five_tiles" \
      FOLDS="silu_in,norm_after" \
      GPTFAST_TIMEOUT=${GPTFAST_TIMEOUT:-300} bash scripts/gpu_small_batch_ab.sh;;
    mixed) OUT=$OUT/w/mixed STAGES=mixed MODES=${MODES:-fcfs,swap,recompute,express} UTIL=0.42 BUDGET=512 \
      BULK=${BULK:-192} MIXED_TIMEOUT=${MIXED_TIMEOUT:-540} \
      MIXED_ARGS="--late-admission --swap-space ${SWAP:-auto} --num-gpu-blocks 7969 ${MIXED_EXTRA:-}" \
      bash scripts/gpu_prefill_graphs.sh 2>&1 | tail -30;;
    sweep) mkdir -p "$OUT/w/sweep"; timeout "${SWEEP_TIMEOUT:-150}" python3 scripts/decode_split_sweep.py \
      --json "$OUT/w/sweep/sweep.json" > "$OUT/w/sweep/sweep.log" 2>&1; grep -E "^copy|^default|^best" "$OUT/w/sweep/sweep.log";;
    swap) OUT=$OUT/w/swap bash scripts/gpu_swap_check.sh 2>&1 | tail -20;;
    swaptests) OUT=$OUT/w/swaptests STAGES=tests bash scripts/gpu_swap_check.sh 2>&1 | tail -8;;
    tput) OUT=$OUT/w/tput STAGES=tput TPUT_RUNS=${TPUT_RUNS:-"off on"} bash scripts/gpu_small_batch_ab.sh;;
    pdl) OUT=$OUT/w/pdl STAGES=pdl PDL_RUNS=${PDL_RUNS:-"on preload all_preload late"} bash scripts/gpu_small_batch_ab.sh;;
    splits) OUT=$OUT/w/splits STAGES=splits SWEEP="" MIN_PARTITIONS=${MIN_PARTITIONS:-128} bash scripts/gpu_small_batch_ab.sh;;
    gptfast) OUT=$OUT/w/gptfast STAGES=gptfast bash scripts/gpu_small_batch_ab.sh;;
    *) OUT=$OUT/w/$step STAGES=$step bash scripts/gpu_small_batch_ab.sh;;  # any stage of that script
  esac
  echo "== step $step: $(( $(date +%s) - start )) s"
done
