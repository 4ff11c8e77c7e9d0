"""The KV cache tensors of one rank: the device pool, the chunked host swap pool, and the copies between them."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from engine.models.shape import ModelShape
from engine.runner import host_memory

logger = logging.getLogger(__name__)

STAGING_BYTES = 512 << 20  # device memory one batch of swap copies stages through
# A swap-out gathers this many staging batches ahead of their host copies: a step's victims up
# to 1 GiB (a llama3-8b sequence of 8k tokens) cost the forward only their gathers.
GATHER_AHEAD_ROUNDS = 2


@dataclass
class SwapCounters:
    """Where swap time goes (cumulative). Device times are read from CUDA events once they
    have completed, so they lag the copies a little; on a CPU device they stay 0."""

    blocks_out: int = 0
    blocks_in: int = 0
    copies: int = 0  # host <-> device copy calls; a run of consecutive host blocks is one
    host_s: float = 0.0  # host time inside swap_out / swap_in (issuing copies; pinning chunks not ready)
    chunks_pinned_ahead: int = 0  # host chunks allocated before a copy needed them
    chunks_pinned_in_step: int = 0  # host chunks a copy had to allocate itself
    device_out_s: float = 0.0  # side-stream time of swap-outs, start to last host copy
    device_in_s: float = 0.0  # side-stream time of swap-ins, start to the last scatter
    compute_wait_s: float = 0.0  # side-stream time the compute stream waited on (gathers, scatters)


class CacheEngine:
    """One rank's KV cache; with tensor parallelism every rank swaps its own shard.

    Device: ``gpu`` is ``(L, 2, num_gpu_blocks, block_size, kv_heads, head_dim)``, and
    ``kv_caches`` hands each layer its (k, v) views. A one-byte cache dtype (float8) is held
    as uint8, which every copy and indexing op supports, and viewed as float8 for the kernels.
    Host: ``cpu_chunks``, one tensor per
    swap-pool chunk of ``(chunk_blocks, L, 2, block_size, kv_heads, head_dim)``: block-major,
    so a host block is one contiguous run of bytes and consecutive block ids are one copy.
    On CUDA a chunk's pinned memory is allocated ahead of need: ``reserve`` at start-up pins
    the whole configured pool before the engine serves, and when the pool grows at run time
    a background thread pins the new chunks, so a swap-out finds its chunk ready instead of
    pinning memory inside the step (a copy still allocates a chunk the thread has
    not reached yet, and counts it). On a CPU device a chunk is allocated on the first copy
    into it, so a pool that is never used costs nothing. ``truncate`` releases the memory of
    chunks past the end when the pool shrinks.

    Copies are batched. A swap-out gathers every source block with one indexed select into a
    device staging tensor, then copies it to the host run by run; a swap-in copies host runs
    into staging and scatters them with one indexed copy. On CUDA they run on a side stream:

    - the side stream first waits for the compute stream, so the forwards that wrote (or
      still read) the blocks involved have finished;
    - after a swap-out's gathers the compute stream waits for them only, not for the host
      copies (up to ``GATHER_AHEAD_ROUNDS`` staging batches are gathered before any is
      copied): the next forward may then overwrite the freed device blocks while the copies
      to the host overlap it;
    - a swap-in's blocks are scattered before the compute stream may continue, so the
      forward reads them;
    - host blocks are only ever read or written by copies on the side stream, so a block
      freed and reused is reused in stream order, and a chunk's memory is released only
      after the side stream's last copy has completed.

    On a CPU device the same code runs with plain synchronous copies.
    """

    def __init__(
        self,
        shape: ModelShape,
        block_size: int,
        num_gpu_blocks: int,
        cpu_chunk_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        pin_ahead: bool | None = None,  # default: on CUDA
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.dtype = torch.uint8 if dtype.itemsize == 1 else dtype  # what the pools store
        layers, kv_heads, head_dim = shape.num_layers, shape.num_kv_heads_per_rank, shape.head_dim
        self.gpu = torch.zeros((layers, 2, num_gpu_blocks, block_size, kv_heads, head_dim), dtype=self.dtype,
                               device=device)
        self.kv_caches = [(self.gpu[i, 0].view(dtype), self.gpu[i, 1].view(dtype)) for i in range(layers)]
        self.block_shape = (layers, 2, block_size, kv_heads, head_dim)
        self._gpu_blocks = self.gpu.permute(2, 0, 1, 3, 4, 5)  # (N, L, 2, bs, Hkv, D) view
        self.bytes_per_block = shape.kv_bytes_per_token(dtype.itemsize) * block_size
        self.chunk_blocks = max(1, cpu_chunk_blocks)
        # a chunk's host memory is registered in pieces of this many blocks; no copy spans two
        self.piece_blocks = min(self.chunk_blocks, host_memory.piece_blocks(self.bytes_per_block))
        self.cpu_chunks: list[torch.Tensor | None] = []
        self.staging_blocks = max(1, STAGING_BYTES // self.bytes_per_block)
        self.counters = SwapCounters()
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self.pin_ahead = device.type == "cuda" if pin_ahead is None else pin_ahead
        self._done: torch.cuda.Event | None = None  # recorded after the side stream's latest copies
        self._timings: list[tuple[str, torch.cuda.Event, torch.cuda.Event, torch.cuda.Event]] = []
        # The pool's chunks and the pinning thread: ``_lock`` guards ``cpu_chunks`` and ``_num_chunks``.
        self._lock = threading.Lock()
        self._num_chunks = 0  # chunks the pool has now (what ``reserve`` and ``truncate`` said last)
        self._pinning = False  # a pinning thread is running (it reads ``_num_chunks`` as it goes)
        self._releaser: threading.Thread | None = None  # the latest thread giving dropped chunks back
        self._released: torch.cuda.Event | None = None  # the side stream's release of the compute stream

    @property
    def resident_bytes(self) -> int:
        """Host memory the swap pool holds now."""
        return sum(t is not None for t in self.cpu_chunks) * self.chunk_blocks * self.bytes_per_block

    # ----- copies ---------------------------------------------------------------------
    def swap_out(self, pairs: torch.Tensor) -> None:
        """Copy device blocks to host blocks; ``pairs``: (K, 2) int64 of (gpu, cpu)."""
        if pairs.numel() == 0:
            return
        started = time.perf_counter()
        gpu_ids, cpu_ids = _sorted_by(pairs, column=1)
        for chunk in {b // self.chunk_blocks for b in cpu_ids}:
            self._materialize(chunk)
        with self._side_stream("out") as compute:
            src = self._index(gpu_ids)  # (K,)
            staged: list[tuple[int, int, torch.Tensor]] = []
            for lo in range(0, len(cpu_ids), self.staging_blocks):
                hi = min(lo + self.staging_blocks, len(cpu_ids))
                staging = torch.empty((hi - lo, *self.block_shape), dtype=self.dtype, device=self.device)
                torch.index_select(self._gpu_blocks, 0, src[lo:hi], out=staging)  # (k, L, 2, bs, Hkv, D)
                staged.append((lo, hi, staging))
                if hi == len(cpu_ids):
                    self._release(compute)  # every source block has been read
                # NOTE: up to GATHER_AHEAD_ROUNDS rounds are gathered before their copies to the host
                # are issued (side-stream order), so the forward waits for the gathers alone; past
                # that, staging memory is reused and a later gather waits for earlier host copies.
                if hi == len(cpu_ids) or len(staged) == GATHER_AHEAD_ROUNDS:
                    for s_lo, s_hi, buffer in staged:
                        for chunk, start, k, n in self._runs(cpu_ids, s_lo, s_hi):
                            self.cpu_chunks[chunk][start : start + n].copy_(buffer[k - s_lo : k - s_lo + n],
                                                                            non_blocking=True)
                            self.counters.copies += 1
                    staged = []
        self.counters.blocks_out += len(cpu_ids)
        self.counters.host_s += time.perf_counter() - started

    def swap_in(self, pairs: torch.Tensor) -> None:
        """Copy host blocks to device blocks; ``pairs``: (K, 2) int64 of (cpu, gpu)."""
        if pairs.numel() == 0:
            return
        started = time.perf_counter()
        cpu_ids, gpu_ids = _sorted_by(pairs, column=0)
        with self._side_stream("in") as compute:
            dst = self._index(gpu_ids)  # (K,)
            for lo in range(0, len(cpu_ids), self.staging_blocks):
                hi = min(lo + self.staging_blocks, len(cpu_ids))
                staging = torch.empty((hi - lo, *self.block_shape), dtype=self.dtype, device=self.device)
                for chunk, start, k, n in self._runs(cpu_ids, lo, hi):
                    staging[k - lo : k - lo + n].copy_(self.cpu_chunks[chunk][start : start + n], non_blocking=True)
                    self.counters.copies += 1
                self._gpu_blocks.index_copy_(0, dst[lo:hi], staging)
            self._release(compute)  # the forward reads these blocks
        self.counters.blocks_in += len(cpu_ids)
        self.counters.host_s += time.perf_counter() - started

    def reserve(self, num_chunks: int, wait: bool = False) -> None:
        """The pool now has ``num_chunks`` chunks: pin those not allocated yet ahead of need
        (``pin_ahead``), in a background thread, or here when ``wait`` (start-up)."""
        with self._lock:
            self._num_chunks = num_chunks
            missing = self.pin_ahead and any(self._chunk(c) is None for c in range(num_chunks))
            start = missing and not wait and not self._pinning
            self._pinning = self._pinning or start
        if wait and missing:
            self._pin_missing()
        elif start:
            self._pinner = threading.Thread(target=self._pin_in_background, name="swap-pinner", daemon=True)
            self._pinner.start()

    def wait_pinned(self) -> None:
        """Wait for the background pinning to finish (tests, benchmarks)."""
        pinner = getattr(self, "_pinner", None)
        if pinner is not None:
            pinner.join()

    def truncate(self, num_chunks: int) -> None:
        """Release the host memory of swap-pool chunks ``num_chunks`` and up (the pool shrank).

        On CUDA the memory goes back on a thread of its own once the side stream's copies so
        far have completed (``host_memory.release``): the step loop neither waits for them
        nor unregisters anything."""
        with self._lock:
            self._num_chunks = min(self._num_chunks, num_chunks)
            dropped = [t for t in self.cpu_chunks[num_chunks:] if t is not None]
            del self.cpu_chunks[num_chunks:]
        if self.stream is not None:
            self._releaser = host_memory.release(dropped, self._done) or self._releaser

    def wait_released(self) -> None:
        """Wait for the host memory of chunks dropped so far to be given back (tests, benchmarks)."""
        if self._releaser is not None:
            self._releaser.join()

    def synchronize(self) -> None:
        """Wait for every swap copy issued so far (benchmarks; tests), and count their device time."""
        if self._done is not None:
            self._done.synchronize()
        self._read_timings()

    # ----- helpers --------------------------------------------------------------------
    @contextlib.contextmanager
    def _side_stream(self, direction: str) -> Iterator[torch.cuda.Stream | None]:
        """Run the body's copies on the side stream, after the compute stream's queued work.

        Yields the compute stream (None on a CPU device) for ``_release``.
        """
        if self.stream is None:
            yield None
            return
        self._read_timings()
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        begin = torch.cuda.Event(enable_timing=True)
        begin.record(self.stream)
        self._released = None
        with torch.cuda.stream(self.stream):
            yield compute
        self._done = torch.cuda.Event(enable_timing=True)
        self._done.record(self.stream)
        self._timings.append((direction, begin, self._released or begin, self._done))

    def _release(self, compute: torch.cuda.Stream | None) -> None:
        """Let the compute stream go on once the side stream's work so far is done."""
        if compute is not None:
            ready = torch.cuda.Event(enable_timing=True)
            ready.record(self.stream)
            compute.wait_event(ready)
            self._released = ready

    def _read_timings(self) -> None:
        """Add the device time of completed swaps to the counters."""
        while self._timings and self._timings[0][3].query():
            direction, begin, released, end = self._timings.pop(0)
            total = begin.elapsed_time(end) / 1e3
            if direction == "out":
                self.counters.device_out_s += total
            else:
                self.counters.device_in_s += total
            self.counters.compute_wait_s += begin.elapsed_time(released) / 1e3

    def _index(self, ids: list[int]) -> torch.Tensor:
        """Block ids on the device, copied from pinned memory so the host does not wait.

        NOTE: a copy from pageable memory would first wait for the side stream's earlier
        copies, stalling the host on the previous swap.
        """
        host = torch.tensor(ids, dtype=torch.long)
        if self.stream is None:
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def _materialize(self, chunk: int) -> None:
        """Host memory for ``chunk`` before a copy into it (allocated here if nothing pinned it yet)."""
        with self._lock:
            if self._chunk(chunk) is not None:
                return
            self._store(chunk, self._new_chunk())
            self.counters.chunks_pinned_in_step += 1

    def _pin_in_background(self) -> None:
        try:
            self._pin_missing(background=True)
        except Exception:  # NOTE: e.g. pinned memory exhausted: copies then allocate their chunks themselves
            logger.warning("pinning the swap pool ahead of need failed", exc_info=True)
            with self._lock:
                self._pinning = False

    def _pin_missing(self, background: bool = False) -> None:
        """Allocate every chunk of the pool that has no memory yet (the pinning thread's body)."""
        chunk = 0
        while True:
            with self._lock:
                while chunk < self._num_chunks and self._chunk(chunk) is not None:
                    chunk += 1
                if chunk >= self._num_chunks:
                    if background:
                        self._pinning = False  # under the lock: a later reserve starts a new thread
                    return
            tensor = self._new_chunk()  # NOTE: outside the lock: pinning 256 MiB takes tens of ms
            with self._lock:
                if chunk < self._num_chunks and self._chunk(chunk) is None:
                    self._store(chunk, tensor)
                    self.counters.chunks_pinned_ahead += 1

    def _new_chunk(self) -> torch.Tensor:
        shape = (self.chunk_blocks, *self.block_shape)
        if self.stream is None:
            return torch.empty(shape, dtype=self.dtype)
        piece = self.piece_blocks * self.bytes_per_block if self.piece_blocks < self.chunk_blocks else None
        return host_memory.registered_empty(shape, self.dtype, piece)  # NOTE: not cudaHostAlloc: see host_memory

    def _chunk(self, chunk: int) -> torch.Tensor | None:
        return self.cpu_chunks[chunk] if chunk < len(self.cpu_chunks) else None

    def _store(self, chunk: int, tensor: torch.Tensor) -> None:
        while len(self.cpu_chunks) <= chunk:
            self.cpu_chunks.append(None)
        self.cpu_chunks[chunk] = tensor

    def _runs(self, host_ids: list[int], lo: int, hi: int) -> Iterator[tuple[int, int, int, int]]:
        """``(chunk, start in chunk, position in host_ids, length)`` of consecutive host blocks
        within one registered piece of a chunk."""
        run: list[int] | None = None
        for k in range(lo, hi):
            chunk, offset = divmod(host_ids[k], self.chunk_blocks)
            if run is not None and run[0] == chunk and run[1] + run[3] == offset and offset % self.piece_blocks:
                run[3] += 1
                continue
            if run is not None:
                yield tuple(run)
            run = [chunk, offset, k, 1]
        if run is not None:
            yield tuple(run)


def _sorted_by(pairs: torch.Tensor, column: int) -> tuple[list[int], list[int]]:
    """The two columns of ``pairs`` as lists, rows ordered by ``column``."""
    rows = sorted(pairs.tolist(), key=lambda row: row[column])
    return [r[0] for r in rows], [r[1] for r in rows]

