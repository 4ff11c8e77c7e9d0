"""Page-locked host memory for the swap pool, taken and given back without stalling the step loop.

``torch.empty(..., pin_memory=True)`` goes through ``cudaHostAlloc`` (and torch's caching
host allocator, which keeps freed blocks until ``empty_host_cache`` hands them back with
``cudaFreeHost``). On an H200 both hold up every other thread's CUDA calls while they run:
a loop launching a kernel and reading one result back each iteration, with another thread
pinning 8 GiB in 256 MiB pieces, saw iterations of up to 387 ms (p99 34 ms with 32 MiB
pieces), and handing the same 8 GiB back took 1.26 s on the loop's own thread
(``scripts/pin_stall_probe.py``, docs/SWAP.md). Ordinary pageable memory locked in place with
``cudaHostRegister`` instead held the loop up at most 21 ms (p99 0.16 ms), and
``cudaHostUnregister`` 6 ms. So the pool's chunks are plain host tensors, touched and
registered on the pool's background thread, unregistered on a releasing thread once the side
stream's last copy that used them has completed, and freed with their tensor.

A registered chunk is pinned memory to CUDA (``Tensor.is_pinned()`` is true; copies from and
to it are asynchronous DMA) but not torch's: its memory is outside the caching allocator.
"""

from __future__ import annotations

import logging
import math
import mmap
import threading
import weakref
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)


def _cudart():
    return torch.cuda.cudart()


PAGE = 4096
# One ``cudaHostRegister`` call locks at most this much: the call holds up every other thread's
# CUDA calls while it runs (21 ms for 256 MiB on an H200, docs/SWAP.md), so a chunk is
# registered piece by piece and the step loop waits at most one piece's registration.
PIECE_BYTES = 16 << 20


def piece_blocks(bytes_per_block: int, piece_bytes: int = PIECE_BYTES) -> int:
    """Blocks per registered piece: about ``piece_bytes``, and a whole number of pages (so two
    pieces never share a page), given that a chunk starts on a page."""
    whole_pages = PAGE // math.gcd(bytes_per_block, PAGE)  # blocks that fill whole pages
    return max(1, piece_bytes // bytes_per_block // whole_pages) * whole_pages


def registered_empty(shape: Sequence[int], dtype: torch.dtype, piece_bytes: int | None = None) -> torch.Tensor:
    """A host tensor locked in place for DMA: touched (so registering does not fault its pages
    in), then ``cudaHostRegister``-ed, in pieces of ``piece_bytes`` (a multiple of the page;
    default: all of it at once) from its page-aligned start; unregistered when the tensor is
    collected, if ``release`` did not do it first.

    NOTE: a copy must not span two pieces: each is a registration of its own (the cache
    engine cuts its copies at piece boundaries).
    """
    size = math.prod(shape) * dtype.itemsize
    if piece_bytes is not None and (piece_bytes <= 0 or piece_bytes % PAGE):
        raise ValueError(f"piece_bytes must be a positive multiple of {PAGE}, got {piece_bytes}")
    # NOTE: anonymous mmap memory starts on a page, and it is the tensor's storage itself: torch
    # asks CUDA whether the storage's first byte is pinned (is_pinned), so a view into a larger
    # malloc'ed block past an unregistered head would not count as pinned
    raw = torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8)  # (size,); a chunk is never empty
    tensor = raw.view(dtype).view(tuple(shape))
    ptr, step = tensor.data_ptr(), piece_bytes or size
    pieces: list[int] = []
    try:
        for lo in range(0, size, step):
            raw[lo : min(size, lo + step)].zero_()  # touched, so registering does not fault pages in
            code = int(_cudart().cudaHostRegister(ptr + lo, min(step, size - lo), 0))
            if code != 0:
                raise RuntimeError(f"cudaHostRegister of {min(step, size - lo)} bytes failed with CUDA error {code}")
            pieces.append(ptr + lo)
    except BaseException:
        _unregister(pieces)
        raise
    # NOTE: a finalizer, not a __del__: it runs once, either from ``release`` or when the last
    # reference goes (engine shutdown), whichever comes first
    tensor.unregister = weakref.finalize(tensor, _unregister, pieces)
    return tensor


def _unregister(pieces: list[int]) -> None:
    for ptr in pieces:
        try:
            _cudart().cudaHostUnregister(ptr)
        except Exception:  # noqa: BLE001 - at interpreter exit CUDA may already be gone
            return


def release(chunks: list[torch.Tensor], after: torch.cuda.Event | None) -> threading.Thread | None:
    """Give ``chunks`` back on a thread of their own once ``after`` (the side stream's last
    copy that may touch them) has completed; returns the thread (None: nothing to release)."""
    if not chunks:
        return None

    def run() -> None:
        try:
            if after is not None:
                after.synchronize()
            while chunks:
                chunks.pop().unregister()  # now, on this thread; the tensor's memory goes with it
        except Exception:  # noqa: BLE001 - leaving memory registered costs memory, not correctness
            logger.warning("releasing swap-pool host memory failed", exc_info=True)

    thread = threading.Thread(target=run, name="swap-release", daemon=True)
    thread.start()
    return thread

