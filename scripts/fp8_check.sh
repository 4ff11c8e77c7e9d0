#!/usr/bin/env bash
# One device call for the FP8 path: GPU tests, the GEMM probe, and A/B benches (bf16 against
# --quantization fp8 --kv-cache-dtype fp8) in the same call. Logs and JSON go under $OUT.
#
#   STAGES="tests probe latency throughput" bash scripts/fp8_check.sh
#
# Stages: tests (the FP8 GPU tests and kernel tests, compiled), probe (scripts/fp8_gemm_probe.py),
# latency and throughput (bf16, then fp8; --roofline), kernels (python -m bench.kernels in CUDA
# graphs, bf16 then float8 cache), throughput70b (llama3-70b in fp8; THROUGHPUT70B_ARGS adds flags). A Triton cache carried as .cache/triton_cache.tgz is used.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fp8_check_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton_cache NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export SLUICEWAY_COMMIT=${SLUICEWAY_COMMIT:-unknown}
STAGES=${STAGES:-"tests probe latency throughput"}
FP8="--quantization fp8 --kv-cache-dtype fp8"
py=python3
mkdir -p "$TRITON_CACHE_DIR"
[ -f .cache/triton_cache.tgz ] && tar xzf .cache/triton_cache.tgz -C "$TRITON_CACHE_DIR"
note() { echo "$*" | tee -a "$OUT/summary.txt"; }
note "== $(date -u '+%F %T UTC') commit $SLUICEWAY_COMMIT stages: $STAGES"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,power.limit --format=csv,noheader | tee -a "$OUT/summary.txt"
$py -c 'import torch, triton, transformers, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "transformers", transformers.__version__)' | tee -a "$OUT/summary.txt"
for stage in $STAGES; do
  start=$(date +%s)
  case $stage in
    tests)
      timeout 240 $py -m pytest --noconftest -p no:cacheprovider -q -rf -s tests/kernels/test_fp8_quant.py \
        tests/kernels/test_fp8_small_m.py ${TEST_ARGS:-tests/kernels/test_rms_norm.py tests/kernels/test_silu_mul.py} \
        tests/engine/test_fp8_gpu.py 2>&1 | tee -a "$OUT/tests.log" | grep -E "relative error|passed|failed|Error" | tail -12;;
    probe)
      timeout 150 $py scripts/fp8_gemm_probe.py ${PROBE_ARGS:-} --json "$OUT/probe.json" 2>&1 | tee -a "$OUT/probe.log";;
    latency)
      for q in bf16 fp8; do
        flags=""; [ $q = fp8 ] && flags=$FP8
        timeout 150 $py -m bench latency --roofline $flags --json "$OUT/latency_$q.json" 2>&1 \
          | tee -a "$OUT/bench.log" | grep -E "^(latency|  )" | tail -5
      done;;
    throughput)
      for q in bf16 fp8; do
        flags=""; [ $q = fp8 ] && flags=$FP8
        timeout 220 $py -m bench throughput --roofline $flags --json "$OUT/throughput_$q.json" 2>&1 \
          | tee -a "$OUT/bench.log" | grep -E "^(throughput|  )" | tail -5
      done;;
    kernels)  # item 5: every kernel timed inside a CUDA graph, bf16 cache then float8
      for kv in auto fp8; do
        timeout 200 $py -m bench.kernels --only store,decode,prefill,pointwise --kv-cache-dtype $kv \
          --json "$OUT/kernels_$kv.json" 2>&1 | tee -a "$OUT/kernels.log" | tail -40
      done;;
    throughput70b)
      timeout 240 $py -m bench throughput --model llama3-70b --roofline $FP8 ${THROUGHPUT70B_ARGS:-} \
        --json "$OUT/throughput_70b_fp8.json" 2>&1 | tee -a "$OUT/bench.log" | grep -E "^(throughput|  )" | tail -5;;
    *) note "unknown stage $stage";;
  esac
  note "stage $stage: $(( $(date +%s) - start )) s"
done
tar czf "$OUT/triton_cache.tgz" -C "$TRITON_CACHE_DIR" . 2>/dev/null
