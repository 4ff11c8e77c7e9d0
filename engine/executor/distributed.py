"""Tensor-parallel group state of this process and the collectives the layers use.

Each rank process calls ``init_tensor_parallel`` once at start-up, before it builds the
model; the layers read ``tp_rank()`` / ``tp_size()`` when they are constructed to size
their shards. Without that call the process is a single rank (0 of 1) and every
collective is a no-op, so the same model code runs at TP=1 and TP=N.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _TPGroup:
    rank: int
    world_size: int
    backend: str  # "nccl" on GPUs, "gloo" on CPU


_group: _TPGroup | None = None

# NOTE: up to this many bytes a two-shot all-reduce over symmetric memory (each rank sums its
# share with loads from the peers' buffers over NVLink, no multicast) beat NCCL's on two
# H200s inside CUDA graphs: 22 against 42 us at 4 MiB (a decode step of 512 rows of 4096),
# 64 against 82 us at 16 MiB; from 64 MiB on they tie (docs/BENCHMARKS.md). Larger tensors,
# other dtypes and odd sizes keep NCCL.
SYMMETRIC_MAX_BYTES = 32 << 20


@dataclass(frozen=True)
class _Symmetric:
    buffer: torch.Tensor  # (max_bytes // itemsize,) of the model's dtype, allocated symmetrically on every rank
    group_name: str


_symmetric: _Symmetric | None = None
# NOTE: on two H200s a second rendezvous in rank 0's process (a later engine, whose group has
# the same name "0" and whose rank processes are fresh) waited for good in torch's store
# exchange, which seems to number its keys with a per-process counter that the fresh ranks
# start again. So a process sets up symmetric memory once; a later engine in it runs its
# all-reduces on NCCL.
_symmetric_used_in_process = False


def init_tensor_parallel(
    rank: int,
    world_size: int,
    backend: str = "nccl",
    init_method: str = "tcp://127.0.0.1:29500",
    symmetric_all_reduce: tuple[torch.dtype, int] | None = None,
) -> None:
    """Join this process to the tensor-parallel group as ``rank`` of ``world_size``.

    Call once per process, before building the model. ``world_size == 1`` records the
    state without creating a process group. ``symmetric_all_reduce=(dtype, max_bytes)``
    (NCCL only, the same on every rank): ``all_reduce`` of ``dtype`` tensors up to
    ``max_bytes`` runs over symmetric memory where torch and the GPUs allow it.
    """
    global _group
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    if _group is not None:
        raise RuntimeError(
            f"tensor parallel state already set (rank {_group.rank} of {_group.world_size}); "
            "call destroy_tensor_parallel() first"
        )
    if world_size > 1:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    _group = _TPGroup(rank, world_size, backend)
    if world_size > 1 and backend == "nccl" and symmetric_all_reduce is not None:
        _enable_symmetric_all_reduce(*symmetric_all_reduce)


def _enable_symmetric_all_reduce(dtype: torch.dtype, max_bytes: int) -> None:
    """Collective. Allocate the symmetric staging buffer, check one all-reduce through it, and
    route ``all_reduce`` there only if every rank could; otherwise NCCL carries on alone."""
    global _symmetric, _symmetric_used_in_process
    try:
        import torch.distributed._symmetric_memory as symm_mem

        usable = hasattr(torch.ops.symm_mem, "two_shot_all_reduce_")
    except (ImportError, AttributeError, RuntimeError):
        usable = False
    if not min_over_ranks(int(usable and not _symmetric_used_in_process)):
        logger.warning("all-reduce: NCCL, not symmetric memory (%s)",
                       "this torch has none" if not usable else "a process sets it up once; an earlier engine here did")
        return
    _symmetric_used_in_process = True
    group_name = dist.group.WORLD.group_name
    itemsize = torch.empty((), dtype=dtype).element_size()
    try:
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by older torch, a no-op in newer
            symm_mem.enable_symm_mem_for_group(group_name)
        device = torch.device("cuda", torch.cuda.current_device())
        buffer = symm_mem.empty(max_bytes // itemsize, dtype=dtype, device=device)
        symm_mem.rendezvous(buffer, group_name)
        _symmetric = _Symmetric(buffer, group_name)
        world = tp_size()
        probe = torch.full((64 * world,), float(tp_rank() + 1), dtype=dtype, device=buffer.device)
        all_reduce(probe)
        ok = bool((probe == world * (world + 1) // 2).all())
    except RuntimeError as err:
        logger.warning("all-reduce over symmetric memory failed to start (%s); NCCL carries on", err)
        ok = False
    if not min_over_ranks(int(ok)):
        _symmetric = None
        logger.info("all-reduce: NCCL (symmetric memory unusable on some rank)")
        return
    logger.info("all-reduce: two-shot over symmetric memory up to %.0f MiB of %s, NCCL beyond",
                max_bytes / (1 << 20), dtype)


def destroy_tensor_parallel(timeout: float = 30.0) -> None:
    """Leave the group (at rank shutdown, or between tests).

    NOTE: NCCL's teardown can block for good (a peer that is gone, a CUDA graph that still
    holds the communicator), so it runs on a daemon thread and is given up after
    ``timeout`` seconds with a warning; this process's state is reset either way.
    """
    global _group, _symmetric
    group, _group = _group, None
    _symmetric = None
    if group is None or group.world_size == 1 or not dist.is_initialized():
        return
    done = threading.Thread(target=dist.destroy_process_group, name="leave-tp-group", daemon=True)
    done.start()
    done.join(timeout)
    if done.is_alive():
        logger.warning("leaving the tensor-parallel process group did not finish in %.0f s; carrying on", timeout)


def tp_rank() -> int:
    return 0 if _group is None else _group.rank


def tp_size() -> int:
    return 1 if _group is None else _group.world_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place; returns ``x``."""
    if tp_size() == 1:
        return x
    symmetric = _symmetric
    if (symmetric is not None and x.dtype == symmetric.buffer.dtype and x.is_contiguous()
            and x.numel() <= symmetric.buffer.numel() and (x.numel() * x.element_size()) % 16 == 0):
        staged = symmetric.buffer[: x.numel()]  # (numel,)
        staged.copy_(x.view(-1))
        torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", symmetric.group_name)
        x.copy_(staged.view_as(x))
        return x
    dist.all_reduce(x)
    return x


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """The elementwise maximum of ``x`` over the ranks, in place; returns ``x``."""
    if tp_size() > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x


def symmetric_all_reduce_active() -> bool:
    """Whether ``all_reduce`` runs over symmetric memory (for logs and tests)."""
    return _symmetric is not None


def broadcast_from_rank0(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``x`` on every rank, in place (the others pass a buffer of the same shape)."""
    if tp_size() == 1:
        return x
    dist.broadcast(x, src=0)
    return x


def min_over_ranks(value: int) -> int:
    """The smallest ``value`` any rank holds (e.g. the KV blocks every rank has room for)."""
    if tp_size() == 1:
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if _group.backend == "nccl" else None
    x = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(x, op=dist.ReduceOp.MIN)
    return int(x.item())


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dimension (rank order)."""
    if tp_size() == 1:
        return x
    x = x.contiguous()
    world = tp_size()
    # one collective into one buffer, ranks stacked along the first dimension
    gathered = x.new_empty((world * x.shape[0], *x.shape[1:]))  # (world * N, ..., D)
    _all_gather_single(gathered, x)
    stacked = gathered.view(world, *x.shape)  # (world, N, ..., D)
    return stacked.movedim(0, -2).reshape(*x.shape[:-1], world * x.shape[-1])  # (N, ..., world * D)


# NOTE: ``all_gather_single`` is the newer name (the older one warns there); an older
# torch may have only the older one.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Full-vocab logits from each rank's vocab shard, with the shard padding cut off.

    NOTE: every rank receives the full logits (an all-gather rather than a gather to rank
    0): NCCL has no native gather, and a (N, vocab) all-gather costs about the same.
    """
    return all_gather_last_dim(logits)[..., :vocab_size]  # (N, vocab)
