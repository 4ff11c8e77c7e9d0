#!/usr/bin/env bash
# Small-batch A/Bs on one GPU, each pair in one call (issues 22 and 23). Stages (STAGES, default
# "tests decode fp8defer head"):
#   tests     the GPU tests of the FP8 products left unscaled and of the float8 decode kernels;
#   gputests  tests/engine/test_gpu.py and tests/kernels/test_pdl.py;
#   decode    bench.kernels' float8 decode at the throughput shape (384 x 640) and at 1 x 2,048;
#   fp8defer  bench latency -q fp8 (batch 1) with the FP8 products named in each of DEFER (default:
#             none, the engine's default; o and down; all three) leaving their scales to the
#             kernel that reads them next (engine/models/llama.py: DEFERRED_SCALES);
#   head      bench latency (bf16, batch 1) with the LM head inside decode graphs of up to 16
#             sequences (16, the default) and outside them (0), alternating;
#   fp8silu   bench latency -q fp8 (batch 1) with silu_and_mul_fp8 splitting each of a few rows over
#             programs (sluiceway_kernels/silu_mul.py: SPLIT_ROWS 16) or one program a row (0), and
#             split with gate/up's scales left to it too (SILU_RUNS, default split, split_defer3, one,
#             twice); amax4k / amax16k: split, its amax read in tiles of 4,096 or 16,384 columns
#             (SPLIT_AMAX_BLOCK);
#   fp8proj   bench latency -q fp8 --kv-cache-dtype fp8 (batch 1) with each of FP8PROJ's projections
#             (default none, qkv_proj, qkv_proj,o_proj, o_proj,down_proj, twice) through our float8 split-K product
#             (engine/models/llama.py: FP8_SMALL_M_PROJECTIONS) and the rest through cuBLASLt;
#   fp8tune   bench latency -q fp8 --kv-cache-dtype fp8 (batch 1): the RMSNorm's warps (norm4, norm16:
#             sluiceway_kernels/rms_norm.py NUM_WARPS) and SiLU-mul's float8 chunks (chunk512,
#             chunk2048: silu_mul.py SPLIT_CHUNK) against the defaults (FP8TUNE, twice each);
#   fp8triton bench latency -q fp8 (batch 1) with the FP8 products of up to TRITON_ROWS tokens taken
#             by sluiceway_kernels/fp8_small_m.py (16) or cuBLASLt (0), alternating (ROWS);
#   smallm    bench latency (bf16, batch 1) with o and down through small_m_linear and through cuBLAS
#             (engine/models/llama.py: SMALL_M_PROJECTIONS), alternating;
#   folds     bench latency (bf16, batch 1) with each of FOLDS (default "silu_in,norm_after none
#             silu_in none") as engine/models/llama.py's SMALL_M_FOLDS: what runs inside o's and
#             down's small_m_linear launches; "@B" after one sets the norm's row chunk
#             (small_m_linear.NORM_AFTER_BLOCK, e.g. silu_in,norm_after@1024); with BATCH8=1 each
#             once more at batch 8;
#   fp8folds  bench latency -q fp8 (batch 1) with the same folding for FP8 layers (o and down our
#             float8 split-K kernel, the norm after each and its quantization in the launch), on (1)
#             and off (0), alternating (FP8FOLDS; engine/models/llama.py: FP8_SMALL_M_FOLDS);
#   products  scripts/fp8_gemm_probe.py --per-product at 1 and 8 tokens: each of a layer's four products
#             alone, bf16, cuBLASLt float8 and our split-K kernel, against the copy rate;
#   gptfast   the batch-1 peer (.cache/peers/gptfast_latency.py, carried) with TorchInductor's cache
#             carried too: .cache/inductor.tgz is unpacked first if present, and the cache goes
#             back as $OUT/inductor.tgz (its compile took 160-213 s of a call on an H100 without);
#   pdl       bench latency (batch 1) with programmatic dependent launch off and on
#             (sluiceway_kernels/_common.py: PDL), each of PDL_RUNS (default "off on all five five_on
#             fp8 fp8_on on off"): all = on, with all four projections through small_m_linear;
#             five = the five-kernel layer (--small-batch-kernels); five_tiles = the same with the
#             one-row norm's statistics read in 128-wide tiles (small_m_linear.ROW_BLOCK, the old way);
#             fp8 = -q fp8 --kv-cache-dtype fp8;
#   splits    bench.kernels' decode attention at DECODE_CASES (default 1x2048,1x8192,8x2048) with each
#             of MIN_PARTITIONS (default "32,64,128", the shortest split of a long context:
#             sluiceway_kernels/_decode_splits.py), PDL off and on; then
#             bench.kernels --sweep at SWEEP (default 1x2048; empty: none) with splits of 64 and 256 too;
#   minpart   decode attention's splits at batch 1, each of MINPART (default "128/2 64/2 64/4 32/4": the
#             shortest split in tokens / the programs aimed at per SM, sluiceway_kernels/_decode_splits.py
#             MIN_PARTITION / PROGRAMS_PER_SM): bench.kernels' decode at 1x2048,1x8192,8x2048 in a graph,
#             then bench latency (bf16, batch 1) with each, MINPART_ROUNDS times (default 2), alternating;
#   early     bench latency (batch 1) with decode attention's first tile read before the wait
#             (sluiceway_kernels/paged_decode_attention.py: EARLY_READS) off and on, each of EARLY_RUNS
#             (default "off on off on"; five_off/five_on: the five-kernel layer, fp8_off/fp8_on: FP8);
#   tput      bench throughput (1,024 x 512 in / 256 out) with PDL off and on, bf16 then FP8
#             weights + FP8 cache (TPUT_RUNS, default "off on fp8 fp8_on");
#   fp8probe  scripts/fp8_gemm_probe.py at 1, 8 and 16 tokens: one layer's four FP8 products per
#             variant and fp8_small_m tile config, in a CUDA graph.
# Logs and JSON under $OUT.
#
#   OUT=$OUT SLUICEWAY_COMMIT=<commit> bash scripts/gpu_small_batch_ab.sh
#   STAGES="fp8defer" MODEL=llama3-8b bash scripts/gpu_small_batch_ab.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_small_batch_ab_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton_cache
mkdir -p "$TRITON_CACHE_DIR"
[ -f .cache/triton_cache.tgz ] && tar xzf .cache/triton_cache.tgz -C "$TRITON_CACHE_DIR"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
model=${MODEL:-llama3-8b}
STAGES=${STAGES:-tests decode fp8defer head}
want() { case " $STAGES " in *" $1 "*) return 0;; esac; return 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
echo "commit ${SLUICEWAY_COMMIT:-unknown} $(date -u '+%F %T UTC')"

if want tests; then
  timeout ${TESTS_TIMEOUT:-200} python3 -m pytest --noconftest -p no:cacheprovider -q tests/engine/test_fp8_gpu.py \
    tests/kernels/test_fp8_quant.py tests/kernels/test_fp8_small_m.py tests/kernels/test_unscaled_product.py tests/kernels/test_fp8_kv_cache.py tests/kernels/test_scaled_fp8_kv_cache.py \
    > "$OUT/tests.log" 2>&1
  echo "tests: $(tail -1 "$OUT/tests.log")"; grep -E "^FAILED" "$OUT/tests.log" | head -5
fi
if want gputests; then  # the engine's GPU tests (every mode: PDL off, small-M preload, ...) and PDL's
  timeout ${GPUTESTS_TIMEOUT:-240} python3 -m pytest --noconftest -p no:cacheprovider -q tests/engine/test_gpu.py \
    tests/kernels/test_pdl.py > "$OUT/gputests.log" 2>&1
  echo "gputests: $(tail -1 "$OUT/gputests.log")"; grep -E "^FAILED" "$OUT/gputests.log" | head -5
fi
want decode && timeout 60 python3 -m bench.kernels --only decode --kv-cache-dtype fp8 --decode-cases 384x640,1x2048 \
  2>&1 | grep -E "^decode|^#"

# bench latency with a module attribute set first (a python -c: the A/B needs no engine option)
latency() {  # tag, python statement, bench latency arguments...
  local tag=$1 setup=$2; shift 2
  timeout 90 python3 -c "
import importlib, runpy, sys
import engine.models.llama as M, engine.runner.cuda_graph as G, engine.layers.fp8 as F8, sluiceway_kernels._common as C
L = importlib.import_module('sluiceway_kernels.small_m_linear')  # the module, not the function of that name
S = importlib.import_module('sluiceway_kernels.silu_mul')
D = importlib.import_module('sluiceway_kernels.paged_decode_attention')
$setup
sys.argv = ['bench', 'latency', '--model', '$model', '--roofline', '--json', '$OUT/lat_$tag.json', *sys.argv[1:]]
runpy.run_module('bench', run_name='__main__')" "$@" > "$OUT/lat_$tag.log" 2>&1
  echo "$tag: $(grep -E 'per output token|launches per' "$OUT/lat_$tag.log" | tr '\n' ' ')"
}
if want early; then  # decode attention's first tile read before the wait (D.EARLY_READS), off against on
  i=0
  for v in ${EARLY_RUNS:-off on off on}; do
    i=$((i + 1))
    case $v in
      off|on) latency "early_$v$i" "D.EARLY_READS = $([ $v = on ] && echo True || echo False)";;
      five_off|five_on) latency "early_$v$i" "D.EARLY_READS = $([ $v = five_on ] && echo True || echo False)" \
        --small-batch-kernels;;
      fp8_off|fp8_on) latency "early_$v$i" "D.EARLY_READS = $([ $v = fp8_on ] && echo True || echo False)" \
        -q fp8 --kv-cache-dtype fp8;;
    esac
  done
fi
if want fp8defer; then
  for names in ${DEFER:-none o_proj,down_proj o_proj,gate_up_proj,down_proj}; do
    latency "fp8_defer_${names//,/_}" "M.DEFERRED_SCALES = tuple(n for n in '$names'.split(',') if n != 'none')" -q fp8
  done
fi
if want fp8silu; then
  for v in ${SILU_RUNS:-split split_defer3 one split split_defer3 one}; do
    case $v in
      split) latency "fp8silu_$v" "S.SPLIT_ROWS = 16" -q fp8;;
      split_defer3) latency "fp8silu_$v" "S.SPLIT_ROWS = 16; M.DEFERRED_SCALES = ('o_proj', 'gate_up_proj', 'down_proj')" -q fp8;;
      one) latency "fp8silu_$v" "S.SPLIT_ROWS = 0" -q fp8;;
      amax4k) latency "fp8silu_$v" "S.SPLIT_AMAX_BLOCK = 4096" -q fp8;;
      amax16k) latency "fp8silu_$v" "S.SPLIT_AMAX_BLOCK = 16384" -q fp8;;
    esac
  done
fi
if want fp8proj; then
  for p in ${FP8PROJ:-none qkv_proj qkv_proj,o_proj o_proj,down_proj none qkv_proj qkv_proj,o_proj o_proj,down_proj}; do
    latency "fp8proj_${p//,/_}" "M.FP8_SMALL_M_PROJECTIONS = tuple(n for n in '$p'.split(',') if n != 'none')" \
      -q fp8 --kv-cache-dtype fp8
  done
fi
if want fp8tune; then  # the small kernels of an FP8 layer at batch 1: the norms' warps, SiLU-mul's chunks
  for v in ${FP8TUNE:-default norm4 norm16 chunk512 chunk2048 default norm4 norm16 chunk512 chunk2048}; do
    case $v in
      default) latency "fp8tune_$v" "pass" -q fp8 --kv-cache-dtype fp8;;
      norm*) latency "fp8tune_$v" "importlib.import_module('sluiceway_kernels.rms_norm').NUM_WARPS = ${v#norm}" -q fp8 --kv-cache-dtype fp8;;
      chunk*) latency "fp8tune_$v" "S.SPLIT_CHUNK = ${v#chunk}" -q fp8 --kv-cache-dtype fp8;;
    esac
  done
fi
if want fp8triton; then
  for r in ${ROWS:-16 0 16 0}; do latency "fp8_triton$r" "F8.TRITON_ROWS = $r" -q fp8; done
fi
if want smallm; then
  for p in ${PROJ:-o_proj,down_proj none o_proj,down_proj none}; do
    latency "smallm_${p//,/_}" "M.SMALL_M_PROJECTIONS = tuple(n for n in '$p'.split(',') if n != 'none')"
  done
fi
folds_setup() {  # "names[@block]" -> the python statement
  local names=${1%@*} block=""
  [[ $1 == *@* ]] && block="; L.NORM_AFTER_BLOCK = ${1#*@}"
  echo "M.SMALL_M_FOLDS = tuple(n for n in '$names'.split(',') if n != 'none')$block"
}
if want folds; then
  for f in ${FOLDS:-silu_in,norm_after none silu_in none}; do
    latency "folds_${f//[,@]/_}" "$(folds_setup "$f")"
    [ "${BATCH8:-0}" = 1 ] && latency "folds_${f//[,@]/_}_batch8" "$(folds_setup "$f")" --batch-size 8
  done
fi
if want pdl; then
  i=0
  for v in ${PDL_RUNS:-off on all five five_on fp8 fp8_on on off}; do
    i=$((i + 1))
    case $v in
      off) latency "pdl_$v$i" "C.PDL = False";;
      on) latency "pdl_$v$i" "C.PDL = True";;
      all) latency "pdl_$v$i" "C.PDL = True; M.SMALL_M_PROJECTIONS = ('qkv_proj', 'o_proj', 'gate_up_proj', 'down_proj')";;
      five) latency "pdl_$v$i" "C.PDL = False" --small-batch-kernels;;
      five_on) latency "pdl_$v$i" "C.PDL = True" --small-batch-kernels;;
      five_tiles) latency "pdl_$v$i" "C.PDL = True; L.ROW_BLOCK = 128" --small-batch-kernels;;  # the norm's statistics in 128-wide tiles, as before
      fp8) latency "pdl_$v$i" "C.PDL = False" -q fp8 --kv-cache-dtype fp8;;
      fp8_on) latency "pdl_$v$i" "C.PDL = True" -q fp8 --kv-cache-dtype fp8;;
      *) echo "pdl: unknown run $v";;
    esac
  done
fi
if want splits; then  # one process: each combination sets the module attributes, then runs bench.kernels
  timeout 240 python3 -c "
import itertools
import bench.kernels as B
import sluiceway_kernels._common as C, sluiceway_kernels._decode_splits as S, importlib
D = importlib.import_module('sluiceway_kernels.paged_decode_attention')
for mp, pdl in itertools.product([${MIN_PARTITIONS:-32,64,128}], [False, True]):
    C.PDL = pdl
    S.MIN_PARTITION = D.MIN_PARTITION = mp
    print(f'== min_partition={mp} pdl={pdl}', flush=True)
    B.main(['--only', 'decode', '--decode-cases', '${DECODE_CASES:-1x2048,1x8192,8x2048}'])
if '${SWEEP:-1x2048}':  # every tile configuration at 1 x 2,048, in splits of 64-256 tokens too
    C.PDL = False
    S.MIN_PARTITION = D.MIN_PARTITION = 128
    B.SWEEP_PARTITIONS = (None, 64, 256)
    B.DECODE_TILES = [(16, 2, 4), (32, 2, 4), (32, 4, 2), (32, 4, 3), (64, 2, 3), (64, 2, 4), (64, 4, 2), (64, 4, 3),
                      (64, 4, 4), (64, 8, 2), (128, 4, 2), (128, 8, 2)]  # the bf16 cache's candidates
    print('== sweep', flush=True)
    B.main(['--only', 'decode', '--sweep', '--decode-cases', '${SWEEP:-1x2048}', '--json', '$OUT/sweep.json'])
" > "$OUT/splits.log" 2>&1
  grep -E "^==|^decode " "$OUT/splits.log"; grep -E "^decode-best" "$OUT/splits.log"
fi
if want minpart; then
  pairs=${MINPART:-128/2 64/2 64/4 32/4}
  timeout 150 python3 -c "
import bench.kernels as B
import sluiceway_kernels._decode_splits as S, importlib
D = importlib.import_module('sluiceway_kernels.paged_decode_attention')
for pair in '$pairs'.split():
    mp, per_sm = map(int, pair.split('/'))
    S.MIN_PARTITION = D.MIN_PARTITION = mp
    S.PROGRAMS_PER_SM = per_sm
    print(f'== min_partition={mp} programs_per_sm={per_sm}', flush=True)
    B.main(['--only', 'decode', '--decode-cases', '1x2048,1x8192,8x2048'])
" > "$OUT/minpart_kernels.log" 2>&1
  grep -E "^==|^decode " "$OUT/minpart_kernels.log"
  for i in $(seq "${MINPART_ROUNDS:-2}"); do
    for pair in $pairs; do
      mp=${pair%/*}; per_sm=${pair#*/}
      latency "minpart_${mp}_${per_sm}_$i" "import sluiceway_kernels._decode_splits as DS; D = importlib.import_module('sluiceway_kernels.paged_decode_attention'); DS.MIN_PARTITION = D.MIN_PARTITION = $mp; DS.PROGRAMS_PER_SM = $per_sm"
    done
  done
fi
if want tput; then
  for v in ${TPUT_RUNS:-off on fp8 fp8_on}; do
    case $v in off|fp8) pdl=False;; *) pdl=True;; esac
    case $v in fp8*) q="'--quantization', 'fp8', '--kv-cache-dtype', 'fp8', ";; *) q="";; esac
    timeout 150 python3 -c "
import runpy, sys
import sluiceway_kernels._common as C
C.PDL = $pdl
sys.argv = ['bench', 'throughput', '--model', '$model', '--roofline', $q'--json', '$OUT/tput_$v.json']
runpy.run_module('bench', run_name='__main__')" > "$OUT/tput_$v.log" 2>&1
    echo "tput $v: $(grep -iE 'tok/s|roofline|bound' "$OUT/tput_$v.log" | head -3 | tr '\n' ' ')"
  done
fi
if want fp8folds; then
  for f in ${FP8FOLDS:-1 0 1 0}; do latency "fp8folds$f" "M.FP8_SMALL_M_FOLDS = bool($f)" -q fp8; done
fi
want fp8probe && timeout 150 python3 scripts/fp8_gemm_probe.py --tokens 1,8,16 --json "$OUT/fp8probe.json" \
  > "$OUT/fp8probe.log" 2>&1 && grep -E "^M=|weights" "$OUT/fp8probe.log"
want products && timeout 150 python3 scripts/fp8_gemm_probe.py --per-product --tokens 1,8 \
  --json "$OUT/products.json" > "$OUT/products.log" 2>&1; grep -E "^copy|M=" "$OUT/products.log"
if want gptfast; then
  export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache TORCHINDUCTOR_FX_GRAPH_CACHE=1 TORCHINDUCTOR_AUTOGRAD_CACHE=1
  mkdir -p "$TORCHINDUCTOR_CACHE_DIR"
  [ -f .cache/inductor.tgz ] && tar xzf .cache/inductor.tgz -C "$TORCHINDUCTOR_CACHE_DIR"
  start=$(date +%s)
  GF_MODEL=llama-3-8b timeout "${GPTFAST_TIMEOUT:-300}" python3 .cache/peers/gptfast_latency.py > "$OUT/gptfast.log" 2>&1
  echo "gpt-fast ($(( $(date +%s) - start )) s): $(grep -vE "Warning|self.gen" "$OUT/gptfast.log" | tail -2 | tr '\n' ' ')"
  tar czf "$OUT/inductor.tgz" -C "$TORCHINDUCTOR_CACHE_DIR" . 2>/dev/null
fi
if want head; then
  for h in 16 0 16 0; do latency "head$h" "G.HEAD_BATCH = $h"; done
fi
tar czf "$OUT/triton_cache.tgz" -C "$TRITON_CACHE_DIR" . 2>/dev/null
