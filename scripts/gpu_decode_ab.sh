#!/usr/bin/env bash
# Batch-1 decode A/B of two checkouts in one device call, most important first, so that a
# call cut short still brings back what matters: NEW's kernel GPU tests, the decode-kernel
# probe (scripts/decode_graph_probe.py) on NEW then OLD, latency NEW then OLD (with launch
# counts where the checkout reports them), a short throughput A/B, then gpt-fast (PEER: the
# folder holding gptfast_latency.py; skipped when unset or when BUDGET_S is nearly spent).
# Everything that matters goes into $OUT/0-summary.txt as it comes (a device call brings back
# only a few files); the logs and JSON are packed into $OUT/logs.tar.gz at the end.
#
#   OLD=/path/to/main NEW=. SITE=/tmp/site PEER=peers BUDGET_S=400 bash scripts/gpu_decode_ab.sh
set -uo pipefail
cd "$(dirname "$0")/.."
FINAL=${OUT:-/tmp/gpu_decode_out}
OUT=$FINAL/logs
mkdir -p "$OUT"
trap 'tar -C "$FINAL" -czf "$FINAL/logs.tar.gz" logs && rm -rf "$OUT"' EXIT
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton_cache
py=${PY:-python3}
site=${SITE:-}
budget=${BUDGET_S:-400}
old=$(cd "${OLD:?OLD checkout}" && pwd); new=$(cd "${NEW:-.}" && pwd)
note() { echo "$*" | tee -a "$FINAL/0-summary.txt"; }
left() { echo $(( budget - SECONDS )); }
bench() {  # bench DIR SIDE WORKLOAD ARGS...
  local dir=$1 side=$2 workload=$3; shift 3
  (cd "$dir" && PYTHONPATH="$dir${site:+:$site}" timeout 150 $py -m bench "$workload" --json "$OUT/$side-$workload.json" "$@" \
     > "$OUT/$side-$workload.log" 2>&1)
  note "$side $workload ($SECONDS s): $(grep -E 'output tok/s|per output token|launches|roofline' "$OUT/$side-$workload.log" | sed 's/^ *//' | tr '\n' ' ')"
}
note "== $(date -u '+%F %T UTC') old ${OLD_LABEL:-$old} new ${NEW_LABEL:-$new}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee -a "$FINAL/0-summary.txt"
$py -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$FINAL/0-summary.txt"
(cd "$new" && PYTHONPATH="$new${site:+:$site}" timeout 150 $py -m pytest --noconftest -p no:cacheprovider -q -rf \
   tests/kernels/test_rope_decode_attention.py tests/kernels/test_paged_decode_attention.py tests/kernels/test_silu_mul_gemv.py \
   tests/engine/runner/test_attention_split.py tests/engine/runner/test_rotary_backends.py > "$OUT/tests.log" 2>&1)
note "tests ($SECONDS s): $(grep -E 'passed|failed|error' "$OUT/tests.log" | tail -1)"
grep -E '^(FAILED|ERROR)' "$OUT/tests.log" >> "$FINAL/0-summary.txt"
(cd "$new" && PYTHONPATH="$new${site:+:$site}" timeout 120 $py scripts/decode_graph_probe.py --json "$OUT/probe-new.json" \
   > "$OUT/probe-new.log" 2>&1)
note "probe new ($SECONDS s)"; cat "$OUT/probe-new.log" >> "$FINAL/0-summary.txt"
bench "$new" new latency --roofline
bench "$old" old latency --roofline
(cd "$old" && PYTHONPATH="$old${site:+:$site}" timeout 90 $py "$new/scripts/decode_graph_probe.py" --skip-gemv \
   --json "$OUT/probe-old.json" > "$OUT/probe-old.log" 2>&1)
note "probe old ($SECONDS s)"; cat "$OUT/probe-old.log" >> "$FINAL/0-summary.txt"
bench "$new" new throughput ${THROUGHPUT_ARGS:--n 256 --output-len 128}
bench "$old" old throughput ${THROUGHPUT_ARGS:--n 256 --output-len 128}
if [ -n "${PEER:-}" ] && [ "$(left)" -gt 250 ]; then  # it compiled for over 170 s once
  (GF_MODEL=llama-3-8b timeout $(( $(left) - 10 )) $py "$PEER/gptfast_latency.py" > "$OUT/gptfast.log" 2>&1)
  note "gpt-fast ($SECONDS s): $(tail -1 "$OUT/gptfast.log")"
else
  note "gpt-fast skipped: $(left) s of the budget left"
fi
