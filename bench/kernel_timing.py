"""How ``bench.kernels`` times a kernel: inside a CUDA graph, as the engine runs it (or eagerly)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def bench(fn: Callable[[], object]) -> float:
    """Median milliseconds."""
    if DEVICE == "cpu":  # --tiny: one timed call shows the script runs, nothing more
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing

    try:
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    except TypeError:  # older triton
        return triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=[0.5])[0]


TIMING = {"mode": "graph"}  # --timing: how kernels are timed (references are always timed eagerly)
_MAX_COPIES = 64
_GRAPH_MS = 20.0  # device time one graph replay aims at


class Ms(float):
    """Milliseconds, and how they were measured (``graph`` or ``eager``)."""

    mode = "eager"


def kernel_ms(kernel: Callable[..., object], args: tuple, kwargs: dict | None = None) -> Ms:
    """Median milliseconds of one ``kernel(*args, **kwargs)`` as the engine runs it.

    NOTE: eager timing at small shapes measures the host's launch, not the kernel (decode
    attention over 1 x 2,048 tokens: about 51 us eager against 10 us in a CUDA graph). In a
    graph, calls run back to back with no launch gaps; they rotate over copies of the inputs
    totalling at least twice the L2 cache, since one call's inputs would otherwise be
    L2-resident on its next replay, which successive layers in the engine never are. A
    kernel that cannot be captured is timed eagerly, and the row says so.
    """
    kwargs = kwargs or {}
    if DEVICE == "cpu" or TIMING["mode"] == "eager":
        return Ms(bench(lambda: kernel(*args, **kwargs)))
    try:
        out = Ms(_graph_ms(kernel, args, kwargs))
        out.mode = "graph"
        return out
    except Exception as exc:  # NOTE: e.g. a host sync inside: capture fails; time it eagerly instead
        print(f"    (not capturable, timed eagerly: {type(exc).__name__}: {str(exc).splitlines()[0][:100]})")
        torch.cuda.synchronize()
        return Ms(bench(lambda: kernel(*args, **kwargs)))


def _graph_ms(kernel: Callable[..., object], args: tuple, kwargs: dict) -> float:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    size = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
    l2 = getattr(torch.cuda.get_device_properties(DEVICE), "L2_cache_size", 64 << 20)
    free, _ = torch.cuda.mem_get_info()
    copies = max(1, min(_MAX_COPIES, math.ceil(2 * l2 / max(size, 1)), int(free // 2 // max(size, 1))))
    sets = [args] + [tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args) for _ in range(copies - 1)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compiles, autotunes and allocates outside the graph
        for inputs in sets:
            kernel(*inputs, **kwargs)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for inputs in sets:
            kernel(*inputs, **kwargs)
        end.record()
    torch.cuda.synchronize()
    per_round = max(start.elapsed_time(end), 1e-3)
    rounds = max(1, min(1000, int(_GRAPH_MS / per_round)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for inputs in sets:
                kernel(*inputs, **kwargs)
    graph.replay()  # the first replay uploads the graph
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / (rounds * len(sets)))
    del graph
    return sorted(times)[len(times) // 2]
