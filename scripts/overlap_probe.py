"""How much of a decode step's attention could hide under its GEMMs, on this GPU.

    python3 scripts/overlap_probe.py [--batch 384] [--context 750] [--sustain-s 15] [--json out.json]

Models one decode step of llama3-8b (32 layers, each with its own weights and its own paged
K/V, so nothing stays in L2) and times, per step (median of 10):

- ``attn``: the paged decode attention of the batch, layer after layer;
- ``gemm``: the layer GEMMs (QKV, O, gate/up, down) at M = batch;
- ``serial``: per layer the GEMMs then the attention, one stream (what the engine does);
- ``split_serial``: the batch in two halves, one stream (the price of splitting alone);
- ``split_overlap``: the two halves on two streams, each GEMMs then attention per layer,
  the second half started one GEMM later, so one half's attention can run under the other's
  GEMMs;
- ``independent``: all attention on one stream and all GEMMs on another, with no
  dependencies: the most overlap the hardware gives these kernels.

Then ``--sustain-s`` seconds of back-to-back 8192^3 bf16 matmuls, the rate per second: the
roofline's 20-matmul ceiling against what the board holds at its power limit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import sluiceway_kernels as K
from bench.kernels import LLAMA3_8B, paged_inputs


def timed(fn, repeats: int = 10) -> float:
    """Median milliseconds of ``fn`` (which may use several streams) after two warm-ups."""
    times = []
    for i in range(repeats + 2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=384)
    ap.add_argument("--context", type=int, default=750)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--sustain-s", type=float, default=15.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sh, dtype, dev = LLAMA3_8B, torch.bfloat16, "cuda"
    torch.manual_seed(0)
    b, half = args.batch, args.batch // 2
    qkv_out = (sh.heads + 2 * sh.kv_heads) * sh.head_dim
    layers = []
    for _ in range(args.layers):
        x = paged_inputs(sh, [args.context] * b, [1] * b, 16, dtype)
        layers.append(dict(
            wqkv=torch.randn(qkv_out, sh.hidden, device=dev, dtype=dtype) * 0.02,
            wo=torch.randn(sh.hidden, sh.heads * sh.head_dim, device=dev, dtype=dtype) * 0.02,
            wgu=torch.randn(2 * sh.intermediate, sh.hidden, device=dev, dtype=dtype) * 0.02,
            wd=torch.randn(sh.hidden, sh.intermediate, device=dev, dtype=dtype) * 0.02,
            **x,
        ))
    hidden = torch.randn(b, sh.hidden, device=dev, dtype=dtype)
    act = torch.randn(b, sh.intermediate, device=dev, dtype=dtype)
    scale = sh.head_dim**-0.5

    def gemms(layer, rows: slice) -> None:
        h = hidden[rows]
        F.linear(h, layer["wqkv"])
        F.linear(h, layer["wo"])
        F.linear(h, layer["wgu"])
        F.linear(act[rows], layer["wd"])

    def attention(layer, rows: slice) -> None:
        K.paged_decode_attention(layer["q"][rows], layer["k_cache"], layer["v_cache"], layer["block_tables"][rows],
                                 layer["context_lens"][rows], scale)

    everything, first, second = slice(0, b), slice(0, half), slice(half, b)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def run_attn() -> None:
        for layer in layers:
            attention(layer, everything)

    def run_gemm() -> None:
        for layer in layers:
            gemms(layer, everything)

    def run_serial() -> None:
        for layer in layers:
            gemms(layer, everything)
            attention(layer, everything)

    def run_split_serial() -> None:
        for layer in layers:
            for rows in (first, second):
                gemms(layer, rows)
                attention(layer, rows)

    def run_split_overlap() -> None:
        main_stream = torch.cuda.current_stream()
        s1.wait_stream(main_stream)
        s2.wait_stream(main_stream)
        started = torch.cuda.Event()
        with torch.cuda.stream(s1):
            for i, layer in enumerate(layers):
                gemms(layer, first)
                if i == 0:
                    started.record()
                attention(layer, first)
        with torch.cuda.stream(s2):
            s2.wait_event(started)
            for layer in layers:
                gemms(layer, second)
                attention(layer, second)
        main_stream.wait_stream(s1)
        main_stream.wait_stream(s2)

    def run_independent() -> None:
        main_stream = torch.cuda.current_stream()
        s1.wait_stream(main_stream)
        s2.wait_stream(main_stream)
        with torch.cuda.stream(s1):
            run_attn()
        with torch.cuda.stream(s2):
            run_gemm()
        main_stream.wait_stream(s1)
        main_stream.wait_stream(s2)

    result = dict(batch=b, context=args.context, layers=args.layers, device=torch.cuda.get_device_name(),
                  torch=torch.__version__)
    for name, fn in (("attn", run_attn), ("gemm", run_gemm), ("serial", run_serial),
                     ("split_serial", run_split_serial), ("split_overlap", run_split_overlap),
                     ("independent", run_independent)):
        result[name + "_ms"] = timed(fn)
        print(f"{name:<14} {result[name + '_ms']:8.2f} ms per step", flush=True)
    kv_bytes = 2 * b * args.context * sh.kv_heads * sh.head_dim * 2 * args.layers
    print(f"attention reads {kv_bytes / 1e9:.1f} GB: {kv_bytes / result['attn_ms'] / 1e6:.0f} GB/s", flush=True)
    del layers
    torch.cuda.empty_cache()

    n = 8192
    a = torch.randn(n, n, device=dev, dtype=dtype)
    c = torch.randn(n, n, device=dev, dtype=dtype)
    out = torch.empty(n, n, device=dev, dtype=dtype)
    rates = []
    t_end = time.perf_counter() + args.sustain_s
    while time.perf_counter() < t_end:
        torch.cuda.synchronize()
        t0, count = time.perf_counter(), 0
        while time.perf_counter() - t0 < 1.0:
            for _ in range(10):
                torch.matmul(a, c, out=out)
            count += 10
            torch.cuda.synchronize()
        rates.append(2 * n**3 * count / (time.perf_counter() - t0) / 1e12)
    result["sustained_tflops_per_s"] = rates
    print("sustained 8192^3 bf16 matmul, TFLOP/s each second:", " ".join(f"{r:.0f}" for r in rates), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
