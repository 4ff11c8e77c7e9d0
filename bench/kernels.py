"""Time every kernel against its torch reference on a GPU, at Llama-3-8B shapes.

    python -m bench.kernels [--only decode,prefill,...] [--sweep] [--dtype bf16] [--json out.json]
    TRITON_INTERPRET=1 python -m bench.kernels --tiny   # on CPU: checks the script itself

Prints, per case, the kernel's median time as the engine runs it (``--timing graph``, the
default: replayed inside a CUDA graph, over enough copies of its inputs that they do not sit
in L2, as successive layers do not), the reference's (eager ``triton.testing.do_bench``), the speed-up, and the kernel's achieved GB/s (memory-bound kernels) or TFLOP/s (prefill).
Attention also shows torch's dense scaled_dot_product_attention on un-paged K/V as a
yardstick. ``--sweep`` tries the attention tile configurations and prints the best per case.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F

import sluiceway_kernels as K
from bench.kernel_timing import DEVICE, TIMING, bench, kernel_ms
from sluiceway_kernels._common import FP8_KV_DTYPE

# the package re-exports functions named like their modules, so fetch the modules themselves
decode_mod = importlib.import_module("sluiceway_kernels.paged_decode_attention")
prefill_mod = importlib.import_module("sluiceway_kernels.paged_prefill_attention")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Shapes:
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    tokens: int  # rows for the pointwise kernels
    store_tokens: tuple[int, ...]
    decode: tuple[tuple[int, int, int], ...]  # (batch, context, block_size)
    prefill: tuple[tuple[int, int, int, int], ...]  # (batch, new tokens, cached tokens, block_size)
    sample_batches: tuple[int, ...]


LLAMA3_8B = Shapes(
    heads=32, kv_heads=8, head_dim=128, hidden=4096, intermediate=14336, vocab=128256, tokens=8192,
    store_tokens=(256, 8192),
    decode=((1, 8192, 16), (1, 2048, 16), (8, 4096, 16), (64, 2048, 16), (256, 1024, 16), (256, 1024, 32),
            (32, 8192, 16), (384, 640, 16), (512, 700, 16)),  # the last two: decode steps of the throughput workload
    prefill=(
        (1, 2048, 0, 16), (4, 512, 0, 16), (8, 512, 1536, 16), (1, 8192, 0, 16), (2, 1024, 7168, 32), (16, 128, 0, 16),
    ),
    sample_batches=(1, 64, 256, 512),
)
TINY = Shapes(  # checks the script on CPU under the interpreter
    heads=4, kv_heads=2, head_dim=64, hidden=256, intermediate=128, vocab=2000, tokens=8,
    store_tokens=(8,), decode=((2, 40, 16),), prefill=((2, 16, 8, 16),), sample_batches=(2,),
)


DECODE_CASES: set[str] = set()  # --decode-cases: "BxCONTEXT" shapes to run (empty: all)
KV_CACHE_DTYPE = {"auto": None, "fp8": FP8_KV_DTYPE, "fp8_e4m3": FP8_KV_DTYPE}  # as EngineArgs.kv_cache_dtype


def as_cache(t: torch.Tensor, kv: torch.dtype | None) -> torch.Tensor:
    """``t`` as a KV cache of dtype ``kv`` (None: its own)."""
    return t if kv is None else t.to(kv)


def paged_inputs(sh: Shapes, context: list[int], query: list[int], block_size: int, dtype: torch.dtype,
                 kv: torch.dtype | None = None) -> dict:
    """Random paged batch: shuffled blocks, q for the last query[b] tokens of each sequence."""
    pages = [math.ceil(c / block_size) for c in context]
    num_blocks = sum(pages) + 1
    order = torch.randperm(num_blocks, device=DEVICE).to(torch.int32)
    tables = torch.zeros(len(context), max(pages), dtype=torch.int32, device=DEVICE)
    used = 0
    for b, n in enumerate(pages):
        tables[b, :n] = order[used : used + n]
        used += n
    cache_shape = (num_blocks, block_size, sh.kv_heads, sh.head_dim)
    starts = torch.tensor([0] + query, device=DEVICE).cumsum(0).to(torch.int32)
    return dict(
        q=torch.randn(sum(query), sh.heads, sh.head_dim, device=DEVICE, dtype=dtype),
        k_cache=as_cache(torch.randn(cache_shape, device=DEVICE, dtype=dtype), kv),
        v_cache=as_cache(torch.randn(cache_shape, device=DEVICE, dtype=dtype), kv),
        block_tables=tables,
        context_lens=torch.tensor(context, dtype=torch.int32, device=DEVICE),
        query_start_loc=starts,
    )


class Report:
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def add(self, name: str, case: str, kernel_ms: float, ref_ms: float | None, work: float, unit: str,
            baseline_ms: float | None = None, note: str = "", echo: bool = True) -> None:
        """One row; ``echo=False`` keeps it for ``--json`` only."""
        rate = work / (kernel_ms * 1e-3) / (1e9 if unit == "GB/s" else 1e12)
        timing = getattr(kernel_ms, "mode", "eager")
        self.rows.append(dict(name=name, case=case, kernel_ms=float(kernel_ms), ref_ms=ref_ms, rate=rate, unit=unit,
                              sdpa_ms=baseline_ms, note=note, timing=timing))
        if not echo:
            return
        ref = f"{ref_ms:9.3f}" if ref_ms is not None else "      n/a"
        speedup = f"{ref_ms / kernel_ms:7.1f}x" if ref_ms is not None else "     n/a"
        sdpa = f"  sdpa {baseline_ms:.3f} ms" if baseline_ms is not None else ""
        print(f"{name:<15} {case:<34} kernel {kernel_ms:8.3f} ms ({timing})  ref {ref} ms {speedup}  "
              f"{rate:8.1f} {unit}{sdpa} {note}", flush=True)


def bench_store(report: Report, sh: Shapes, dtype: torch.dtype, kv: torch.dtype | None = None) -> None:
    for tokens in sh.store_tokens:
        blocks = tokens // 16 + 8
        k_cache = as_cache(torch.zeros(blocks, 16, sh.kv_heads, sh.head_dim, device=DEVICE, dtype=dtype), kv)
        v_cache = torch.zeros_like(k_cache)
        qkv = torch.randn(tokens, sh.heads + 2 * sh.kv_heads, sh.head_dim, device=DEVICE, dtype=dtype)
        key, value = qkv[:, sh.heads : sh.heads + sh.kv_heads], qkv[:, sh.heads + sh.kv_heads :]
        slots = torch.randperm(blocks * 16, device=DEVICE)[:tokens]
        args = (key, value, k_cache, v_cache, slots)
        moved = 2 * key.numel() * (key.element_size() + k_cache.element_size())
        report.add("store_kvcache", f"T={tokens}", kernel_ms(K.store_kvcache, args),
                   bench(lambda: K.store_kvcache_ref(*args)), moved, "GB/s")
        # a prompt step's rotary and store in one launch: q rotated in place as well
        q = qkv[:, : sh.heads]
        positions = torch.randint(0, 8192, (tokens,), device=DEVICE)
        cos_sin = K.make_cos_sin_cache(8192, sh.head_dim, base=500000.0, device=DEVICE)
        fused = (q, key, value, k_cache, v_cache, slots, positions, cos_sin)
        moved += 2 * q.numel() * q.element_size()
        report.add("rope_store", f"T={tokens}", kernel_ms(K.rope_store, fused),
                   bench(lambda: K.rope_store_ref(*fused)), moved, "GB/s")


def bench_decode(report: Report, sh: Shapes, dtype: torch.dtype, sweep: bool, kv: torch.dtype | None = None) -> None:
    scale = sh.head_dim**-0.5
    for batch, context, block_size in sh.decode:
        if DECODE_CASES and f"{batch}x{context}" not in DECODE_CASES:
            continue
        x = paged_inputs(sh, [context] * batch, [1] * batch, block_size, dtype, kv)
        args = (x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["context_lens"], scale)
        kv_bytes = 2 * batch * context * sh.kv_heads * sh.head_dim * x["k_cache"].element_size()
        dense_k = torch.randn(batch, sh.kv_heads, context, sh.head_dim, device=DEVICE, dtype=dtype)
        dense_q = x["q"][:, :, None, :]  # (B, Hq, 1, D)
        sdpa = _try(lambda: bench(lambda: F.scaled_dot_product_attention(dense_q, dense_k, dense_k, enable_gqa=True)))
        ref = bench(lambda: K.paged_decode_attention_ref(*args)) if batch * context <= 2**19 else None
        case = f"B={batch} ctx={context} bs={block_size}"
        report.add("decode", case, kernel_ms(K.paged_decode_attention, args), ref, kv_bytes, "GB/s", sdpa)
        if sweep:
            _sweep_decode(report, case, args, kv_bytes)


class CompiledSeen:
    """Stands in for a ``@triton.jit`` function and keeps the compiled kernel its last launch
    returned, so the sweep can report what each configuration cost in registers and shared memory."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.last: Any = None

    def __getitem__(self, grid: Any) -> Callable[..., object]:
        launcher = self.fn[grid]

        def launch(*args: Any, **kwargs: Any) -> object:
            self.last = launcher(*args, **kwargs)
            return self.last

        return launch

    def describe(self) -> str:
        """Registers per thread, spills and shared bytes of the last compiled launch ('' under the interpreter)."""
        kernel = self.last
        if kernel is None or not hasattr(kernel, "n_regs"):
            return ""
        shared = getattr(getattr(kernel, "metadata", None), "shared", None)
        return f" regs={kernel.n_regs} spills={kernel.n_spills} shared={shared}"


# (BLOCK_N, num_warps, num_stages) the decode sweep tries, each at three partition sizes.
# NOTE: the 128- and 256-row tiles are for a float8 cache, whose tiles move half the bytes of a
# bf16 tile; the small tiles of one or two warps with deep pipelines last: at 384 x 640 on an H100
# the best float8 tile was 32 rows, two warps, five stages (2026-12-06, docs/BENCHMARKS.md)
DECODE_TILES = [(16, 2, 2), (32, 4, 2), (32, 4, 3), (32, 2, 4), (64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 8, 2),
                (64, 8, 3), (128, 4, 2), (128, 4, 3), (128, 4, 4), (128, 8, 2), (128, 8, 3), (256, 8, 2), (256, 8, 3),
                (16, 1, 4), (16, 2, 4), (16, 2, 6), (32, 1, 4), (32, 2, 3), (32, 2, 5), (32, 2, 6), (32, 4, 4),
                (64, 2, 3), (64, 2, 4)]


SWEEP_PARTITIONS: tuple[int | None, ...] = (None, 512, 1024)  # tokens per split; None: the launcher's choice


def _sweep_decode(report: Report, case: str, args: tuple, kv_bytes: float) -> None:
    results = []
    seen = CompiledSeen(decode_mod._decode_kernel)
    with mock.patch.object(decode_mod, "_decode_kernel", seen):
        for block_n, warps, stages in DECODE_TILES:
            with mock.patch.object(decode_mod, "decode_config", lambda *_, **__: (block_n, warps, stages)):
                for partition in SWEEP_PARTITIONS:
                    ms = _try(lambda: kernel_ms(K.paged_decode_attention, args, dict(partition_size=partition)))
                    if ms is not None:
                        note = f"BLOCK_N={block_n} warps={warps} stages={stages} partition={partition}{seen.describe()}"
                        results.append((ms, note))
                        report.add("decode-tile", case, ms, None, kv_bytes, "GB/s", note=note,
                                   echo=partition is None)
    best_ms, best = min(results)
    report.add("decode-best", case, best_ms, None, kv_bytes, "GB/s", note=best)


def bench_prefill(report: Report, sh: Shapes, dtype: torch.dtype, sweep: bool, kv: torch.dtype | None = None) -> None:
    scale = sh.head_dim**-0.5
    for batch, new, cached, block_size in sh.prefill:
        x = paged_inputs(sh, [new + cached] * batch, [new] * batch, block_size, dtype, kv)
        args = (x["q"], x["k_cache"], x["v_cache"], x["query_start_loc"], x["context_lens"], x["block_tables"],
                scale, new)
        # (query, key) pairs that attend: each query sees the cached prefix and the causal part
        pairs = batch * (new * cached + new * (new + 1) / 2)
        flops = 4 * pairs * sh.heads * sh.head_dim
        sdpa = None
        if cached == 0:
            q4 = torch.randn(batch, sh.heads, new, sh.head_dim, device=DEVICE, dtype=dtype)
            k4 = torch.randn(batch, sh.kv_heads, new, sh.head_dim, device=DEVICE, dtype=dtype)
            dense = lambda: F.scaled_dot_product_attention(q4, k4, k4, is_causal=True, enable_gqa=True)  # noqa: E731
            sdpa = _try(lambda: bench(dense))
        ref = bench(lambda: K.paged_prefill_attention_ref(*args)) if batch * new <= 8192 else None
        case = f"B={batch} new={new} cached={cached} bs={block_size}"
        report.add("prefill", case, kernel_ms(K.paged_prefill_attention, args), ref, flops, "TFLOP/s", sdpa)
        if sweep:
            _sweep_prefill(report, case, args, flops)


def _sweep_prefill(report: Report, case: str, args: tuple, flops: float) -> None:
    results = []
    for config in [(64, 64, 4, 2), (64, 32, 4, 3), (128, 64, 8, 2), (128, 64, 4, 2), (128, 32, 4, 3),
                   (128, 64, 8, 3), (128, 128, 8, 2), (64, 128, 4, 2)]:
        with mock.patch.object(prefill_mod, "prefill_config", lambda *_: config):
            ms = _try(lambda: kernel_ms(K.paged_prefill_attention, args))
        if ms is not None:
            results.append((ms, "BLOCK_M={} BLOCK_N={} warps={} stages={}".format(*config)))
    best_ms, best = min(results)
    report.add("prefill-best", case, best_ms, None, flops, "TFLOP/s", note=best)


def bench_pointwise(report: Report, sh: Shapes, dtype: torch.dtype) -> None:
    tokens = sh.tokens
    x = torch.randn(tokens, sh.hidden, device=DEVICE, dtype=dtype)
    residual = torch.randn_like(x)
    weight = torch.randn(sh.hidden, device=DEVICE, dtype=dtype)
    size = x.numel() * x.element_size()
    case = f"T={tokens} H={sh.hidden}"
    report.add("rms_norm", case, kernel_ms(K.rms_norm, (x, weight, 1e-5)),
               bench(lambda: K.rms_norm_ref(x, weight, 1e-5)), 2 * size, "GB/s")
    report.add("rms_norm+add", case, kernel_ms(K.rms_norm, (x, weight, 1e-5, residual)),
               bench(lambda: K.rms_norm_ref(x, weight, 1e-5, residual)), 4 * size, "GB/s")

    qkv = torch.randn(tokens, sh.heads + 2 * sh.kv_heads, sh.head_dim, device=DEVICE, dtype=dtype)
    q, k = qkv[:, : sh.heads], qkv[:, sh.heads : sh.heads + sh.kv_heads]
    positions = torch.randint(0, 8192, (tokens,), device=DEVICE)
    cache = K.make_cos_sin_cache(8192, sh.head_dim, base=500000.0, device=DEVICE)
    moved = 2 * (q.numel() + k.numel()) * qkv.element_size()
    report.add("rotary", f"T={tokens} Hq={sh.heads} Hkv={sh.kv_heads}",
               kernel_ms(K.apply_rotary, (q, k, positions, cache)),
               bench(lambda: K.apply_rotary_ref(q, k, positions, cache)), moved, "GB/s")

    gate_up = torch.randn(tokens, 2 * sh.intermediate, device=DEVICE, dtype=dtype)
    moved = 1.5 * gate_up.numel() * gate_up.element_size()
    report.add("silu_and_mul", f"T={tokens} I={sh.intermediate}", kernel_ms(K.silu_and_mul, (gate_up,)),
               bench(lambda: K.silu_and_mul_ref(gate_up)), moved, "GB/s")


def bench_sampling(report: Report, sh: Shapes) -> None:
    for batch in sh.sample_batches:
        logits = torch.randn(batch, sh.vocab, device=DEVICE)
        temperatures = torch.full((batch,), 0.8, device=DEVICE)
        seeds = torch.randint(0, 2**62, (batch,), device=DEVICE)

        def torch_sampler():  # what a torch sampler does: softmax, exponential noise, argmax
            probs = torch.softmax(logits / temperatures[:, None], dim=-1)
            return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)

        report.add("sample", f"B={batch} V={sh.vocab}",
                   kernel_ms(K.sample_from_logits, (logits, temperatures, seeds)),
                   bench(lambda: K.sample_from_logits_ref(logits, temperatures, seeds)), logits.numel() * 4, "GB/s",
                   note=f"torch softmax+exponential_+argmax {bench(torch_sampler):.3f} ms")
        report.add("argmax_lse", f"B={batch} V={sh.vocab}", kernel_ms(K.argmax_logsumexp, (logits,)),
                   bench(lambda: K.argmax_logsumexp_ref(logits)), logits.numel() * 4, "GB/s")


def _try(fn: Callable[[], float]) -> float | None:
    try:
        return fn()
    except Exception as exc:  # a baseline or config the device cannot run: report, go on
        print(f"    (skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="store,decode,prefill,pointwise,sampling",
                        help="comma list of: store, decode, prefill, pointwise, sampling")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--kv-cache-dtype", choices=sorted(KV_CACHE_DTYPE), default="auto",
                        help="the store and attention kernels' cache dtype (auto: --dtype)")
    parser.add_argument("--sweep", action="store_true", help="also try the attention tile configurations")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: checks the script, times nothing useful")
    parser.add_argument("--timing", choices=["graph", "eager"], default="graph",
                        help="kernels inside a CUDA graph over inputs that miss L2 (as the engine runs them), "
                             "or eager triton.testing.do_bench (launch overhead included at small shapes)")
    parser.add_argument("--decode-cases", default="",
                        help="comma list of BxCONTEXT decode shapes to run, e.g. 384x640,1x2048 (default: all)")
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args(argv)
    TIMING["mode"] = args.timing
    DECODE_CASES.clear()
    DECODE_CASES.update(c.strip() for c in args.decode_cases.split(",") if c.strip())
    if DEVICE == "cpu" and not (args.tiny and K.triton_available()):
        print("bench.kernels needs a CUDA GPU (or --tiny with TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    import triton

    device_name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter)"
    print(f"# {device_name} | torch {torch.__version__} | triton {triton.__version__} | {args.dtype}"
          f" | kv cache {args.kv_cache_dtype} | kernels timed: {args.timing}")
    torch.manual_seed(0)
    sh, dtype, only = (TINY if args.tiny else LLAMA3_8B), DTYPES[args.dtype], set(args.only.split(","))
    report = Report()
    kv = KV_CACHE_DTYPE[args.kv_cache_dtype]
    if "store" in only:
        bench_store(report, sh, dtype, kv)
    if "decode" in only:
        bench_decode(report, sh, dtype, args.sweep, kv)
    if "prefill" in only:
        bench_prefill(report, sh, dtype, args.sweep, kv)
    if "pointwise" in only:
        bench_pointwise(report, sh, dtype)
    if "sampling" in only:
        bench_sampling(report, sh)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
