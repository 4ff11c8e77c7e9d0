#!/usr/bin/env bash
# Prompt-step CUDA graphs (prefill_graph_tokens) and the small-batch kernels on one GPU. Stages
# (STAGES, default "tests ttft latency", about 8 minutes; each call must end within 10):
#   tests    the GPU tests holding them to the eager engine and to HF (tests/engine/test_gpu.py:
#            graphs vs eager logits and cache, greedy vs HF with each on) and the kernels compiled;
#   ttft     TTFT of a 256-token prompt on an idle engine, eager and with graphs, a process each
#            (scripts/ttft_probe.py: host and GPU time of every phase);
#   latency  bench latency (batch 1, 128 in / 256 out) eager, with graphs, and with graphs and the
#            small-batch kernels (five a layer): TTFT, per token, the prompt step's host launch
#            calls, launches per decode step;
#   mixed    bench mixed by swap with graphs, the priority-preemption issue's workload:
#            interactive TTFT p50/p99 against the idle engine, bulk against bulk alone (~5 min);
#   probe    scripts/decode_graph_probe.py: each projection unfused against small_m_linear per
#            tile config, attention, the launch floor and a streaming read inside a graph (~4 min).
# Logs, JSON and summary.txt under $OUT.
#
#   OUT=$OUT SLUICEWAY_COMMIT=<commit> bash scripts/gpu_prefill_graphs.sh
#   STAGES="mixed probe" bash scripts/gpu_prefill_graphs.sh              # the second call
#   STAGES=mixed GRAPH_TOKENS=1024 bash scripts/gpu_prefill_graphs.sh   # the cache is the H200 runs' size on an H100 too (UTIL overrides)
#   STAGES=mixed MODES=swap,express MIXED_ARGS="--late-admission --swap-space 16" BULK=256 MIXED_TIMEOUT=420 \
#     bash scripts/gpu_prefill_graphs.sh   # late admission against the express lane, ~120 interactive jobs each
#   STAGES=mixed BUDGET=256 MIXED_ARGS="--no-async-scheduling" bash scripts/gpu_prefill_graphs.sh   # the p99
#       arithmetic's best case (docs/SWAP.md): bulk steps of ~12 ms, no step queued behind the one in flight
#
# Needs the worker's wheels (../shared/wheels-gpu) carried as .whl/ for the mixed stage.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_prefill_graphs_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton_cache
export SLUICEWAY_COMMIT=${SLUICEWAY_COMMIT:-$(git describe --always --dirty --abbrev=7 2>/dev/null || echo unknown)}
py=${PY:-python3}
tokens=${GRAPH_TOKENS:-512}
model=${MODEL:-llama3-8b}  # a preset with dummy weights (qwen3-0.6b: a quick check of this script on a CPU)
mkdir -p "$TRITON_CACHE_DIR"
# a Triton cache carried from an earlier call on the same image: no kernel compiles mid-run
[ -f .cache/triton_cache.tgz ] && tar xzf .cache/triton_cache.tgz -C "$TRITON_CACHE_DIR"
if ls .whl/*.whl >/dev/null 2>&1; then
  $py -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}

note() { echo "$*" | tee -a "$OUT/summary.txt"; }
note "== $(date -u '+%F %T UTC') commit $SLUICEWAY_COMMIT prefill_graph_tokens $tokens"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/summary.txt"

want() { case " $STAGES " in *" $1 "*) return 0;; esac; return 1; }
STAGES=${STAGES:-tests ttft latency}

want tests && timeout 240 $py -m pytest --noconftest -p no:cacheprovider -q -rf tests/kernels/test_rope_store.py \
  tests/kernels/test_small_m_linear.py tests/kernels/test_pdl.py \
  tests/engine/runner/test_rotary_backends.py tests/engine/test_gpu.py \
  -k "${TESTS_K:-rope_store or small_m or rotary or prefill_graphs or small_batch or gpu_llama8b or express or pdl}" > "$OUT/tests.log" 2>&1
want tests && note "tests: $(grep -E 'passed|failed|error' "$OUT/tests.log" | tail -1)"

want ttft && for graphs in 0 "$tokens"; do
  timeout 90 $py scripts/ttft_probe.py --model "$model" --input-len 256 --iters 5 --prefill-graph-tokens "$graphs" \
    > "$OUT/ttft-$graphs.txt" 2>&1
  note "ttft_probe 256 in, prefill_graph_tokens=$graphs: $(grep -iE 'ttft' "$OUT/ttft-$graphs.txt" | tail -3 | tr '\n' ' ')"
done

want latency && for run in "0" "$tokens" "$tokens --small-batch-kernels"; do
  tag=$(echo "$run" | tr -d ' -')
  timeout 120 $py -m bench latency --model "$model" --roofline --prefill-graph-tokens $run ${LATENCY_ARGS:-} \
    --json "$OUT/latency-$tag.json" \
    > "$OUT/latency-$tag.log" 2>&1
  note "latency, prefill_graph_tokens=$run: $(grep -E 'TTFT|prompt step|launches per decode' "$OUT/latency-$tag.log" | head -3 | tr '\n' ' ')"
done

if want mixed; then
  # the KV cache of the H200 runs (12.6k blocks): 0.30 of an H200 is 0.53 of an H100
  util=0.30; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100 && util=0.53
  timeout "${MIXED_TIMEOUT:-300}" $py -m bench mixed --model "$model" --load-format dummy --dtype bfloat16 \
    --gpu-memory-utilization "${UTIL:-$util}" --max-num-batched-tokens "${BUDGET:-512}" --bulk-requests "${BULK:-128}" \
    --modes "${MODES:-swap}" --prefill-graph-tokens "$tokens" --json "$OUT/mixed.json" ${MIXED_ARGS:-} \
    > "$OUT/mixed.log" 2>&1
  [ -f "$OUT/mixed.json" ] && $py - "$OUT/mixed.json" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
r = json.load(open(sys.argv[1]))
idle = r["idle"]["ttft_p50_s"]
for mode, run in r["runs"].items():
    i = run["interactive"]
    print(f"mixed {mode}: idle TTFT p50 {1e3 * idle:.1f} ms; TTFT p50 {1e3 * i['ttft_p50_s']:.1f} / "
          f"p99 {1e3 * i['ttft_p99_s']:.1f} ms ({run['ttft_p99_vs_idle']:.2f}x idle); "
          f"bulk {run['bulk']['output_tok_s']:.0f} tok/s ({run['bulk_vs_alone']:.3f}x alone)")
    print(" stages p50/p99 ms:", {k: [round(1e3 * (v['p50_s'] or 0), 1), round(1e3 * (v['p99_s'] or 0), 1)]
                                  for k, v in i.get("stages", {}).items() if k != "slowest"})
    print(" steps:", json.dumps(run.get("steps", {}))[:600])
    print(" interactive jobs' own steps:", json.dumps(run.get("interactive_first_steps")))
    print(" stats:", {k: run.get("stats", {}).get(k) for k in ("num_express", "num_rank_preemptions", "num_preemptions")},
          "ttft p90/p95:", [i.get(k) for k in ("ttft_p90_s", "ttft_p95_s")], "jobs", i.get("jobs"))
    print(" step loop:", run.get("step_loop"))
PY
  grep "slow job" "$OUT/mixed.log" | cut -c1-700 | tee -a "$OUT/summary.txt"  # with MIXED_ARGS=--sample-stacks
fi
if want probe; then  # issue 23: small-batch matmuls, the launch floor and a streaming read inside a graph
  timeout 240 $py scripts/decode_graph_probe.py --min-partitions 128 --json "$OUT/probe.json" \
    > "$OUT/probe.log" 2>&1
  note "probe: $(grep -E '^(floor|read|qkv|o |gate_up|down)' "$OUT/probe.log" | tr '\n' ';')"
fi
[ -f "$OUT/tests.log" ] && tail -5 "$OUT/tests.log"
# the kernels compiled here, for the next call to carry as .cache/triton_cache.tgz (no compile mid-run)
tar czf "$OUT/triton_cache.tgz" -C "$TRITON_CACHE_DIR" . 2>/dev/null
