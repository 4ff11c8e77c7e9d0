"""Compile every kernel variant the launchers pick for a GPU, on a machine without one.

    python -m sluiceway_kernels.compile_check [--arch 90] [--quick] [--quiet] [--jobs N] [--[no-]pdl] [--only NAME]
    python -m sluiceway_kernels.compile_check --step-shapes

The Triton interpreter forgives things the compiler rejects (types, layouts, early returns,
loop-carried values). This runs each launcher on small CPU tensors with the launch
intercepted, compiles what it would have launched down to a cubin with the ptxas that ships
with triton, and prints shared memory, registers and local memory (spills) per variant. It needs triton's
NVIDIA backend but no GPU; CI runs it through tests/kernels/test_compile_check.py.

``--step-shapes`` checks instead that the values which change from one engine step to the
next (batch size, block-table width, split count, offsets into the packed metadata) keep
each kernel on one specialisation, so that serving never compiles mid-run.
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from contextlib import contextmanager

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("run without TRITON_INTERPRET: this compiles the kernels instead of interpreting them")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import sluiceway_kernels as K  # noqa: E402
import sluiceway_kernels._common as common  # noqa: E402
from sluiceway_kernels._common import FP8_KV_DTYPE, dot_options  # noqa: E402

# whether the kernels that take programmatic dependent launch are compiled with it, as a GPU of
# the checked arch launches them (``--pdl``; main sets it)
COMPILE_PDL = False


@contextmanager
def intercepted_launches():
    """Collect (kernel, args, kwargs) of every launch instead of running it."""
    launches = []
    original = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    JITFunction.run = record
    # the launchers accept CPU tensors only when interpreting
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield launches
    finally:
        JITFunction.run = original
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


def _signature(fn: JITFunction, args: tuple, kwargs: dict) -> tuple[dict, dict, dict, dict]:
    """What a real launch would specialise on: types, constexprs, 16-divisible ints/pointers."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    values = dict(zip(fn.arg_names, args, strict=False)) | kwargs
    options = {k: values.pop(k) for k in ("num_warps", "num_stages") if k in values}
    signature, constexprs, attrs = {}, {}, {}
    for index, (name, param) in enumerate(zip(fn.arg_names, fn.params, strict=False)):
        value = values[name]
        if param.is_constexpr:
            signature[name] = "constexpr"
            if name in ("DOT_UPCAST", "DOT_HALF"):  # as a GPU picks them, not the interpreter
                value = dot_options(values["q_ptr"].dtype, values["k_cache_ptr"].dtype, interpreted=False)[name]
            if name == "UPCAST":  # silu_mul_gemv's: a GPU keeps half-precision dots
                value = False
            if name == "PDL":  # launched with programmatic dependent launch, or not
                value = COMPILE_PDL
                if value:
                    options["launch_pdl"] = True
            constexprs[name] = value
            continue
        kind, attr = native_specialize_impl(
            BaseBackend, value, param.is_const, not param.do_not_specialize, not param.do_not_specialize_on_alignment
        )[:2]
        signature[name] = kind
        if kind == "constexpr":  # ints equal to 1 are baked in, as at launch
            constexprs[name] = value
        elif attr:
            attrs[(index,)] = BaseBackend.parse_attr(attr)
    return signature, constexprs, attrs, options


def _resource_usage(cubin: bytes) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        try:
            run = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True)
        except OSError:
            return "regs=? local=?"
    regs = re.search(r"REG:(\d+)", run.stdout)
    local = re.search(r"LOCAL:(\d+)", run.stdout)  # bytes per thread: register spills
    return f"regs={regs.group(1) if regs else '?'} local={local.group(1) if local else '?'}B"


MODEL_SHAPES = [  # dtype, Hq, Hkv, D, block_size
    (torch.bfloat16, 32, 8, 128, 16),  # Llama-3-8B
    (torch.float32, 4, 2, 80, 16),  # fp32, odd head_dim
    (torch.float16, 28, 4, 128, 32),  # Qwen2-7B: a group of 7
    (torch.bfloat16, 16, 16, 64, 8),  # MHA, small head
    (torch.bfloat16, 8, 1, 256, 64),  # MQA, wide head
]


def exercise_launchers(quick: bool = False) -> None:
    """Call each launcher in the configurations the engine uses (quick: the first only)."""
    from sluiceway_kernels.rotary import make_cos_sin_cache

    for dtype, heads, kv_heads, head_dim, block_size in MODEL_SHAPES[: 1 if quick else None]:
        q = torch.zeros(6, heads, head_dim, dtype=dtype)
        tables = torch.zeros(2, 4, dtype=torch.int32)
        lens = torch.tensor([5, 7], dtype=torch.int32)
        starts = torch.tensor([0, 3, 6], dtype=torch.int32)
        for cache_dtype in (dtype, FP8_KV_DTYPE):  # the model's dtype, and kv_cache_dtype="fp8"
            cache = torch.zeros(8, block_size, kv_heads, head_dim, dtype=cache_dtype)
            K.store_kvcache(q[:, :kv_heads], q[:, :kv_heads], cache, cache.clone(), torch.arange(6))
            # a prompt step's rotary and KV store in one launch
            K.rope_store(q, q[:, :kv_heads], q[:, :kv_heads], cache, cache.clone(), torch.arange(6), torch.arange(6),
                         make_cos_sin_cache(8, head_dim))
            for max_query_len in (3, 512):  # short and long query tiles
                K.paged_prefill_attention(q, cache, cache.clone(), starts, lens, tables, 0.1, max_query_len)
            for partition in (None, 512):  # split-K merged in-kernel; one partition
                K.paged_decode_attention(q[:2], cache, cache.clone(), tables, lens, 0.1, max_context_len=2048,
                                         partition_size=partition)
                # a decode step's fused rotary + KV store + attention
                K.rope_decode_attention(q[:2], q[:2, :kv_heads], q[:2, :kv_heads], cache, cache.clone(), tables, lens,
                                        torch.arange(2), torch.arange(2), make_cos_sin_cache(8, head_dim), 0.1,
                                        max_context_len=2048, partition_size=partition)
        # a float8 cache with a checkpoint's per-layer K/V scales
        scales = dict(k_scale=torch.ones(1), v_scale=torch.ones(1))
        K.store_kvcache(q[:, :kv_heads], q[:, :kv_heads], cache, cache.clone(), torch.arange(6), **scales)
        K.rope_store(q, q[:, :kv_heads], q[:, :kv_heads], cache, cache.clone(), torch.arange(6), torch.arange(6),
                     make_cos_sin_cache(8, head_dim), **scales)
        K.paged_prefill_attention(q, cache, cache.clone(), starts, lens, tables, 0.1, 512, **scales)
        K.paged_decode_attention(q[:2], cache, cache.clone(), tables, lens, 0.1, max_context_len=2048, **scales)
        K.rope_decode_attention(q[:2], q[:2, :kv_heads], q[:2, :kv_heads], cache, cache.clone(), tables, lens,
                                torch.arange(2), torch.arange(2), make_cos_sin_cache(8, head_dim), 0.1,
                                max_context_len=2048, **scales)
        K.apply_rotary(q, q[:, :kv_heads], torch.arange(6), make_cos_sin_cache(8, head_dim))
        # decode attention's first tile read before the PDL wait (EARLY_READS, built and off)
        decode_module = importlib.import_module("sluiceway_kernels.paged_decode_attention")
        early = decode_module.EARLY_READS
        decode_module.EARLY_READS = True
        try:
            K.paged_decode_attention(q[:2], cache, cache.clone(), tables, lens, 0.1, max_context_len=2048)
            K.rope_decode_attention(q[:2], q[:2, :kv_heads], q[:2, :kv_heads], cache, cache.clone(), tables, lens,
                                    torch.arange(2), torch.arange(2), make_cos_sin_cache(8, head_dim), 0.1,
                                    max_context_len=2048)
        finally:
            decode_module.EARLY_READS = early
    for dtype in (torch.bfloat16,) if quick else (torch.bfloat16, torch.float32):
        x = torch.zeros(4, 8192, dtype=dtype)
        K.rms_norm(x, torch.ones(8192, dtype=dtype), 1e-6)
        K.rms_norm(x[:, :4096], torch.ones(4096, dtype=dtype), 1e-6, residual=x[:, :4096])
        K.silu_and_mul(x)
        for split_k in (1, 4):  # the down projection with SwiGLU in its prologue
            K.silu_mul_linear(x[:2], torch.zeros(256, 4096, dtype=dtype), split_k=split_k)
            # small-batch products: plain, the norm (and residual) folded in, SwiGLU folded out;
            # tensor-core tiles (one row: its prologue computed for that row alone), and
            # multiply-adds over one row and over eight
            w, norm_w = torch.zeros(256, 4096, dtype=dtype), torch.ones(4096, dtype=dtype)
            w_o = torch.zeros(4096, 4096, dtype=dtype)
            for rows, dot in ((2, True), (1, True), (1, False), (8, False)):
                K.small_m_linear(x[:rows, :4096], w, split_k=split_k, dot=dot)
                K.small_m_linear(x[:rows, :4096], w, norm_w, split_k=split_k, dot=dot)
                K.small_m_linear(x[:rows, :4096], w, norm_w, residual=x[:rows, 4096:], silu_mul=True,
                                 split_k=split_k, dot=dot)
                # the other side: SwiGLU in the prologue, the norm after (a llama3-8b row, 4,096 wide)
                K.small_m_linear(x[:rows], w, silu_in=True, split_k=split_k, dot=dot)
                K.small_m_linear(x[:rows, :4096], w_o, norm_after=norm_w, residual=x[:rows, 4096:],
                                 split_k=split_k, dot=dot)
                K.small_m_linear(x[:rows], w_o, silu_in=True, norm_after=norm_w, residual=x[:rows, 4096:],
                                 split_k=split_k, dot=dot)
        # quantization="fp8": norms and SiLU·mul quantizing their outputs, the standalone
        # per-token quantization (given scales too) and the unit-scale product's epilogue
        K.rms_norm(x[:, :4096], torch.ones(4096, dtype=dtype), 1e-6, residual=x[:, :4096], quantize=True)
        K.silu_and_mul_fp8(x)
        K.silu_and_mul_fp8(torch.zeros(1, 28672, dtype=dtype))  # llama3-8b's, split over programs
        K.per_token_quant_fp8(x)
        K.per_token_quant_fp8(x, torch.ones(4, 1))
        K.scale_epilogue(torch.zeros(4, 4096), torch.ones(4, 1), torch.ones(4096), None, dtype)
        # products left unscaled (UnscaledProduct): the norm after o and down, SiLU-mul after gate/up
        from sluiceway_kernels.fp8_quant import UnscaledProduct

        unscaled = UnscaledProduct(torch.zeros(4, 4096), torch.ones(4, 1), torch.ones(4096), None, dtype)
        K.rms_norm(unscaled, torch.ones(4096, dtype=dtype), 1e-6, residual=x[:, :4096], quantize=True)
        K.rms_norm(unscaled, torch.ones(4096, dtype=dtype), 1e-6, residual=x[:, :4096])
        K.silu_and_mul_fp8(unscaled._replace(y=torch.zeros(4, 8192), col_scale=torch.ones(8192)))
        # gate/up's scales left to SiLU-mul at batch 1 (llama3-8b's width, the row split over programs)
        K.silu_and_mul_fp8(unscaled._replace(y=torch.zeros(1, 28672), row_scale=torch.ones(1, 1),
                                             col_scale=torch.ones(28672)))
    fp8 = torch.zeros(16, 4096, dtype=torch.float8_e4m3fn)
    # the small-M W8A8 product: llama3-8b's o projection (split over the inner dim), bf16 and fp32 out
    fp8_o = torch.zeros(4096, 4096, dtype=torch.float8_e4m3fn)
    for dtype in (torch.bfloat16, torch.float32):
        K.fp8_small_m_matmul(fp8[:8, :4096], torch.ones(8, 1), fp8_o, torch.ones(4096), None, dtype, split_k=4)
        K.fp8_small_m_matmul(fp8[:1, :4096], torch.ones(1, 1), fp8_o, torch.ones(4096), torch.zeros(4096), dtype)
        # float rows quantized in the launch (o's input, attention's output), with and without the norm after
        K.fp8_small_m_matmul(torch.zeros(1, 4096, dtype=dtype), None, fp8_o, torch.ones(4096), None, dtype)
        K.fp8_small_m_matmul(torch.zeros(1, 4096, dtype=dtype), None, fp8_o, torch.ones(4096), None, dtype,
                             norm_after=torch.ones(4096), residual=torch.zeros(1, 4096, dtype=dtype), quantize=True)
        for quantize in (False, True):  # the norm after it, its output quantized for the next product
            K.fp8_small_m_matmul(fp8[:1, :4096], torch.ones(1, 1), fp8_o, torch.ones(4096), None, dtype,
                                 norm_after=torch.ones(4096), residual=torch.zeros(1, 4096, dtype=dtype),
                                 quantize=quantize)
    K.sample_from_logits(torch.zeros(2, 128256), torch.ones(2), torch.arange(2), num_splits=8)
    K.sample_from_logits(torch.zeros(2, 128256), torch.ones(2), torch.arange(2), num_splits=1)
    for splits in (8, 1):
        K.argmax_logsumexp(torch.zeros(2, 128256), num_splits=splits)
        K.argmax_logsumexp(torch.zeros(2, 128256, dtype=torch.bfloat16), num_splits=splits)


def exercise_step_shapes() -> None:
    """Launch the attention, KV-store, rotary, sampling and argmax/logsumexp kernels across
    step shapes that differ in every value Triton could specialise on: ones, multiples of 16,
    and 16-byte alignment."""
    from sluiceway_kernels.rotary import make_cos_sin_cache

    heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    cache = torch.zeros(64, block_size, kv_heads, head_dim, dtype=torch.bfloat16)
    cos_sin = make_cos_sin_cache(64, head_dim)

    def packed(values: list[int], offset: int) -> torch.Tensor:
        """``values`` at ``offset`` int32s into a buffer, as the model runner packs a step."""
        buffer = torch.zeros(offset + len(values), dtype=torch.int32)
        buffer[offset:] = torch.tensor(values, dtype=torch.int32)
        return buffer[offset:]

    for batch, width, offset in [(1, 1, 0), (3, 5, 1), (16, 16, 2), (17, 33, 3), (5, 2, 7)]:
        q = torch.zeros(batch, heads, head_dim, dtype=torch.bfloat16)
        tables = packed([0] * batch * width, offset).view(batch, width)
        lens = packed([block_size * width] * batch, offset + 1)
        for splits in (2, 3, 16, 17):
            K.paged_decode_attention(q, cache, cache, tables, lens, 0.1, max_context_len=256 * splits,
                                     partition_size=256)
            K.rope_decode_attention(q, q[:, :kv_heads], q[:, :kv_heads], cache, cache, tables, lens,
                                    packed(list(range(batch)), offset), packed(list(range(batch)), offset + 2), cos_sin,
                                    0.1, max_context_len=128 * splits, partition_size=128)
        tokens = 4 * batch
        starts = packed(list(range(0, tokens + 1, 4)), offset)
        K.paged_prefill_attention(torch.zeros(tokens, heads, head_dim, dtype=torch.bfloat16), cache, cache,
                                  starts, lens, tables, 0.1, 4)
        kv = torch.zeros(tokens, kv_heads, head_dim, dtype=torch.bfloat16)
        K.store_kvcache(kv, kv, cache, cache, packed(list(range(tokens)), offset))
        K.apply_rotary(torch.zeros(tokens, heads, head_dim), torch.zeros(tokens, kv_heads, head_dim),
                       packed(list(range(tokens)), offset), cos_sin)
        qkv = torch.zeros(tokens, heads + 2 * kv_heads, head_dim, dtype=torch.bfloat16)
        K.rope_store(qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:], cache, cache,
                     packed(list(range(tokens)), offset), packed(list(range(tokens)), offset + 1), cos_sin)
        # a decode batch of 1-8 through the small-batch products (one variant whatever the batch)
        rows = min(batch, 8)
        hidden = torch.zeros(rows, 4096, dtype=torch.bfloat16)
        K.small_m_linear(hidden, torch.zeros(256, 4096, dtype=torch.bfloat16), torch.ones(4096, dtype=torch.bfloat16),
                         residual=hidden.clone(), silu_mul=True)
        # the sampler's per-row parameters as slices of larger buffers
        temperatures = torch.ones(offset + batch)[offset:]
        seeds = torch.arange(offset + batch)[offset:]
        K.sample_from_logits(torch.zeros(batch, 128256), temperatures, seeds)  # splits follow the batch
        K.argmax_logsumexp(torch.zeros(batch, 128256))


ONE_CONFIGURATION = ("_argmax_lse_split_kernel", "_argmax_lse_reduce_kernel")


def check_step_shapes() -> int:
    """1 if any kernel configuration met more than one specialisation across step shapes."""
    with intercepted_launches() as launches:
        exercise_step_shapes()
    variants: dict[tuple[str, str, str], set[tuple[str, str]]] = {}
    for fn, args, kwargs in launches:
        signature, constexprs, attrs, options = _signature(fn, args, kwargs)
        variants.setdefault((fn.__name__, str(constexprs), str(options)), set()).add((str(signature), str(attrs)))
    failures = 0
    for (name, constexprs, _), seen in sorted(variants.items()):
        failures += len(seen) > 1
        print(f"{'ok  ' if len(seen) == 1 else 'FAIL'} {name} {constexprs}: {len(seen)} variant(s)")
        if len(seen) > 1:
            for signature, attrs in sorted(seen):
                print(f"     {attrs}")
    # kernels whose tile sizes must not follow the batch either (the sampler's runs every step)
    for name in ONE_CONFIGURATION:
        configs = {constexprs for (kernel, constexprs, _) in variants if kernel == name}
        failures += len(configs) != 1
        print(f"{'ok  ' if len(configs) == 1 else 'FAIL'} {name}: {len(configs)} configuration(s) across step shapes")
    return 1 if failures else 0


_VARIANTS: list[tuple] = []  # (fn, signature, constexprs, attrs, options) of each distinct launch

# NOTE: kernels that stream a weight or a row of logits, and how many 1- or 2-byte global loads
# their PTX may hold (a few scalars: norm weights, single rows). A split whose start the compiler
# cannot prove aligned makes every element a load of its own: small_m_linear's weight came in
# 64-96 `ld.global.b16` and read at 44-67% of copy bandwidth on an H100.
STREAMING = ("_small_m_linear_kernel", "_silu_mul_gemv_kernel", "_argmax_lse_split_kernel")
MAX_NARROW_LOADS = 8
_NARROW_LOAD = re.compile(r"\bld\.global(?:\.[a-z]+)*\.[bsu](?:8|16)\b")


def narrow_loads(ptx: str) -> int:
    """Scalar global loads of 1 or 2 bytes in ``ptx`` (vector and ``cp.async`` loads not counted)."""
    return len(_NARROW_LOAD.findall(ptx))


def _compile_variant(index: int, arch: int) -> tuple[bool, str]:
    """Compile ``_VARIANTS[index]`` for ``sm_{arch}``: whether it compiled, and its report line."""
    fn, signature, constexprs, attrs, options = _VARIANTS[index]
    label = f"{fn.__name__} {constexprs} {options}"
    try:
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    except Exception as exc:  # report every failing variant, not just the first
        return False, f"FAIL {label}\n     {type(exc).__name__}: {str(exc).strip()[:2000]}"
    ptx = compiled.asm["ptx"]
    narrow = narrow_loads(ptx)
    if "PDL" in constexprs and constexprs["PDL"] != ("griddepcontrol.wait" in ptx
                                                     and "griddepcontrol.launch_dependents" in ptx):
        return False, (f"FAIL {label}\n     with PDL={constexprs['PDL']} its PTX should "
                       f"{'' if constexprs['PDL'] else 'not '}wait for the kernel before it and release the next")
    if fn.__name__ in STREAMING and narrow > MAX_NARROW_LOADS:
        return False, (f"FAIL {label}\n     streams its input in {narrow} loads of 1-2 bytes"
                       f" (at most {MAX_NARROW_LOADS}): the compiler cannot prove its tiles aligned")
    return True, (f"ok   {label} smem={compiled.metadata.shared} {_resource_usage(compiled.asm['cubin'])}"
                  f" narrow_loads={narrow}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 for H100/H200")
    parser.add_argument("--quiet", action="store_true", help="print failures only")
    parser.add_argument("--quick", action="store_true", help="one model shape instead of five")
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1),
                        help="variants compiled at once (forked processes)")
    parser.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=None,
                        help="compile the kernels that take it with programmatic dependent launch (default: as "
                             "sluiceway_kernels._common.PDL says, for an arch of 90 or later)")
    parser.add_argument("--only", default=None, help="compile only the kernels whose name contains this")
    parser.add_argument("--step-shapes", action="store_true",
                        help="check that per-step values never select a new kernel variant")
    parsed = parser.parse_args(argv)
    global COMPILE_PDL
    COMPILE_PDL = (common.PDL and parsed.arch >= 90) if parsed.pdl is None else parsed.pdl
    if parsed.step_shapes:
        return check_step_shapes()
    with intercepted_launches() as launches:
        exercise_launchers(parsed.quick)
    seen, variants = set(), []
    for fn, args, kwargs in launches:
        if parsed.only and parsed.only not in fn.__name__:
            continue
        signature, constexprs, attrs, options = _signature(fn, args, kwargs)
        key = (fn.__name__, str(signature), str(constexprs), str(attrs), str(options))
        if key not in seen:
            seen.add(key)
            variants.append((fn, signature, constexprs, attrs, options))
    _VARIANTS[:] = variants
    jobs = max(1, min(parsed.jobs, len(variants)))
    if jobs > 1 and not torch.cuda.is_initialized():
        # NOTE: forked, the workers find the variants (JIT functions, which do not pickle) in _VARIANTS
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            outcomes = pool.starmap(_compile_variant, [(i, parsed.arch) for i in range(len(variants))])
    else:
        outcomes = [_compile_variant(i, parsed.arch) for i in range(len(variants))]
    failures = 0
    for ok, line in outcomes:
        failures += not ok
        if not ok or not parsed.quiet:
            print(line)
    print(f"{len(seen) - failures}/{len(seen)} kernel variants compiled for sm_{parsed.arch}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
