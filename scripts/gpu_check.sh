#!/usr/bin/env bash
# One device call: the GPU tests (kernels, engine), then the latency and throughput benches.
# Logs and JSON go under $OUT (at most 8 files come back); a short table is printed last.
#
#   STAGES="tests latency throughput" bash scripts/gpu_check.sh
#
# Stages: tests (pytest -m gpu: tests/kernels, tests/engine/test_gpu.py, runner/test_sampler.py, test_sampling_gpu.py and test_kv_cache_dtype.py, runner/test_attention_split.py), kernels_all
# (every kernel test and the kernel bench's, compiled), latency, throughput (with --peer hf --roofline), and
# throughput256 (max_num_seqs 256), throughput_eager, latency_async and throughput_async (the
# same with --async-scheduling; throughput_async without the HF peer), worker and worker_async
# (python -m bench worker). THROUGHPUT_ARGS / LATENCY_ARGS / WORKER_ARGS add flags. GPU clocks,
# temperature and power are sampled every second into $OUT/clocks.csv. PROFILE_STEPS=none
# turns the throughput stage's profile off. A Triton cache carried as .cache/triton_cache.tgz
# is unpacked first and the updated one is written back to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton_cache NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export SLUICEWAY_COMMIT=${SLUICEWAY_COMMIT:-$(git describe --always --dirty --abbrev=7 2>/dev/null || echo unknown)}
STAGES=${STAGES:-"tests latency throughput"}
py=${PY:-python3}
mkdir -p "$TRITON_CACHE_DIR"
[ -f .cache/triton_cache.tgz ] && tar xzf .cache/triton_cache.tgz -C "$TRITON_CACHE_DIR"

note() { echo "$*" | tee -a "$OUT/summary.txt"; }
note "== $(date -u '+%F %T UTC') commit $SLUICEWAY_COMMIT stages: $STAGES"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$OUT/summary.txt"
$py -c 'import torch, triton, transformers, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "transformers", transformers.__version__)' | tee -a "$OUT/summary.txt"

nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,temperature.gpu,power.draw,utilization.gpu \
  --format=csv,noheader -l 1 > "$OUT/clocks.csv" 2>/dev/null &
clocks_pid=$!

pytest() { timeout "$1" $py -m pytest --noconftest -p no:cacheprovider -q -rf "${@:2}"; }
for stage in $STAGES; do
  start=$(date +%s)
  case $stage in
    tests)
      pytest 300 -m gpu tests/kernels tests/engine/test_gpu.py tests/engine/runner/test_sampler.py tests/engine/test_sampling_gpu.py tests/engine/test_kv_cache_dtype.py tests/engine/runner/test_attention_split.py 2>&1 | tee -a "$OUT/tests.log" | tail -25
      note "tests: $(grep -E 'passed|failed|error|skipped' "$OUT/tests.log" | tail -1)";;
    kernels_all)
      pytest 240 -x tests/kernels tests/bench/test_kernels.py 2>&1 | tee -a "$OUT/tests.log" | tail -8
      note "kernels_all: $(grep -E 'passed|failed|error|skipped' "$OUT/tests.log" | tail -1)";;
    latency)
      timeout 120 $py -m bench latency --roofline --json "$OUT/latency.json" --profile-dir "$OUT/prof" ${LATENCY_ARGS:-} \
        2>&1 | tee -a "$OUT/bench.log" | grep -v -E '^\s*$' | tail -6;;
    latency_async)
      timeout 120 $py -m bench latency --async-scheduling --roofline --json "$OUT/latency_async.json" ${LATENCY_ARGS:-} \
        2>&1 | tee -a "$OUT/bench.log" | grep -v -E '^\s*$' | tail -6;;
    throughput_async)
      timeout 200 $py -m bench throughput --async-scheduling --roofline --json "$OUT/throughput_async.json" \
        ${THROUGHPUT_ARGS:-} 2>&1 | tee -a "$OUT/bench.log" | grep -v -E '^\s*$' | tail -6;;
    worker|worker_async)
      extra=""; [ "$stage" = worker_async ] && extra="--engine-arg async_scheduling=true"
      timeout 300 $py -m bench worker --max-num-seqs 384 $extra --json "$OUT/$stage.json" ${WORKER_ARGS:-} \
        2>&1 | tee -a "$OUT/worker.log" | grep -E '^(throughput|short):';;
    throughput)
      prof="--profile-dir $OUT/prof --profile-steps ${PROFILE_STEPS:-20:22,250:254}"
      [ "${PROFILE_STEPS:-}" = none ] && prof=""
      timeout 300 $py -m bench throughput --peer hf --roofline --json "$OUT/throughput.json" $prof ${THROUGHPUT_ARGS:-} 2>&1 | tee -a "$OUT/bench.log" | grep -v -E '^\s*$' | tail -8;;
    throughput256)
      timeout 200 $py -m bench throughput --max-num-seqs 256 --roofline --json "$OUT/throughput_256.json" \
        ${THROUGHPUT_ARGS:-} 2>&1 | tee -a "$OUT/bench.log" | grep -v -E '^\s*$' | tail -3;;
    throughput_eager)
      timeout 200 $py -m bench throughput --enforce-eager --json "$OUT/throughput_eager.json" \
        ${THROUGHPUT_ARGS:-} 2>&1 | tee -a "$OUT/bench.log" | tail -3;;
    *) note "unknown stage $stage";;
  esac
  note "stage $stage: $(( $(date +%s) - start )) s"
done

kill $clocks_pid 2>/dev/null
tar czf "$OUT/triton_cache.tgz" -C "$TRITON_CACHE_DIR" . 2>/dev/null
if [ -d "$OUT/prof" ]; then cat "$OUT"/prof/*.txt > "$OUT/profiles.txt" 2>/dev/null; rm -rf "$OUT/prof"; fi
$py - "$OUT" <<'EOF' | tee -a "$OUT/summary.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for name in ("latency", "latency_async", "throughput", "throughput_async", "throughput_256", "throughput_eager"):
    path = out / f"{name}.json"
    if not path.exists():
        continue
    r = json.loads(path.read_text())
    e, roof, peer = r.get("engine", {}), r.get("roofline", {}), r.get("peer", {})
    if name.startswith("latency"):
        print(f"{name}: TTFT p50 {e['ttft_ms_p50']:.1f} ms, ITL p50 {e['itl_ms_p50']:.2f} p90 {e['itl_ms_p90']:.2f} ms"
              f" -> {e['output_tok_s_per_seq']:.0f} tok/s; roofline {100 * roof.get('fraction', 0):.0f}%")
        continue
    line = f"{name}: {e['output_tok_s']:.0f} out tok/s, {e['total_tok_s']:.0f} total tok/s, {e['elapsed_s']:.1f} s"
    if peer.get("output_tok_s"):
        line += f"; hf {peer['best_mode']} {peer['output_tok_s']:.0f} -> {r['ratio_vs_peer']:.2f}x"
    if roof:
        line += f"; roofline {100 * roof['fraction']:.0f}% (bound {roof['bound_s']:.1f} s)"
    print(line)
    print("  kernels compiled in run:", e.get("kernels_compiled_in_run"))
    print("  steps:", json.dumps(e.get("steps", {}))[:400])
    for p in e.get("profiles", []):
        print(f"  profile {p['steps']}: wall {p['wall_s'] * 1e3:.1f} ms, gpu busy {100 * p['gpu_busy_fraction']:.0f}%;",
              "; ".join(f"{n[:40]} {ms:.1f}" for n, ms in p["top_kernels"][:6]))
for name in ("worker", "worker_async"):
    path = out / f"{name}.json"
    if path.exists():
        r = json.loads(path.read_text())["throughput"]
        print(f"{name}: offline {r['offline']['output_tok_s']:.0f} / {r['offline_after']['output_tok_s']:.0f},"
              f" worker {r['worker']['output_tok_s']:.0f} -> {r['e2e_over_offline']:.3f}")
EOF
