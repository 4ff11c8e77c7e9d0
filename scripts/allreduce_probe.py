"""Probe: NCCL all-reduce against torch symmetric-memory all-reduces on this machine's GPUs,
each captured 65 times in one CUDA graph (one decode step's worth), at decode and prefill sizes;
every result is checked against NCCL's.

    python scripts/allreduce_probe.py            # spawns one process per visible GPU
"""

from __future__ import annotations

import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = [(1, 4096), (16, 4096), (128, 4096), (512, 4096), (512, 8192), (2048, 4096), (8192, 4096), (8192, 8192)]
REPEATS = 65


def _graph_ms(fn, repeats=REPEATS, iters=10):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(repeats):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier()
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters / repeats * 1e3  # us per all-reduce


def main(rank: int, world: int, port: int) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    import torch.distributed._symmetric_memory as symm_mem

    group = dist.group.WORLD.group_name
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(group)
    max_numel = max(a * b for a, b in SIZES)
    buf = symm_mem.empty(max_numel, dtype=torch.bfloat16, device="cuda")
    handle = symm_mem.rendezvous(buf, group)
    if rank == 0:
        print(f"torch {torch.__version__} world {world} multicast_ptr {handle.multicast_ptr}", flush=True)
    for n, h in SIZES:
        numel = n * h
        gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
        x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, generator=gen)
        ref = x.float().clone()
        dist.all_reduce(ref)
        row = {}
        work = x.clone()

        def nccl():
            dist.all_reduce(work)

        row["nccl"] = _graph_ms(nccl)
        view = buf[:numel].view(n, h)
        out = torch.empty_like(x)

        def one_shot():
            view.copy_(x)
            torch.ops.symm_mem.one_shot_all_reduce_out(view, "sum", group, out)

        def two_shot():
            view.copy_(x)
            torch.ops.symm_mem.two_shot_all_reduce_(view, "sum", group)

        for name, fn, result in (("one_shot", one_shot, lambda: out), ("two_shot", two_shot, lambda: view)):
            try:
                fn()
                torch.cuda.synchronize()
                err = (result().float() - ref).abs().max().item()
                row[name] = _graph_ms(fn)
                row[name + "_err"] = err
            except Exception as e:  # noqa: BLE001
                row[name] = f"{type(e).__name__}: {str(e)[:200]}"
        if rank == 0:
            print(f"{n}x{h} ({2 * numel / 2**20:.2f} MiB): " + ", ".join(
                f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    world = torch.cuda.device_count()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free_port = sock.getsockname()[1]
    mp.spawn(main, args=(world, free_port), nprocs=world)
    sys.exit(0)
