"""All-reduce bandwidth between the machine's first two GPUs through torch.distributed (NCCL),
eager and replayed from a CUDA graph, at the message sizes a tensor-parallel step sends:
a decode step all-reduces (batch x hidden) bf16 twice per layer. Prints one line per size
and the transport NCCL chose (run with NCCL_DEBUG=INFO to see it in the log).

    python scripts/nccl_probe.py [--hidden 4096] [--batches 64,128,129,256,384,2048,8192]
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPEAT = 64  # all-reduces per timed run, as in one llama3-8b step (2 per layer x 32)


def _rank(rank: int, port: int, hidden: int, batches: list[int], queue) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    rows = []
    for batch in batches:
        x = torch.ones(batch, hidden, dtype=torch.bfloat16, device="cuda")
        for _ in range(5):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(REPEAT):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        eager = (time.perf_counter() - start) / REPEAT
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(REPEAT):
                dist.all_reduce(x)
        graph.replay()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        graphed = (time.perf_counter() - start) / (3 * REPEAT)
        graph.reset()
        del graph
        nbytes = x.numel() * x.element_size()
        rows.append((batch, nbytes, eager, graphed))
    if rank == 0:
        queue.put(rows)
    torch.cuda.synchronize()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--batches", default="64,128,129,256,384,2048,8192")
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    print("peer access 0->1:", torch.cuda.can_device_access_peer(0, 1))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, args.hidden, [int(b) for b in args.batches.split(",")], queue))
             for r in range(2)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=300)
    for p in procs:
        p.join(60)
    print(f"{'batch':>6} {'MiB':>7} {'eager us':>9} {'GB/s':>6} {'graph us':>9} {'GB/s':>6}")
    for batch, nbytes, eager, graphed in rows:
        # bus bandwidth of a 2-rank all-reduce equals the message size over the time
        print(f"{batch:>6} {nbytes / 2**20:>7.2f} {eager * 1e6:>9.1f} {nbytes / eager / 1e9:>6.1f} "
              f"{graphed * 1e6:>9.1f} {nbytes / graphed / 1e9:>6.1f}")


if __name__ == "__main__":
    main()
