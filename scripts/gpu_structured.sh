#!/usr/bin/env bash
# Structured outputs at speed, one device call (dummy llama3-8b, bf16): the throughput workload
# with every request constrained by one grading JSON schema, then by 64 distinct ones, and
# batch-1 latency; each call also runs the same workload unconstrained at the lengths the
# constrained run reached (bench/structured.py says why) and reports the ratio. Targets:
# throughput >= 0.95x (1 schema) and >= 0.90x (64 schemas); batch 1 at most 1.05x the time
# per token. Logs and JSON under $OUT; the ratios are printed last.
#
#   bash scripts/gpu_structured.sh                       # on the H200, from the repo root
#   STAGES="plain schema1 schema64 latency" bash scripts/gpu_structured.sh
#
# xgrammar is not in the GPU image: its wheels (.whl/, carried) are installed into $SITE first.
# The bench tokenizer (a BPE of llama3's 128,256 ids) is built once into $SLUICEWAY_BENCH_CACHE.
# CPU check of the same commands on a tiny model: MODEL=/path/to/tiny DTYPE=float32 SMALL=1
# TOKENIZER=/path/to/tiny bash scripts/gpu_structured.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_structured_out}
SITE=${SITE:-/tmp/site}
mkdir -p "$OUT" "$SITE"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache} NCCL_NVLS_ENABLE=0
export SLUICEWAY_BENCH_CACHE=${SLUICEWAY_BENCH_CACHE:-/tmp/sluiceway_bench_cache}
export SLUICEWAY_COMMIT=${SLUICEWAY_COMMIT:-$(git describe --always --dirty --abbrev=7 2>/dev/null || echo unknown)}
py=${PY:-python3}
STAGES=${STAGES:-"schema1 schema64 latency"}
MODEL=${MODEL:-llama3-8b}
DTYPE=${DTYPE:-bfloat16}
if ls .whl/*.whl > /dev/null 2>&1 && ! PYTHONPATH=$SITE $py -c 'import xgrammar' 2> /dev/null; then
  $py -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
common=(--model "$MODEL" --dtype "$DTYPE")
[ -n "${TOKENIZER:-}" ] && common+=(--structured-tokenizer "$TOKENIZER")
if [ -n "${SMALL:-}" ]; then  # the CPU check: a few short requests
  tput=(-n 16 --input-len 16 --output-len 48 --max-num-seqs 8 --structured-string-len 60)
  lat=(--input-len 16 --output-len 48 --num-iters 2 --structured-string-len 60)
else
  tput=(); lat=()
fi

note() { echo "$*" | tee -a "$OUT/summary.txt"; }
run() {  # run NAME BENCH ARGS...
  local name=$1; shift
  timeout "${STAGE_TIMEOUT:-420}" $py -m bench "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  note "$name (rc $?): $(grep -E 'structured|output tok/s|per output token' "$OUT/$name.log" | tail -1 | sed 's/^ *//')"
}
note "== $(date -u '+%F %T UTC') commit $SLUICEWAY_COMMIT stages: $STAGES"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee -a "$OUT/summary.txt"
for stage in $STAGES; do
  case $stage in
    plain) run plain throughput "${common[@]}" "${tput[@]}" ;;
    schema1) run schema1 throughput "${common[@]}" "${tput[@]}" --structured json-schema ;;
    schema64) run schema64 throughput "${common[@]}" "${tput[@]}" --structured json-schema --structured-distinct 64 ;;
    latency) run latency latency "${common[@]}" "${lat[@]}" --structured json-schema ;;
    *) note "unknown stage $stage" ;;
  esac
done
$py - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for name, target in (("schema1", 0.95), ("schema64", 0.90)):
    path = out / f"{name}.json"
    if path.exists():
        r = json.loads(path.read_text())
        s = r["structured"]
        print(f"{name}: constrained {r['engine']['output_tok_s']:.0f} / unconstrained {s['unconstrained']['output_tok_s']:.0f} "
              f"output tok/s = {s['ratio']:.3f} (target >= {target}); {s['constrained_finished_stop']} of "
              f"{r['engine']['num_requests']} ended complete, {r['engine']['output_tokens']} tokens")
path = out / "latency.json"
if path.exists():
    s = json.loads(path.read_text())["structured"]
    print(f"latency: {s['constrained_itl_ms_mean']:.3f} ms per token constrained vs {s['unconstrained_itl_ms_mean']:.3f} "
          f"unconstrained = {s['itl_ratio']:.3f}x (target <= 1.05)")
EOF
