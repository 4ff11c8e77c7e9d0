#!/usr/bin/env bash
# Interactive traffic over a bulk backlog that fills the KV cache, through Redis and a worker, on
# one GPU (nvidia-h200): llama3-8b, bf16, dummy weights, at a GPU memory fraction small enough
# that the backlog fills the cache. Runs `sluiceway bench mixed` three ways -- fcfs (no
# preemption for rank), preemption by swap, by recompute -- with the idle-engine TTFT and
# bulk-alone baselines, and prints the JSON summary last. Logs and JSON go under $OUT.
#
#   bash scripts/gpu_mixed.sh                          # all three modes in one call (~6 min)
#   MODES=swap bash scripts/gpu_mixed.sh               # one mode per call (each ~3 min)
#   MIXED_ARGS="--bulk-requests 64" bash scripts/gpu_mixed.sh
#   MIXED_ARGS="--swap-space 16" bash scripts/gpu_mixed.sh   # a fixed pool (default: auto)
#   BUDGET=4096 bash scripts/gpu_mixed.sh             # the step token budget (default 1,024)
#   MODES=swap,recompute MIXED_ARGS="--swap-space 32" bash scripts/gpu_mixed.sh   # a fixed pool: no
#                                                      # pinning or unpinning while jobs run
#
# Needs the worker's wheels (../shared/wheels-gpu, README there) carried as .whl/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_mixed_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton_cache
export SLUICEWAY_COMMIT=${SLUICEWAY_COMMIT:-$(git describe --always --dirty --abbrev=7 2>/dev/null || echo unknown)}
py=${PY:-python3}
MODES=${MODES:-fcfs,swap,recompute}
mkdir -p "$TRITON_CACHE_DIR"
[ -f .cache/triton_cache.tgz ] && tar xzf .cache/triton_cache.tgz -C "$TRITON_CACHE_DIR"
if ls .whl/*.whl >/dev/null 2>&1; then
  $py -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}

note() { echo "$*" | tee -a "$OUT/summary.txt"; }
note "== $(date -u '+%F %T UTC') commit $SLUICEWAY_COMMIT modes: $MODES"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/summary.txt"
free -g | head -2 | tee -a "$OUT/summary.txt"

# NOTE: the step budget bounds how long an arriving interactive job waits for the steps in
# flight (a step carrying a bulk prefill chunk of B tokens takes about B x 16 GFLOP of compute):
# 1,024 keeps such a step near 30 ms on an H200; the bulk-alone baseline runs at the same budget.
# BUDGET=8192 gives the engine's best bulk throughput and the longest waits.
start=$(date +%s)
timeout 590 $py -m bench mixed --model llama3-8b --load-format dummy --dtype bfloat16 \
  --gpu-memory-utilization 0.30 --max-num-batched-tokens "${BUDGET:-1024}" --bulk-requests 128 \
  --modes "$MODES" --json "$OUT/mixed.json" ${MIXED_ARGS:-} 2>&1 | tee -a "$OUT/bench.log" | grep -E '^(mixed|  |#)'
note "bench mixed: $(( $(date +%s) - start )) s"

[ -f "$OUT/mixed.json" ] && $py - "$OUT/mixed.json" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
r = json.load(open(sys.argv[1]))
out = {"gpu_blocks": r["num_gpu_blocks"], "idle_ttft_p50_ms": 1e3 * (r["idle"]["ttft_p50_s"] or 0),
       "bulk_alone_tok_s": {m: a["bulk"]["output_tok_s"] for m, a in r["bulk_alone"].items()}, "modes": {}}
for mode, run in r["runs"].items():
    i, b, st, pool = run["interactive"], run["bulk"], run["stats"], run["swap_pool"]
    out["modes"][mode] = {
        "ttft_p50_ms": 1e3 * (i["ttft_p50_s"] or 0), "ttft_p99_ms": 1e3 * (i["ttft_p99_s"] or 0),
        "ttft_p99_vs_idle": run["ttft_p99_vs_idle"], "tpot_p50_ms": 1e3 * (i["tpot_p50_s"] or 0),
        "tpot_p99_ms": 1e3 * (i["tpot_p99_s"] or 0), "interactive_jobs": i["done"],
        "bulk_tok_s": b["output_tok_s"], "bulk_vs_alone": run["bulk_vs_alone"],
        "preemptions": st.get("num_preemptions"), "rank_preemptions": st.get("num_rank_preemptions"),
        "recomputes": st.get("num_recomputes"), "swap_gb_moved": run["swap_gb_moved"],
        "swap_time": {k: run["swap_time"].get(k) for k in ("host_s", "device_out_s", "device_in_s",
                                                           "compute_wait_s", "chunks_pinned_ahead",
                                                           "chunks_pinned_in_step", "resizes",
                                                           "resize_s_total", "resize_s_max")},
        "pool_gib": [pool["pool_gib_min"], pool["pool_gib_max"], pool["pool_gib_last"]],
        "pool_over_time_gib": [(s["t"], round(s["pool_bytes"] / 2**30, 2)) for s in pool["samples"][::4]],
        # where the wait for the first token went: enqueued -> read -> ready -> admitted -> scheduled -> first token
        "stages_p50_p99_ms": {k: [round(1e3 * (v["p50_s"] or 0), 1), round(1e3 * (v["p99_s"] or 0), 1)]
                              for k, v in i.get("stages", {}).items() if k != "slowest"},
        "slowest_ms": [{k: round(1e3 * v, 1) if k != "at_s" else v for k, v in job.items()}
                       for job in i.get("stages", {}).get("slowest", [])],
    }
print(json.dumps(out, indent=1))
PY
