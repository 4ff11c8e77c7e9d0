"""Does prefetching the next weights into L2, beside a batch-1 layer's latency-bound kernels, pay?

    python3 scripts/l2_prefetch_probe.py [--context 256] [--json out.json]

Issue 23 asks for batch-1 GEMVs at the copy bandwidth "with the next layer's weights prefetched
where the hardware allows". A batch-1 llama3-8b layer reads ~436 MB of weights in four GEMVs;
between them run kernels that read almost nothing and are bound by latency (attention over a
short context, RMSNorm, SiLU·mul), during which HBM idles. This probe replays, in one CUDA
graph, 32 such layers (each its own weights and paged K/V) as the engine runs them:

    norm -> qkv GEMV -> rotary+store+attention -> o GEMV -> add+norm -> gate/up GEMV
    -> SiLU·mul -> down GEMV

and again with a second stream of the graph that, while a latency-bound kernel runs, pulls the
next GEMV's first bytes into L2 (``prefetch.global.L2::evict_last`` per 128-byte line, or a
plain load kept in L2), so that GEMV starts on L2 hits. Variants:

- ``base``: the chain alone;
- ``o@attn``: the o projection's weights (32 MB) fetched during the attention;
- ``all``: also the first ``--lead-mb`` of each GEMV's weights during the kernel before it;
- each with ``prefetch`` (no data waited for) and ``load`` (data read into registers).

Reports microseconds per layer and per token (x32), the GEMVs alone and the share of copy
bandwidth the whole chain's weight bytes reach.
"""

from __future__ import annotations

import argparse
import json

import torch

import sluiceway_kernels as K
from decode_graph_probe import copy_bandwidth, graph_us  # scripts/, beside this file
from sluiceway_kernels._common import tl, triton

LAYERS = 32
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, BLOCK = 4096, 32, 8, 128, 14336, 16
LINE = 128  # bytes per L2 line


@triton.jit
def _prefetch_kernel(ptr, num_lines, LINES: tl.constexpr, PREFETCH: tl.constexpr):
    """Pull ``num_lines`` 128-byte lines from ``ptr`` (bytes) into L2."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * LINES
    base = ptr.to(tl.pointer_type(tl.int8))
    acc = tl.zeros((LINES,), tl.int32)
    for start in range(pid * LINES, num_lines, step):
        lines = tl.minimum(start + tl.arange(0, LINES), num_lines - 1)
        addr = base + lines.to(tl.int64) * 128
        if PREFETCH:
            tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [addr],
                                      dtype=tl.int32, is_pure=False, pack=1)
        else:
            word = tl.load(addr.to(tl.pointer_type(tl.int32)), eviction_policy="evict_last")
            acc += word
    # never true for these weights; keeps the loads alive
    tl.store(ptr.to(tl.pointer_type(tl.int32)) + tl.arange(0, LINES), acc, mask=acc == 0x7FFFFFFF)


def prefetch(t: torch.Tensor, nbytes: int, prefetch_only: bool, programs: int = 132) -> None:
    lines = min(nbytes, t.numel() * t.element_size()) // LINE
    _prefetch_kernel[(programs,)](t, lines, LINES=256, PREFETCH=prefetch_only, num_warps=4)


class Layers:
    def __init__(self, context: int) -> None:
        bf = dict(device="cuda", dtype=torch.bfloat16)
        self.w = [dict(qkv=torch.randn((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, **bf) * 0.02,
                       o=torch.randn(HIDDEN, HEADS * HEAD_DIM, **bf) * 0.02,
                       gate_up=torch.randn(2 * INTER, HIDDEN, **bf) * 0.02,
                       down=torch.randn(HIDDEN, INTER, **bf) * 0.02,
                       norm1=torch.ones(HIDDEN, **bf), norm2=torch.ones(HIDDEN, **bf)) for _ in range(LAYERS)]
        blocks = -(-(context + 1) // BLOCK)
        self.caches = [(torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, **bf), torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, **bf))
                       for _ in range(LAYERS)]
        self.tables = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(1, blocks)
        self.lens = torch.full((1,), context, dtype=torch.int32, device="cuda")
        self.positions = torch.full((1,), context - 1, dtype=torch.int64, device="cuda")
        self.slots = self.tables[:, (context - 1) // BLOCK].long() * BLOCK + (context - 1) % BLOCK
        self.cos_sin = K.make_cos_sin_cache(8192, HEAD_DIM, base=500000.0, device="cuda")
        self.x = torch.randn(1, HIDDEN, **bf)
        self.residual = torch.randn(1, HIDDEN, **bf)
        self.attn_out = torch.empty(1, HEADS, HEAD_DIM, **bf)
        self.side = torch.cuda.Stream()
        self.weight_bytes = sum(w[k].numel() * 2 for w in self.w for k in ("qkv", "o", "gate_up", "down"))

    def beside(self, kernel, weight: torch.Tensor | None, nbytes: int, prefetch_only: bool):
        """Run ``kernel`` on the main stream while the side stream pulls ``nbytes`` of ``weight`` into L2."""
        if weight is None or nbytes <= 0:
            return kernel()
        main = torch.cuda.current_stream()
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            prefetch(weight, nbytes, prefetch_only)
        out = kernel()
        main.wait_stream(self.side)
        return out

    def chain(self, o_at_attn: bool, lead: int, prefetch_only: bool, gemv_only: bool = False) -> None:
        x, residual = self.x, self.residual
        for w, (kc, vc) in zip(self.w, self.caches):
            if gemv_only:
                qkv = x @ w["qkv"].t()
                o = self.attn_out.view(1, -1) @ w["o"].t()
                gu = o @ w["gate_up"].t()
                x = gu[:, :INTER] @ w["down"].t()
                continue
            h = self.beside(lambda: K.rms_norm(x, w["norm1"], 1e-5), w["qkv"], lead, prefetch_only)
            qkv = (h @ w["qkv"].t()).view(1, HEADS + 2 * KV_HEADS, HEAD_DIM)
            q, k, v = qkv[:, :HEADS], qkv[:, HEADS:HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS:]
            self.beside(lambda: K.rope_decode_attention(q, k, v, kc, vc, self.tables, self.lens, self.slots,
                                                        self.positions, self.cos_sin, HEAD_DIM**-0.5,
                                                        out=self.attn_out, max_context_len=4096),
                        w["o"], (32 << 20) if o_at_attn else 0, prefetch_only)
            o = self.attn_out.view(1, -1) @ w["o"].t()
            h, residual = self.beside(lambda: K.rms_norm(o, w["norm2"], 1e-5, residual=residual), w["gate_up"],
                                      lead, prefetch_only)
            gu = h @ w["gate_up"].t()
            act = self.beside(lambda: K.silu_and_mul(gu), w["down"], lead, prefetch_only)
            x = act @ w["down"].t()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--lead-mb", default="4,8,16")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    copy = copy_bandwidth()
    layers = Layers(args.context)
    rows = []

    def add(case: str, us: float) -> None:
        per_layer = us / LAYERS
        rows.append(dict(case=case, us_per_layer=round(per_layer, 2), ms_per_token=round(us / 1e3, 3),
                         weight_gbs=round(layers.weight_bytes / (us / 1e6) / 1e9, 1),
                         of_copy=round(layers.weight_bytes / (us / 1e6) / 1e9 / copy, 3)))
        print(json.dumps(rows[-1]), flush=True)

    print(f"copy bandwidth {copy:.0f} GB/s; weights {layers.weight_bytes / 1e9:.2f} GB; context {args.context}")
    add("gemv only", graph_us(lambda: layers.chain(False, 0, True, gemv_only=True)))
    add("base", graph_us(lambda: layers.chain(False, 0, True)))
    for mode in ("prefetch", "load"):
        only = mode == "prefetch"
        add(f"o@attn {mode}", graph_us(lambda: layers.chain(True, 0, only)))
        for mb in [int(v) for v in args.lead_mb.split(",") if v]:
            add(f"all lead {mb} MB {mode}", graph_us(lambda: layers.chain(True, mb << 20, only)))
            add(f"lead {mb} MB only {mode}", graph_us(lambda: layers.chain(False, mb << 20, only)))
    add("base again", graph_us(lambda: layers.chain(False, 0, True)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(copy_gbs=copy, context=args.context, rows=rows,
                           device=torch.cuda.get_device_name()), f, indent=1)


if __name__ == "__main__":
    main()
