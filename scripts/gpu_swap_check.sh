#!/usr/bin/env bash
# Swap on one GPU (nvidia-h200), one stage per device call so that each fits the call's limit.
# Logs and JSON go under $OUT; a summary is printed last.
#
#   bash scripts/gpu_swap_check.sh                   # bench swap (~7 min): batched copy GB/s both
#                                                    # ways, then 256 x 2048 in / 512 out on llama3-8b
#                                                    # (dummy weights) with a quarter of the KV it
#                                                    # needs, under swap and recompute, and unlimited
#   STAGES=tests bash scripts/gpu_swap_check.sh      # the GPU swap tests (~2 min)
#   SWAP_ARGS="-n 128" bash scripts/gpu_swap_check.sh   # half the workload
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_swap_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton_cache
export SLUICEWAY_COMMIT=${SLUICEWAY_COMMIT:-$(git describe --always --dirty --abbrev=7 2>/dev/null || echo unknown)}
STAGES=${STAGES:-bench}
py=${PY:-python3}
mkdir -p "$TRITON_CACHE_DIR"
[ -f .cache/triton_cache.tgz ] && tar xzf .cache/triton_cache.tgz -C "$TRITON_CACHE_DIR"

note() { echo "$*" | tee -a "$OUT/summary.txt"; }
note "== $(date -u '+%F %T UTC') commit $SLUICEWAY_COMMIT stages: $STAGES"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/summary.txt"
free -g | head -2 | tee -a "$OUT/summary.txt"

for stage in $STAGES; do
  start=$(date +%s)
  case $stage in
    tests)
      timeout 150 $py -m pytest --noconftest -p no:cacheprovider -q -rf -m gpu tests/engine/test_swap_gpu.py \
        2>&1 | tee -a "$OUT/tests.log" | tail -15
      note "tests: $(grep -E 'passed|failed|error|skipped' "$OUT/tests.log" | tail -1)";;
    bench)
      timeout 560 $py -m bench.swap swap --json "$OUT/swap.json" ${SWAP_ARGS:-} \
        2>&1 | tee -a "$OUT/bench.log" | grep -E '^(swap|  )' | tail -12;;
    *) note "unknown stage $stage";;
  esac
  note "stage $stage: $(( $(date +%s) - start )) s"
done

[ -f "$OUT/swap.json" ] && $py - "$OUT/swap.json" <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys
r = json.load(open(sys.argv[1]))
c = r.get("copies", {})
for name in ("runs", "scattered", "naive"):
    if name in c:
        print(f"copies {name}: out {c[name]['swap_out_gbs']:.1f} GB/s, in {c[name]['swap_in_gbs']:.1f} GB/s")
if "overlap" in c:
    print(f"swap-out hidden behind compute: {100 * c['overlap']['hidden_fraction']:.0f}%")
for mode, run in r.get("runs", {}).items():
    if "error" in run:
        print(f"{mode}: {run['error']}")
        continue
    e, s = run["engine"], run["stats"]
    print(f"{mode}: {e['output_tok_s']:.0f} out tok/s in {e['elapsed_s']:.1f} s; {s['num_swap_outs']} swap-outs, "
          f"{s['num_recomputes']} recomputes, {(s['swap_out_bytes'] + s['swap_in_bytes']) / 1e9:.1f} GB moved")
EOF
