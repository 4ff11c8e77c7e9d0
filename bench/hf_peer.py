"""HF transformers as the benchmark's peer: the same architecture, random weights, the same prompts.

Three ways HF generates are measured: ``generate`` over left-padded batches with the
dynamic cache, the same with the static cache, and ``generate_batch`` (its continuous
batching). A short probe of each picks the fastest mode; that mode then runs one full batch
of the workload's own requests at each batch size asked for, and the fastest batch size is
HF's number (a larger batch that runs out of memory is reported and ends the search). The
result says how many requests each run covered.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

MODES = ("generate", "static", "generate_batch")
# NOTE: "static" is not in the bench's default --hf-modes: in transformers 5.x a static cache makes generate
# torch.compile the forward, and compiling for the benchmark's shapes took over a minute.


def build_hf_model(hf_config: Any, dtype: torch.dtype, device: torch.device):
    """The HF model of ``hf_config`` with random weights, built directly on the device."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        try:
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        except TypeError:  # transformers 4.x names it torch_dtype
            model = AutoModelForCausalLM.from_config(hf_config, torch_dtype=dtype)
    return model.to(dtype).eval()


def _padded(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded (B, L) ids and attention mask."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def run_generate(model, prompts: list[list[int]], output_lens: list[int], batch_size: int,
                 static: bool = False) -> int:
    """``model.generate`` batch by batch; returns the output tokens asked for (a batch runs
    to its longest request, the extra tokens are not counted)."""
    device = next(model.parameters()).device
    counted = 0
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        outs = output_lens[start:start + batch_size]
        ids, mask = _padded(chunk, device)
        extra = dict(cache_implementation="static") if static else {}
        model.generate(ids, attention_mask=mask, max_new_tokens=max(outs), min_new_tokens=max(outs),
                       do_sample=False, pad_token_id=0, **extra)
        counted += sum(outs)
    return counted


def run_generate_batch(model, prompts: list[list[int]], output_lens: list[int], batch_size: int) -> int:
    """``model.generate_batch`` (continuous batching) over every prompt; returns tokens made.

    NOTE: not under inference mode: its manager thread updates tensors made here in place,
    which transformers 5.17 refuses for inference tensors (seen on the H200 run).
    """
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max(output_lens), do_sample=False, eos_token_id=None, pad_token_id=0)
    results = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    errors = [r.error for r in results.values() if getattr(r, "error", None)]
    if errors or not results:
        raise RuntimeError(f"{len(errors)} of {len(results)} requests failed: {errors[:1]}")
    return sum(len(r.generated_tokens) for r in results.values())


_RUNNERS: dict[str, Callable[..., int]] = {
    "generate": run_generate,
    "static": lambda m, p, o, b: run_generate(m, p, o, b, static=True),
    "generate_batch": run_generate_batch,
}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(mode: str, model, prompts, output_lens, batch_size) -> dict[str, Any]:
    _sync()
    start = time.perf_counter()
    try:
        tokens = _RUNNERS[mode](model, prompts, output_lens, batch_size)
    except Exception as err:  # noqa: BLE001 - a mode this transformers lacks is reported, not fatal
        logger.warning("hf %s failed: %s", mode, err)
        return dict(mode=mode, error=f"{type(err).__name__}: {err}"[:300])
    _sync()
    elapsed = time.perf_counter() - start
    total = tokens + sum(len(p) for p in prompts)
    return dict(mode=mode, num_requests=len(prompts), output_tokens=tokens, elapsed_s=elapsed,
                output_tok_s=tokens / elapsed, total_tok_s=total / elapsed)


def run_peer(
    hf_config: Any,
    dtype: torch.dtype,
    prompts: list[list[int]],
    output_lens: list[int],
    modes: list[str],
    batch_sizes: list[int],
    probe_output_len: int,
    probe_requests: int = 32,
) -> dict[str, Any]:
    """Probe each mode on ``probe_requests`` prompts with ``probe_output_len`` tokens, then run
    the fastest as one batch of the first ``b`` requests (their real lengths) for each ``b`` in
    ``batch_sizes``; the fastest run is the result."""
    import transformers

    sizes = sorted({min(int(b), len(prompts)) for b in batch_sizes})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"hf batch sizes must be positive integers, got {batch_sizes!r}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    start = time.perf_counter()
    model = build_hf_model(hf_config, dtype, device)
    build_s = time.perf_counter() - start
    probe = prompts[: min(sizes[0], probe_requests)]
    probes = []
    if len(modes) > 1:
        for mode in modes:
            _timed(mode, model, probe[:2], [2, 2], sizes[0])  # warm-up: kernels, allocator
            probes.append(_timed(mode, model, probe, [probe_output_len] * len(probe), sizes[0]))
        ok = [p for p in probes if "error" not in p]
        best = max(ok, key=lambda p: p["output_tok_s"])["mode"] if ok else modes[0]
    else:
        best = modes[0]
        _timed(best, model, probe[:2], [2, 2], sizes[0])
    runs = []
    for size in sizes:
        run = dict(batch_size=size, **_timed(best, model, prompts[:size], output_lens[:size], size))
        runs.append(run)
        if "error" in run:  # out of memory, most likely: a larger batch would fail too
            break
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return dict(name="hf", transformers=transformers.__version__, best_mode=best, probes=probes,
                    batch_runs=runs, error=runs[0]["error"])
    fastest = max(ok, key=lambda r: r["output_tok_s"])
    return dict(
        name="hf", transformers=transformers.__version__, build_s=build_s, probe_requests=len(probe),
        probe_output_len=probe_output_len, probes=probes, best_mode=best, batch_runs=runs, **fastest,
        note=f"HF's fastest run: {fastest['num_requests']} of {len(prompts)} requests (same lengths) "
             f"in one batch of {fastest['batch_size']}, mode {best}",
    )
