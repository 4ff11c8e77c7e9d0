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
import threading
import weakref
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)


def _cudart():
    return torch.cuda.cudart()


def registered_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A host tensor locked in place for DMA: touched (so registering does not fault its pages
    in), then ``cudaHostRegister``-ed; unregistered when the tensor is collected, if
    ``release`` did not do it first."""
    tensor = torch.empty(tuple(shape), dtype=dtype)
    tensor.view(torch.uint8).zero_()
    ptr, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    code = int(_cudart().cudaHostRegister(ptr, size, 0))
    if code != 0:
        raise RuntimeError(f"cudaHostRegister of {size} bytes failed with CUDA error {code}")
    # NOTE: a finalizer, not a __del__: it runs once, either from ``release`` or when the last
    # reference goes (engine shutdown), whichever comes first
    tensor.unregister = weakref.finalize(tensor, _unregister, ptr)
    return tensor


def _unregister(ptr: int) -> None:
    try:
        _cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - at interpreter exit CUDA may already be gone
        pass


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

