"""Time one decoder layer's four matmuls of a preset (llama3-8b by default) in bf16 and in FP8,
inside a CUDA graph (8 layers' weights, so the weights come from HBM, not L2), by token count.

    python scripts/fp8_gemm_probe.py --tokens 1,8,16,32,64,512,2048,8192 --json out.json

Variants: bf16 ``F.linear``; ``fp8`` = the engine's ``fp8_linear`` (per-token quantization
included, small-M path below SMALL_M); ``rowwise`` = ``torch._scaled_mm`` with rowwise
scales on pre-quantized inputs; ``unit+epilogue`` = unit scales into fp32 plus the scale
epilogue kernel; ``tensorwise`` = unit scales, bf16 out (no per-channel scales: a ceiling);
``small-m`` (up to 16 tokens) = sluiceway_kernels/fp8_small_m.py, scales fused.

``--per-product``: each of the layer's four products alone (qkv, o, gate/up, down), its weights'
read rate and its share of the copy rate (a 2 GiB device-to-device copy in a graph), to choose
per projection between cuBLASLt and our split-K kernel at small batch:

    python scripts/fp8_gemm_probe.py --per-product --tokens 1,8
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from engine.layers.fp8 import fp8_linear, quantize_rows
from engine.models.presets import preset_config
from sluiceway_kernels.fp8_quant import per_token_quant_fp8, scale_epilogue
from sluiceway_kernels.fp8_small_m import MAX_TOKENS, fp8_small_m_matmul

LAYERS = 8
# fp8_small_m tiles timed beside its default (BLOCK_N, BLOCK_K, warps, stages)
SMALL_M_CONFIGS = [(64, 256, 4, 4), (32, 256, 4, 4), (64, 512, 4, 3), (128, 256, 4, 4), (64, 256, 8, 4),
                   (32, 512, 4, 4), (64, 128, 4, 6)]


def layer_shapes(config) -> list[tuple[int, int]]:
    h, heads = config.hidden_size, config.num_attention_heads
    kv, d = config.num_key_value_heads, h // heads
    return [(h, (heads + 2 * kv) * d), (heads * d, h), (h, 2 * config.intermediate_size), (config.intermediate_size, h)]


def graph_time_us(fn, replays: int = 10) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def copy_gbs() -> float:
    """The device's copy rate (GB/s, bytes read + written) of a 2 GiB buffer, in a graph."""
    src = torch.empty(2**30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / graph_time_us(lambda: dst.copy_(src)) / 1e3


def per_product(args, shapes) -> list[dict]:
    """Each product of a layer timed alone over LAYERS layers' weights of its shape, per token count."""
    names = ["qkv", "o", "gate_up", "down"]
    copy = copy_gbs()
    print(f"copy: {copy:.0f} GB/s", flush=True)
    one = torch.ones((), device="cuda")
    rows = []
    for (k, n), name in zip(shapes, names):
        bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
        fp8 = [quantize_rows(w) for w in bf16]
        for m in [int(t) for t in args.tokens.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = per_token_quant_fp8(x)
            variants = {
                "bf16": (2, lambda: [F.linear(x, w) for w in bf16]),
                "unit": (1, lambda: [torch._scaled_mm(xq, q.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
                                     for q, _ in fp8]),
                "unit+epilogue": (1, lambda: [scale_epilogue(torch._scaled_mm(
                    xq, q.t(), scale_a=one, scale_b=one, out_dtype=torch.float32), xs, s, None, torch.bfloat16)
                    for q, s in fp8]),
                "tensorwise": (1, lambda: [torch._scaled_mm(xq, q.t(), scale_a=one, scale_b=one,
                                                            out_dtype=torch.bfloat16) for q, _ in fp8]),
            }
            if m <= MAX_TOKENS:
                for c in SMALL_M_CONFIGS:
                    variants[f"small-m {'x'.join(map(str, c))}"] = (1, lambda c=c: [
                        fp8_small_m_matmul(xq, xs, q, s, None, torch.bfloat16, config=c) for q, s in fp8])
            row = dict(product=name, k=k, n=n, tokens=m)
            for variant, (width, fn) in variants.items():
                try:
                    us = graph_time_us(fn) / LAYERS
                    gbs = n * k * width / us / 1e3
                    row[variant] = dict(us=us, gbs=gbs, of_copy=gbs / copy)
                except Exception as err:  # noqa: BLE001 - report the variant as failed, keep the others
                    row[variant] = dict(error=f"{type(err).__name__}: {err}"[:300])
            rows.append(row)
            cells = "  ".join(f"{v} {r['us']:.1f} us ({100 * r['of_copy']:.0f}%)" if "us" in r else f"{v} failed"
                              for v, r in row.items() if isinstance(r, dict))
            print(f"{name:7s} M={m:3d}: {cells}", flush=True)
    return [dict(copy_gbs=copy), *rows]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--tokens", default="1,8,16,32,64,512,2048,8192")
    parser.add_argument("--per-product", action="store_true",
                        help="each product of a layer alone, its read rate against the copy rate")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    config = preset_config(args.model)
    shapes = layer_shapes(config)
    torch.manual_seed(0)
    if args.per_product:
        rows = per_product(args, shapes)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(model=args.model, torch=torch.__version__, gpu=torch.cuda.get_device_name(),
                               rows=rows), f, indent=2)
        return
    bf16 = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for k, n in shapes] for _ in range(LAYERS)]
    fp8 = [[quantize_rows(w) for w in layer] for layer in bf16]
    one = torch.ones((), device="cuda")
    rows = []
    for m in [int(t) for t in args.tokens.split(",")]:
        xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for k, _ in shapes]
        qx = [per_token_quant_fp8(x) for x in xs]
        flops = LAYERS * sum(2 * m * k * n for k, n in shapes)

        def run_bf16():
            for layer in bf16:
                for x, w in zip(xs, layer):
                    F.linear(x, w)

        def run_fp8():
            for layer in fp8:
                for x, (q, s) in zip(xs, layer):
                    fp8_linear(x, q, s)

        def run_rowwise():
            for layer in fp8:
                for (xq, xsc), (q, s) in zip(qx, layer):
                    torch._scaled_mm(xq, q.t(), scale_a=xsc, scale_b=s.view(1, -1), out_dtype=torch.bfloat16)

        def run_unit_epilogue():
            for layer in fp8:
                for (xq, xsc), (q, s) in zip(qx, layer):
                    y = torch._scaled_mm(xq, q.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
                    scale_epilogue(y, xsc, s, None, torch.bfloat16)

        def run_tensorwise():
            for layer in fp8:
                for (xq, _), (q, _) in zip(qx, layer):
                    torch._scaled_mm(xq, q.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

        def small_m(config):
            def run():
                for layer in fp8:
                    for (xq, xsc), (q, s) in zip(qx, layer):
                        fp8_small_m_matmul(xq, xsc, q, s, None, torch.bfloat16, config=config)
            return run

        variants = [("bf16", run_bf16), ("fp8", run_fp8), ("rowwise", run_rowwise),
                    ("unit+epilogue", run_unit_epilogue), ("tensorwise", run_tensorwise)]
        if m <= MAX_TOKENS:  # sluiceway_kernels/fp8_small_m.py, split over K: its default tiles and others
            variants += [(f"small-m {'x'.join(map(str, c))}", small_m(c)) for c in SMALL_M_CONFIGS]
        row = dict(tokens=m)
        for name, fn in variants:
            try:
                us = graph_time_us(fn) / LAYERS
                row[name] = dict(us_per_layer=us, tflops=flops / LAYERS / us / 1e6)
            except Exception as err:  # noqa: BLE001 - report the variant as failed, keep the others
                row[name] = dict(error=f"{type(err).__name__}: {err}"[:300])
        rows.append(row)
        cells = "  ".join(f"{k} {v['us_per_layer']:.1f} us ({v['tflops']:.0f})" if "us_per_layer" in v
                          else f"{k} failed" for k, v in row.items() if k != "tokens")
        print(f"M={m:5d}: {cells}", flush=True)
    weight_bytes = sum(k * n for k, n in shapes)
    print(f"one layer's weights: {weight_bytes / 1e6:.0f} MB in fp8, {2 * weight_bytes / 1e6:.0f} MB in bf16")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, torch=torch.__version__, gpu=torch.cuda.get_device_name(), rows=rows),
                      f, indent=2)


if __name__ == "__main__":
    main()
