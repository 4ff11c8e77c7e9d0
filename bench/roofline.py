"""Roofline lower bounds for generation workloads: a model's FLOPs and bytes against a GPU's
measured matmul rate and memory bandwidth. docs/BENCHMARKS.md states the formula.

Counts are for the whole model, over all ranks, for the Llama family (Llama, Mistral, Qwen2,
Qwen3): attention with GQA, a SwiGLU MLP, an untied or tied LM head. Under tensor parallelism
the ceilings are those of all the ranks' GPUs together (``DeviceCeilings.over``): a perfect
split of every FLOP and byte, with the collectives free, so the bound stays a lower bound.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from engine.models.shape import ModelShape


@dataclass
class ModelCounts:
    """What one token costs: linear-layer FLOPs and the bytes of a full weight read."""

    linear_params: int  # parameters of every layer's matmuls (q, k, v, o, gate, up, down)
    lm_head_params: int  # vocab x hidden
    weight_bytes: int  # all weights read by one forward (embedding rows excluded)
    kv_bytes_per_token: int  # K and V of one token over all layers
    attn_flops_per_key: int  # QK^T and PV FLOPs of one query token against one cached key, all layers

    @classmethod
    def from_config(cls, config: Any, dtype_bytes: int = 2, kv_dtype_bytes: int | None = None,
                    tensor_parallel_size: int = 1, linear_dtype_bytes: int | None = None) -> "ModelCounts":
        """``dtype_bytes``: per weight; ``kv_dtype_bytes``: per cached K/V element (default: the same);
        ``linear_dtype_bytes``: per weight of the decoder's matmuls (1 for FP8; default: dtype_bytes).
        The LM head and norms stay at ``dtype_bytes``; per-channel scales are left out (0.1%).

        With fewer KV heads than ``tensor_parallel_size`` ranks every rank caches a copy of
        one, so the K/V bytes written and read are those of ``tensor_parallel_size`` heads.
        """
        shape = ModelShape.from_hf_config(config, tensor_parallel_size)
        return cls(
            linear_params=shape.linear_params,
            lm_head_params=shape.lm_head_params,
            weight_bytes=shape.weight_bytes(dtype_bytes, linear_dtype_bytes),
            kv_bytes_per_token=shape.total_kv_bytes_per_token(kv_dtype_bytes or dtype_bytes),
            attn_flops_per_key=shape.attn_flops_per_key,
        )


@dataclass
class DeviceCeilings:
    matmul_tflops: float  # dense bf16 GEMM, measured
    bandwidth_gbs: float  # device-to-device copy, bytes read + written, measured
    fp8_matmul_tflops: float | None = None  # float8 GEMM with rowwise scales, measured (when asked)

    def over(self, gpus: int) -> "DeviceCeilings":
        """The ceilings of ``gpus`` such GPUs together (tensor parallelism's ideal split)."""
        fp8 = self.fp8_matmul_tflops * gpus if self.fp8_matmul_tflops is not None else None
        return DeviceCeilings(matmul_tflops=self.matmul_tflops * gpus, bandwidth_gbs=self.bandwidth_gbs * gpus,
                              fp8_matmul_tflops=fp8)

    def for_fp8(self) -> "DeviceCeilings":
        """The ceilings of an FP8 model: every FLOP at the float8 rate (attention's too, so the
        bound stays a lower bound)."""
        if self.fp8_matmul_tflops is None:
            raise ValueError("the float8 matmul rate was not measured (measure_ceilings(fp8=True))")
        return DeviceCeilings(matmul_tflops=self.fp8_matmul_tflops, bandwidth_gbs=self.bandwidth_gbs,
                              fp8_matmul_tflops=self.fp8_matmul_tflops)

    @property
    def flops_per_s(self) -> float:
        return self.matmul_tflops * 1e12

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbs * 1e9


def measure_ceilings(device: torch.device | str = "cuda", n: int = 8192, copy_bytes: int = 4 << 30,
                     repeats: int = 20, fp8: bool = False) -> DeviceCeilings:
    """Median rate of an n x n x n bf16 matmul on random data, and of a ``copy_bytes`` copy;
    with ``fp8`` also of the same product in float8 e4m3 with rowwise scales (bf16 out)."""
    device = torch.device(device)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    matmul_s = _median_seconds(lambda: torch.matmul(a, b, out=c), repeats)
    fp8_tflops = None
    if fp8:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)  # b8.t(): column-major, as cuBLASLt wants
        sa = torch.ones(n, 1, device=device, dtype=torch.float32)
        sb = torch.ones(1, n, device=device, dtype=torch.float32)
        fp8_s = _median_seconds(lambda: torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb,
                                                         out_dtype=torch.bfloat16), repeats)
        fp8_tflops = 2 * n**3 / fp8_s / 1e12
        del a8, b8
    del a, b, c
    src = torch.empty(copy_bytes // 2, device=device, dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    copy_s = _median_seconds(lambda: dst.copy_(src), repeats)
    del src, dst
    torch.cuda.empty_cache()
    return DeviceCeilings(matmul_tflops=2 * n**3 / matmul_s / 1e12, bandwidth_gbs=2 * copy_bytes / copy_s / 1e9,
                          fp8_matmul_tflops=fp8_tflops)


def _median_seconds(fn, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def generation_bound(
    counts: ModelCounts,
    ceilings: DeviceCeilings,
    input_lens: list[int],
    output_lens: list[int],
    max_batch: int,
    max_step_tokens: int,
) -> dict[str, float]:
    """Lower-bound seconds for generating ``output_lens[i]`` tokens after ``input_lens[i]``.

    The ideal schedule: prompts are prefilled in steps of ``max_step_tokens`` tokens, then
    decoded in waves of ``max_batch`` sequences (arrival order), one token each per step.
    Each step costs ``max(FLOPs / matmul rate, bytes / bandwidth)``: a step reads every
    weight once, reads the K/V of every key it attends to and writes the K/V of its new
    tokens. Activations and the embedding gather are left out, so the bound is low.

    ``serial_bound_s`` charges the same steps for kernels that run one after another: each
    step's linear layers ``max(their FLOPs / rate, weight bytes / bandwidth)`` plus its
    attention ``max(its FLOPs / rate, K/V bytes / bandwidth)``, so memory-bound attention
    cannot hide under compute-bound GEMMs.
    """
    inp = np.asarray(input_lens, dtype=np.float64)
    out = np.asarray(output_lens, dtype=np.float64)
    rate, bw = ceilings.flops_per_s, ceilings.bytes_per_s
    p2, head2 = 2.0 * counts.linear_params, 2.0 * counts.lm_head_params
    attn, kvb, w = float(counts.attn_flops_per_key), float(counts.kv_bytes_per_token), float(counts.weight_bytes)

    # prefill: every prompt token through the linear layers, causal attention, one LM-head row per prompt
    prefill_flops = float(np.sum(p2 * inp + attn * inp * (inp + 1) / 2 + head2))
    prefill_steps = max(1, int(np.ceil(inp.sum() / max_step_tokens)))
    prefill_bytes = prefill_steps * w + float(inp.sum()) * kvb
    prefill_s = max(prefill_flops / rate, prefill_bytes / bw)  # equal steps: the same as summing each step's max
    prefill_linear_flops = float(np.sum(p2 * inp + head2))
    prefill_serial_s = (max(prefill_linear_flops / rate, prefill_steps * w / bw)
                        + max((prefill_flops - prefill_linear_flops) / rate, float(inp.sum()) * kvb / bw))

    # decode: the first output token comes from the prefill; token j >= 1 is one decode step
    decode_s = decode_flops = decode_bytes = decode_serial_s = 0.0
    decode_steps = 0
    for start in range(0, len(inp), max_batch):
        w_in, w_out = inp[start : start + max_batch], out[start : start + max_batch]
        for j in range(1, int(w_out.max(initial=0))):
            active = w_out > j
            keys = float(np.sum(w_in[active] + j))  # keys attended this step
            n = int(active.sum())
            flops = n * (p2 + head2) + attn * keys
            moved = w + (keys + n) * kvb
            decode_s += max(flops / rate, moved / bw)
            decode_serial_s += max(n * (p2 + head2) / rate, w / bw) + max(attn * keys / rate, (keys + n) * kvb / bw)
            decode_flops += flops
            decode_bytes += moved
            decode_steps += 1
    total_flops = prefill_flops + decode_flops
    total_bytes = prefill_bytes + decode_bytes
    return dict(
        bound_s=prefill_s + decode_s,
        prefill_bound_s=prefill_s,
        decode_bound_s=decode_s,
        strict_bound_s=max(total_flops / rate, total_bytes / bw),
        serial_bound_s=prefill_serial_s + decode_serial_s,
        flops=total_flops,
        bytes=total_bytes,
        prefill_serial_bound_s=prefill_serial_s,
        decode_flops=decode_flops,
        decode_bytes=decode_bytes,
        decode_steps=decode_steps,
        max_batch=max_batch,
    )


def ceilings_dict(ceilings: DeviceCeilings) -> dict[str, float]:
    return asdict(ceilings)


def shared_prefix_bound(
    counts: ModelCounts,
    ceilings: DeviceCeilings,
    prefix_len: int,
    suffix_lens: list[int],
    output_lens: list[int],
    max_batch: int,
    max_step_tokens: int,
) -> dict[str, float]:
    """``generation_bound`` for jobs that all start with the same ``prefix_len`` tokens, the
    prefix computed once: prefill covers the prefix and each job's own suffix (whose tokens
    attend to the prefix and to the suffix before them); decode is that of the whole prompts.
    """
    inputs = [prefix_len + s for s in suffix_lens]
    whole = generation_bound(counts, ceilings, inputs, output_lens, max_batch, max_step_tokens)
    suf = np.asarray(suffix_lens, dtype=np.float64)
    rate, bw = ceilings.flops_per_s, ceilings.bytes_per_s
    p2, head2 = 2.0 * counts.linear_params, 2.0 * counts.lm_head_params
    attn, kvb, w = float(counts.attn_flops_per_key), float(counts.kv_bytes_per_token), float(counts.weight_bytes)
    tokens = prefix_len + float(suf.sum())
    keys = prefix_len * (prefix_len + 1) / 2 + float(np.sum(suf * prefix_len + suf * (suf + 1) / 2))
    linear_flops = p2 * tokens + head2 * len(suffix_lens)  # one LM-head row per job: its first token
    flops = linear_flops + attn * keys
    steps = max(1, int(np.ceil(tokens / max_step_tokens)))
    prefill_s = max(flops / rate, (steps * w + tokens * kvb) / bw)
    prefill_serial_s = max(linear_flops / rate, steps * w / bw) + max(attn * keys / rate, tokens * kvb / bw)
    decode_flops = whole["decode_flops"]
    bound = dict(whole)
    bound.update(
        bound_s=prefill_s + whole["decode_bound_s"],
        prefill_bound_s=prefill_s,
        serial_bound_s=prefill_serial_s + whole["serial_bound_s"] - whole["prefill_serial_bound_s"],
        prefill_serial_bound_s=prefill_serial_s,
        flops=flops + decode_flops,
        prefix_len=prefix_len,
    )
    bound["bytes"] = steps * w + tokens * kvb + whole["decode_bytes"]
    bound["strict_bound_s"] = max(bound["flops"] / rate, bound["bytes"] / bw)
    return bound
