"""The decode attention kernel's split settings, swept at batch 1-8 inside a CUDA graph.

    python3 scripts/decode_split_sweep.py [--json out.json] [--bound 8192]

For each tile (BLOCK_N, warps, stages), MIN_PARTITION (the shortest piece of a long context
one program reads), PROGRAMS_PER_SM (how many programs the splits aim for) and EARLY_READS
(each split's first tile read before waiting for the kernel before it), the decode kernel alone
and fused with rotary and the KV store (``rope_decode_attention``), over 32 layers of paged
K/V (scripts/decode_graph_probe.py's graph), at 1 x 2,048, 1 x 8,192, 8 x 2,048 and 1 x 384
under a graph bound of 8,192. Prints every row, then the default settings' rows and the
fastest of each kind.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_graph_probe import (  # noqa: E402
    HEAD_DIM, HEADS, KV_HEADS, LAYERS, copy_bandwidth, decode_layers, graph_us, write_json,
)

import sluiceway_kernels as K  # noqa: E402


def bench_split_sweep(cases: list[tuple[int, int]], bound: int) -> list[dict]:
    """The decode kernel (alone, and fused with rotary and the KV store) per split setting: its
    tile (BLOCK_N, warps, stages), MIN_PARTITION (tokens a piece of a long context) and
    PROGRAMS_PER_SM (how many programs the splits aim for), at batch x context ``cases``."""
    import sluiceway_kernels._decode_splits as splits
    mod = importlib.import_module("sluiceway_kernels.paged_decode_attention")
    saved = mod.decode_config, mod.MIN_PARTITION, splits.MIN_PARTITION, splits.PROGRAMS_PER_SM, mod.EARLY_READS
    rows = []
    tiles = [(64, 4, 2), (32, 4, 2), (32, 2, 3), (16, 2, 2)]
    try:
        for batch, context in cases:
            caches, tables, lens, positions, slots, qkv, cos_sin = decode_layers(batch, context)
            scale = HEAD_DIM**-0.5
            outs = [torch.empty(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
            kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 2

            def attn():
                for (kc, vc), x, o in zip(caches, qkv, outs):
                    K.paged_decode_attention(x[:, :HEADS], kc, vc, tables, lens, scale, out=o, max_context_len=bound)

            def fused():
                for (kc, vc), x, o in zip(caches, qkv, outs):
                    q, k, v = x[:, :HEADS], x[:, HEADS:HEADS + KV_HEADS], x[:, HEADS + KV_HEADS:]
                    K.rope_decode_attention(q, k, v, kc, vc, tables, lens, slots, positions, cos_sin, scale, out=o,
                                            max_context_len=bound)

            for block_n, warps, stages in tiles:
                original = saved[0]
                mod.decode_config = (lambda *a, whole_contexts=False, _t=(block_n, warps, stages), **k:
                                     original(*a, whole_contexts=True, **k) if whole_contexts else _t)
                for early, mp, pps in [(e, m, p) for e in (False, True) for m in (32, 64, 128) for p in (2, 8)]:
                    if mp < block_n:
                        continue
                    mod.EARLY_READS = early
                    mod.MIN_PARTITION = splits.MIN_PARTITION = mp
                    splits.PROGRAMS_PER_SM = pps
                    n = splits.choose_splits(batch, KV_HEADS, bound, torch.cuda.get_device_properties(0).multi_processor_count,
                                             block_n)
                    for name, fn in (("attn", attn), ("fused", fused)):
                        us = graph_us(fn) / LAYERS
                        rows.append(dict(case=f"sweep_{name}", batch=batch, context=context, early=early, block_n=block_n,
                                         warps=warps, stages=stages, min_partition=mp, programs_per_sm=pps,
                                         host_splits=n, us_per_layer=us, gbs=kv_bytes / (us / 1e6) / 1e9))
    finally:
        mod.decode_config, mod.MIN_PARTITION, splits.MIN_PARTITION, splits.PROGRAMS_PER_SM, mod.EARLY_READS = saved
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--bound", type=int, default=8192, help="max_context_len the graph is captured with")
    args = parser.parse_args()
    copy = copy_bandwidth()
    print(f"copy bandwidth {copy:.0f} GB/s (read + write)")
    rows = []
    for row in bench_split_sweep([(1, 2048), (1, 8192), (8, 2048), (1, 384)], args.bound):
        row["of_copy"] = row["gbs"] / copy
        rows.append(row)
        print(f"{row['case']:12s} B={row['batch']} ctx={row['context']:5d} e={row['early']:d} n={row['block_n']:2d} "
              f"w={row['warps']} s={row['stages']} mp={row['min_partition']:3d} pps={row['programs_per_sm']:2d} "
              f"splits={row['host_splits']:3d} {row['us_per_layer']:7.2f} us/layer {100 * row['of_copy']:3.0f}% of copy")
    defaults = [r for r in rows if not r["early"] and (r["block_n"], r["warps"], r["stages"]) == (64, 4, 2)
                and (r["min_partition"], r["programs_per_sm"]) == (128, 2)]
    for r in defaults:  # the settings before EARLY_READS, then the fastest of each kind
        print(f"default {r['case']:12s} B={r['batch']} ctx={r['context']:5d} {r['us_per_layer']:7.2f} us/layer "
              f"{100 * r['of_copy']:3.0f}% of copy")
    for key in sorted({(r["case"], r["batch"], r["context"], r["early"]) for r in rows}):
        r = min((r for r in rows if (r["case"], r["batch"], r["context"], r["early"]) == key),
                key=lambda r: r["us_per_layer"])
        print(f"best    {r['case']:12s} B={r['batch']} ctx={r['context']:5d} e={r['early']:d} n={r['block_n']:2d} "
              f"w={r['warps']} s={r['stages']} mp={r['min_partition']:3d} pps={r['programs_per_sm']:2d} "
              f"{r['us_per_layer']:7.2f} us/layer {100 * r['of_copy']:3.0f}% of copy")
    if args.json:
        write_json(args.json, copy, rows)


if __name__ == "__main__":
    main()
