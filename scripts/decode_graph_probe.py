"""A batch-1 decode step's small kernels as a CUDA graph runs them, on this GPU.

    python3 scripts/decode_graph_probe.py [--json out.json] [--min-partitions 64,128,256]

Runs against whichever checkout is first on PYTHONPATH (so an A/B runs it twice). Every case
replays a graph of 32 "layers", each with its own paged K/V (nothing stays in L2), and
reports the median microseconds per layer over 20 replays, and for attention the GB/s of
K/V read and the fraction of the copy bandwidth measured first:

- ``attn``: the decode attention alone, given a graph-sized bound (``--bound``) as the
  engine gives it (max_model_len); ``attn+rope+store``: rotary, KV store and attention as
  three launches; ``fused``: the one-launch rotary + store + attention kernel, where the
  checkout has it, once per ``--min-partitions`` value;
- ``gemv``: ``torch.matmul`` at M = 1..8 over llama3-8b's projection shapes (32 weights
  each), GB/s of weights read; again with the other BLAS library preferred (cuBLAS /
  cuBLASLt), and at M = 1 as ``torch.mv``;
- the down projection after SwiGLU at M = 1 and 8: ``silu_and_mul`` then cuBLAS, against
  ``silu_mul_linear`` (one launch) per tile configuration, where the checkout has it;
- each projection with its norm / SwiGLU neighbours, unfused (rms_norm, cuBLAS, silu_and_mul)
  against ``small_m_linear`` with them folded in, per tile configuration;
- ``floor``: a one-program kernel per layer (what any launch costs inside the graph), and
  ``read``: a plain streaming read of one layer's K/V bytes at 1 x 2,048 and 1 x 8,192 tokens
  over P programs (what a decode attention kernel reading those bytes could reach at best), as
  a loop of 2 KB loads and as ``read_at_once``, one load a program of its whole chunk (every
  byte in flight at once); ``--floor-only`` runs these alone.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics

import torch
import torch.nn.functional as F

import sluiceway_kernels as K
from sluiceway_kernels._common import pdl_options, tl, triton, wait_for_previous

LAYERS = 32
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
GEMV_SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
               "lm_head": (4096, 128256)}


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(end) / 1e3) / 1e9


def write_json(path: str, copy: float, rows: list[dict]) -> None:
    """The rows, the copy bandwidth they are fractions of and torch's version, as JSON at ``path``."""
    with open(path, "w") as f:
        json.dump(dict(copy_gbs=copy, rows=rows, torch=torch.__version__), f, indent=1)


def graph_us(fn, reps: int = 20) -> float:
    """Median microseconds of one replay of a graph of ``fn``."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times[3:])


def decode_layers(batch: int, context: int):
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = batch * blocks_per_seq
    caches = [(torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
               torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16))
              for _ in range(LAYERS)]
    tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(batch, blocks_per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    positions = torch.full((batch,), context - 1, dtype=torch.int64, device="cuda")
    slots = (tables[:, (context - 1) // BLOCK].long() * BLOCK + (context - 1) % BLOCK)
    qkv = [torch.randn(batch, HEADS + 2 * KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
           for _ in range(LAYERS)]
    cos_sin = K.make_cos_sin_cache(max(context, 8192) + 1, HEAD_DIM, base=500000.0, device="cuda")
    return caches, tables, lens, positions, slots, qkv, cos_sin


def bench_decode(batch: int, context: int, bound: int, min_partitions: list[int]) -> list[dict]:
    mod = importlib.import_module("sluiceway_kernels.paged_decode_attention")  # the package re-exports a function of that name

    caches, tables, lens, positions, slots, qkv, cos_sin = decode_layers(batch, context)
    scale = HEAD_DIM**-0.5
    outs = [torch.empty(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 2

    def split(x):
        return x[:, :HEADS], x[:, HEADS:HEADS + KV_HEADS], x[:, HEADS + KV_HEADS:]

    def attn():
        for (kc, vc), x, o in zip(caches, qkv, outs):
            K.paged_decode_attention(x[:, :HEADS], kc, vc, tables, lens, scale, out=o, max_context_len=bound)

    def unfused():
        for (kc, vc), x, o in zip(caches, qkv, outs):
            q, k, v = split(x)
            K.apply_rotary(q, k, positions, cos_sin)
            K.store_kvcache(k, v, kc, vc, slots)
            K.paged_decode_attention(q, kc, vc, tables, lens, scale, out=o, max_context_len=bound)

    rows = []

    def add(name, us, note=""):
        rows.append(dict(case=name, batch=batch, context=context, bound=bound, note=note, us_per_layer=us / LAYERS,
                         gbs=kv_bytes / (us / LAYERS / 1e6) / 1e9))

    add("attn", graph_us(attn))
    add("attn+rope+store", graph_us(unfused))
    if hasattr(K, "rope_decode_attention"):
        def fused():
            for (kc, vc), x, o in zip(caches, qkv, outs):
                q, k, v = split(x)
                K.rope_decode_attention(q, k, v, kc, vc, tables, lens, slots, positions, cos_sin, scale, out=o,
                                        max_context_len=bound)

        import sluiceway_kernels._decode_splits as splits  # NOTE: the launcher's and the split choice's

        default = mod.MIN_PARTITION
        for mp in min_partitions:
            mod.MIN_PARTITION = splits.MIN_PARTITION = mp
            add("fused", graph_us(fused), f"MIN_PARTITION={mp}")
            add("attn", graph_us(attn), f"MIN_PARTITION={mp}")
        mod.MIN_PARTITION = splits.MIN_PARTITION = default
    return rows


def bench_gemv() -> list[dict]:
    rows = []
    for name, (k, n) in GEMV_SHAPES.items():
        layers = 4 if name == "lm_head" else LAYERS
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
        for m in (1, 2, 4, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]

            def run():
                for w, o in zip(weights, outs):
                    torch.matmul(x, w.t(), out=o)

            us = graph_us(run) / layers
            rows.append(dict(case=f"gemv {name}", m=m, k=k, n=n, us=us, gbs=n * k * 2 / (us / 1e6) / 1e9))
            # the same product through the other BLAS library's heuristics, and at M = 1 as a
            # matrix-vector product (cuBLAS's gemv kernels rather than a split-K gemm)
            variants = [("cublaslt" if _blas() == "cublas" else "cublas", run)]
            if m == 1:
                vec, vouts = x[0], [o[0] for o in outs]

                def run_mv():
                    for w, o in zip(weights, vouts):
                        torch.mv(w, vec, out=o)

                variants.append(("mv", run_mv))
            for label, fn in variants:
                try:
                    us = (graph_us(fn) if label == "mv" else _with_blas(label, fn)) / layers
                except Exception as exc:  # a library this build lacks
                    print(f"gemv {name} {label} failed: {type(exc).__name__}: {exc}")
                    continue
                rows.append(dict(case=f"gemv {name} {label}", m=m, k=k, n=n, us=us,
                                 gbs=n * k * 2 / (us / 1e6) / 1e9))
        del weights
    return rows


def _blas() -> str:
    return str(torch.backends.cuda.preferred_blas_library()).rsplit(".", 1)[-1].lower()


def _with_blas(library: str, fn) -> float:
    """Microseconds of one replay of a graph of ``fn`` captured with ``library`` preferred."""
    before = _blas()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        return graph_us(fn)
    finally:
        torch.backends.cuda.preferred_blas_library(before)


SILU_GEMV_CONFIGS = [(64, 128, 4, 4), (32, 256, 4, 3), (64, 256, 8, 3), (128, 128, 8, 3), (32, 128, 4, 4)]


def bench_silu_down() -> list[dict]:
    """The down projection after SwiGLU: silu_and_mul then cuBLAS, against the fused kernel
    (where the checkout has it) per tile configuration."""
    inner, n = 14336, 4096
    weights = [torch.randn(n, inner, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    rows = []
    for m in (1, 8):
        x = torch.randn(m, 2 * inner, device="cuda", dtype=torch.bfloat16)
        outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]

        def unfused():
            for w, o in zip(weights, outs):
                torch.matmul(K.silu_and_mul(x), w.t(), out=o)

        cases = [("silu_and_mul+cublas", "", unfused)]
        if hasattr(K, "silu_mul_linear"):
            for config in SILU_GEMV_CONFIGS:
                def fused(config=config):
                    for w, o in zip(weights, outs):
                        K.silu_mul_linear(x, w, out=o, config=config)

                cases.append(("silu_mul_linear", f"config={config}", fused))
        rows += time_products(cases, m, inner, n)
    return rows


def time_products(cases: list[tuple[str, str, object]], m: int, k: int, n: int) -> list[dict]:
    """Each (case, note, fn) timed in a graph of LAYERS products of an (n, k) bf16 weight; a
    configuration that fails (too much shared memory, say) is reported and skipped."""
    rows = []
    for case, note, fn in cases:
        try:
            us = graph_us(fn) / LAYERS
        except Exception as exc:
            print(f"{case} {note} failed: {type(exc).__name__}: {exc}")
            continue
        rows.append(dict(case=case, m=m, k=k, n=n, us=us, gbs=n * k * 2 / (us / 1e6) / 1e9, note=note))
    return rows


SMALL_M_CONFIGS = [(64, 128, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (64, 256, 8, 3), (128, 128, 8, 3)]
SMALL_M_CASES = {  # llama3-8b's four projections as a layer runs them at batch 1-8: (K, N, folding)
    "qkv": (4096, 6144, "norm+residual"), "o": (4096, 4096, "plain"),
    "gate_up": (4096, 28672, "norm+residual+silu"), "down": (14336, 4096, "plain"),
}


def bench_small_m() -> list[dict]:
    """Each projection with its pointwise neighbours as the layer-by-layer path runs them
    (rms_norm with the residual add, cuBLAS, silu_and_mul) against ``small_m_linear`` with the
    same work folded in, per tile configuration, where the checkout has it."""
    if not hasattr(K, "small_m_linear"):
        return []
    rows = []
    for name, (k, n, folding) in SMALL_M_CASES.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(LAYERS)]
        norm_w = torch.ones(k, device="cuda", dtype=torch.bfloat16)
        for m in (1, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            residual = torch.randn_like(x)
            kwargs = dict(norm_weight=norm_w, residual=residual) if folding.startswith("norm") else {}
            silu = folding.endswith("silu")

            def unfused():
                for w in weights:
                    h = K.rms_norm(x, norm_w, 1e-5, residual)[0] if kwargs else x
                    y = torch.matmul(h, w.t())
                    if silu:
                        K.silu_and_mul(y)

            cases = [("unfused", "rms_norm/cublas/silu" if kwargs else "cublas", unfused)]
            for config in SMALL_M_CONFIGS:
                for dot in (True, False) if m == 1 else (True,):  # multiply-adds: one row's registers only
                    def fused(config=config, dot=dot):
                        for w in weights:
                            K.small_m_linear(x, w, eps=1e-5, silu_mul=silu, config=config, dot=dot, **kwargs)

                    cases.append(("small_m_linear", f"config={config}{'' if dot else ' fma'}", fused))
            rows += time_products([(f"{name} {case}", note, fn) for case, note, fn in cases], m, k, n)
        del weights
    return rows


@triton.jit
def _read_chunks(src_ptr, out_ptr, chunk, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program p sums elements [p * chunk, (p + 1) * chunk) of src: a pure streaming read
    (launched as the engine's kernels are: with programmatic dependent launch where they are)."""
    wait_for_previous(PDL)
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.float32)
    base = src_ptr + pid.to(tl.int64) * chunk
    for start in range(0, chunk, BLOCK):
        acc += tl.load(base + start + offs, mask=start + offs < chunk, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


@triton.jit
def _read_at_once(src_ptr, out_ptr, chunk, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program p sums its chunk of src from one load of BLOCK (>= chunk) elements: every byte a
    program reads is in flight at once, none waits for an earlier load's return (what a kernel
    that issues all its reads before using any can reach)."""
    wait_for_previous(PDL)
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    x = tl.load(src_ptr + pid.to(tl.int64) * chunk + offs, mask=offs < chunk, other=0.0)
    tl.store(out_ptr + pid, tl.sum(x.to(tl.float32)))


def bench_floor(contexts: list[int], programs: list[int]) -> list[dict]:
    """What a kernel can do inside the same 32-layer graph, with nothing of attention in it: one
    program storing one value (the per-launch floor), and a streaming read of exactly one
    layer's K/V bytes at one sequence x ``context`` split over P programs (the most a decode
    attention kernel reading those bytes can reach)."""
    rows = []
    out = torch.empty(max(programs), dtype=torch.float32, device="cuda")
    tiny = [torch.zeros(1, device="cuda") for _ in range(LAYERS)]
    add_rows = lambda case, note, us, nbytes: rows.append(dict(  # noqa: E731
        case=case, note=note, us_per_layer=us / LAYERS, gbs=nbytes / (us / LAYERS / 1e6) / 1e9 if nbytes else 0.0))
    pdl = pdl_options(out.device)
    add_rows("floor", "1 program", graph_us(lambda: [_read_chunks[(1,)](t, out, 1, BLOCK=16, **pdl) for t in tiny]), 0)
    for context in contexts:
        nbytes = 2 * context * KV_HEADS * HEAD_DIM * 2  # K and V, bf16
        layers = [torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
        for p in programs:
            chunk = -(-layers[0].numel() // p)
            add_rows("read", f"ctx={context} P={p}",
                     graph_us(lambda: [_read_chunks[(p,)](t, out, chunk, BLOCK=1024, **pdl) for t in layers]), nbytes)
            block = triton.next_power_of_2(chunk)
            if 256 <= block <= 32768:  # at most 64 elements a thread at 16 warps
                warps = max(1, min(16, block // 2048))
                add_rows("read_at_once", f"ctx={context} P={p} w={warps}",
                         graph_us(lambda: [_read_at_once[(p,)](t, out, chunk, BLOCK=block, num_warps=warps, **pdl)
                                           for t in layers]), nbytes)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--min-partitions", default="64,128,256")
    parser.add_argument("--bound", type=int, default=8192, help="max_context_len the graph is captured with")
    parser.add_argument("--skip-gemv", action="store_true", help="attention only")
    parser.add_argument("--floor-only", action="store_true", help="only the floor and the plain reads")
    parser.add_argument("--programs", default="8,32,64,128,256,512", help="the plain reads' program counts")
    args = parser.parse_args()
    mps = [int(x) for x in args.min_partitions.split(",") if x]
    copy = copy_bandwidth()
    print(f"copy bandwidth {copy:.0f} GB/s (read + write); programmatic dependent launch: "
          f"{pdl_options(torch.device('cuda'))['PDL']}")
    rows = []
    cases = ((1, 384, 384), (1, 2048, args.bound), (1, 8192, args.bound), (8, 2048, args.bound))
    for batch, context, bound in () if args.floor_only else cases:
        for row in bench_decode(batch, context, bound, mps):
            row["of_copy"] = row["gbs"] / copy
            rows.append(row)
            print(f"{row['case']:16s} B={batch} ctx={context:5d} bound={bound:5d} {row['note']:18s} "
                  f"{row['us_per_layer']:7.2f} us/layer  {row['gbs']:6.0f} GB/s  {100 * row['of_copy']:3.0f}% of copy")
    if not (args.skip_gemv or args.floor_only):
        for row in bench_gemv():
            row["of_copy"] = row["gbs"] / copy
            rows.append(row)
            print(f"{row['case']:16s} M={row['m']} {row['k']}->{row['n']:6d} {row['us']:7.2f} us  {row['gbs']:6.0f} GB/s  "
                  f"{100 * row['of_copy']:3.0f}% of copy")
    for row in [] if args.skip_gemv or args.floor_only else bench_silu_down():
        row["of_copy"] = row["gbs"] / copy
        rows.append(row)
        print(f"{row['case']:20s} M={row['m']} {row['note']:28s} {row['us']:7.2f} us  {row['gbs']:6.0f} GB/s  "
              f"{100 * row['of_copy']:3.0f}% of copy")
    for row in [] if args.skip_gemv or args.floor_only else bench_small_m():
        row["of_copy"] = row["gbs"] / copy
        rows.append(row)
        print(f"{row['case']:24s} M={row['m']} {row['note']:28s} {row['us']:7.2f} us  {row['gbs']:6.0f} GB/s  "
              f"{100 * row['of_copy']:3.0f}% of copy")
    for row in bench_floor([2048, 8192], [int(p) for p in args.programs.split(",") if p]):
        row["of_copy"] = row["gbs"] / copy
        rows.append(row)
        print(f"{row['case']:16s} {row['note']:22s} {row['us_per_layer']:7.2f} us/layer  {row['gbs']:6.0f} GB/s  "
              f"{100 * row['of_copy']:3.0f}% of copy")
    if args.json:
        write_json(args.json, copy, rows)


if __name__ == "__main__":
    main()
