"""How much pinning or unpinning host memory on a background thread stalls a step loop.

A foreground loop launches a small kernel and waits for it (a stand-in for the engine's step
loop: a launch and a device-to-host read each iteration) while a background thread pins or
releases GiBs of host memory in one of several ways; prints the foreground's p50/p99/max
iteration time and how long the background work took, per method.

    python3 scripts/pin_stall_probe.py --gib 8
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch


def host_empty() -> None:
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or torch._C._host_emptyCache
    empty()


def pin_torch(gib: float, mib: int, pause: float, keep: list) -> None:
    n = int(gib * 1024 // mib)
    for _ in range(n):
        keep.append(torch.empty(mib << 20, dtype=torch.uint8, pin_memory=True))
        time.sleep(pause)


def register(gib: float, mib: int, pause: float, keep: list) -> None:
    cudart = torch.cuda.cudart()
    n = int(gib * 1024 // mib)
    for _ in range(n):
        t = torch.empty(mib << 20, dtype=torch.uint8)
        t.fill_(0)
        assert int(cudart.cudaHostRegister(t.data_ptr(), t.numel(), 0)) == 0
        keep.append(t)
        time.sleep(pause)


def free_torch(keep: list, pause: float) -> None:
    while keep:
        keep.pop()
        host_empty()
        time.sleep(pause)


def unregister(keep: list, pause: float) -> None:
    cudart = torch.cuda.cudart()
    while keep:
        t = keep.pop()
        cudart.cudaHostUnregister(t.data_ptr())
        time.sleep(pause)


def loop_times(stop: threading.Event, x: torch.Tensor, out: list) -> None:
    pinned = torch.empty(16, dtype=x.dtype, pin_memory=True)
    while not stop.is_set():
        t = time.perf_counter()
        y = x @ x
        pinned.copy_(y[0, :16], non_blocking=True)
        torch.cuda.current_stream().synchronize()
        out.append(time.perf_counter() - t)


def measure(name: str, work) -> dict:
    x = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    times: list[float] = []
    stop = threading.Event()
    fg = threading.Thread(target=loop_times, args=(stop, x, times))
    fg.start()
    time.sleep(0.5)
    base = len(times)
    t = time.perf_counter()
    work()
    took = time.perf_counter() - t
    time.sleep(0.2)
    stop.set()
    fg.join()
    during = sorted(times[base:]) or [0.0]
    idle = sorted(times[:base]) or [0.0]
    q = lambda v, p: v[min(len(v) - 1, int(p * len(v)))]  # noqa: E731
    row = dict(method=name, background_s=round(took, 3), idle_p50_ms=round(1e3 * q(idle, 0.5), 3),
               p50_ms=round(1e3 * q(during, 0.5), 3), p99_ms=round(1e3 * q(during, 0.99), 3),
               max_ms=round(1e3 * during[-1], 1), iterations=len(during))
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=8)
    args = ap.parse_args()
    g = args.gib
    torch.cuda.init()
    for mib, pause in ((256, 0.0), (32, 0.0), (32, 0.005)):
        keep: list = []
        measure(f"pin torch {mib} MiB pause {pause}", lambda: pin_torch(g, mib, pause, keep))
        measure(f"free torch {mib} MiB (empty cache each)", lambda: free_torch(keep, 0.0))
    for mib in (256, 16, 4):  # the swap pool registers a chunk in pieces of host_memory.PIECE_BYTES
        keep = []
        measure(f"register {mib} MiB", lambda: register(g, mib, 0.0, keep))
        measure(f"unregister {mib} MiB", lambda: unregister(keep, 0.0))
    keep = []
    measure("pin torch 256 MiB, one thread", lambda: pin_torch(g, 256, 0.0, keep))
    t = time.perf_counter()
    keep.clear()
    host_empty()
    print(json.dumps(dict(method="empty_host_cache on the loop's thread after 256 MiB chunks", s=round(time.perf_counter() - t, 3))))


if __name__ == "__main__":
    main()
