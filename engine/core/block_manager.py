"""Paged KV-cache bookkeeping: which blocks of the pools (``engine/core/block_pool.py``:
reference counts, the prefix cache's hashes, chunks) each sequence holds.

Plain Python, no torch. A block holds ``block_size`` consecutive tokens of one sequence.
A full block is identified by a hash chained over every token up to its end, so two
sequences that share a prefix share its blocks (automatic prefix caching). A block whose
reference count drops to zero keeps its hash and contents until it is reallocated, so a
later request can still hit it (free blocks are evicted least recently freed first).

The CPU swap pool is the same kind of pool, cut into chunks so that it can grow and shrink
at run time without moving a swapped-out block (the cache engine allocates a chunk's host
memory on the first copy into it and frees it when the chunk is removed).
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

from engine.core.block_pool import BlockPool, chain_hash
from engine.core.sequence import Sequence


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class BlockManager:
    """Maps sequences to blocks in the GPU pool and, when swapped out, the CPU pool."""

    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
        cpu_chunk_blocks: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.gpu = BlockPool(num_gpu_blocks, enable_prefix_caching)
        # The swap pool grows and shrinks in chunks of ``cpu_chunk_blocks`` (default: one chunk).
        self.cpu = BlockPool(num_cpu_blocks, enable_prefix_caching, cpu_chunk_blocks)
        self.prefix_stats = PrefixCacheStats()
        self._num_registered: dict[int, int] = {}  # seq_id -> full blocks registered
        # Full blocks running sequences compute and have not published yet: hash -> how many
        # compute it, and per sequence (first block index, its hashes still to publish).
        self._computing: dict[bytes, int] = {}
        self._computing_of: dict[int, tuple[int, list[bytes]]] = {}

    # ----- hashing -------------------------------------------------------------------
    def update_hashes(self, seq: Sequence, limit: int | None = None) -> None:
        """Extend ``seq.block_hashes`` over every full block of its tokens (the first ``limit`` blocks)."""
        bs = self.block_size
        end = len(seq.token_ids) if limit is None else min(len(seq.token_ids), limit * bs)
        while (len(seq.block_hashes) + 1) * bs <= end:  # read-back tokens only
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(chain_hash(parent, seq.token_ids[i * bs : (i + 1) * bs]))

    # ----- the express lane's quarantine ----------------------------------------------
    def track_frees(self) -> None:
        """From now on, keep freed GPU blocks from the express lane until they are settled.

        NOTE: a step runs on the device after its blocks were given out; with async scheduling
        a sequence that its previous token ended still writes one more slot in the step after,
        and a preempted one's blocks are read by its swap-out copies. A block freed meanwhile
        is safe for the steps queued behind those (they run after them on the same stream), not
        for work run beside them (the express lane). Frees are stamped with the scheduler epoch
        (one per scheduled step, ``next_epoch``); once the step of epoch e has finished on the
        device, ``settle(e)`` clears every block freed in e or before (the steps that could
        still write such a block were launched in e or before)."""
        if self.gpu.recently_freed is None:
            self.gpu.recently_freed = {}

    def next_epoch(self) -> int:
        """A step is about to be scheduled: frees from now on belong to it (returns its epoch)."""
        self.gpu.epoch += 1
        return self.gpu.epoch

    def settle(self, epoch: int) -> None:
        """The step of ``epoch`` has finished on the device, and every step before it."""
        freed = self.gpu.recently_freed
        if freed:
            self.gpu.recently_freed = {b: e for b, e in freed.items() if e > epoch}

    @property
    def quarantined(self) -> dict[int, int]:
        """GPU blocks freed and not yet settled (block -> epoch; empty when frees are not tracked)."""
        return self.gpu.recently_freed or {}

    # ----- GPU allocation ------------------------------------------------------------
    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """GPU blocks already holding the longest cached prefix of a fresh sequence.

        At least one token is always left to compute, since its logits are needed, and so is
        every prompt position whose prompt logprob is still wanted (``Sequence.num_cacheable_tokens``).
        """
        if not self.enable_prefix_caching or seq.num_computed_tokens or seq.block_table:
            return []
        max_blocks = max(0, seq.num_cacheable_tokens) // self.block_size
        hits: list[int] = []
        # NOTE: hashed as far as the lookups go (and the first block that misses, which
        # ``prefix_in_flight`` asks about): a waiting queue passed over step after step hashes
        # each prompt's blocks once, and only those up to its first miss
        while len(hits) < max_blocks:
            self.update_hashes(seq, len(hits) + 1)
            if len(seq.block_hashes) <= len(hits):
                break
            block_id = self.gpu.lookup(seq.block_hashes[len(hits)])
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def prefix_in_flight(self, seq: Sequence, cached: list[int]) -> bool:
        """Whether the block after ``cached`` of a waiting sequence is being computed by a running one.

        NOTE: the scheduler then admits the sequence a step or two later, when that block is
        published, rather than computing the same block twice: jobs that share a long prefix
        and arrive together (a grading rubric) compute it once instead of once per step's batch.
        """
        i = len(cached)
        if not self._computing or i >= len(seq.block_hashes) or i >= max(0, seq.num_cacheable_tokens) // self.block_size:
            return False
        return seq.block_hashes[i] in self._computing

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, cached: list[int] = ()) -> int:
        """Free GPU blocks that scheduling ``num_new_tokens`` more would consume."""
        have = len(seq.block_table) + len(cached)
        total = -(-(seq.num_computed_tokens + len(cached) * self.block_size + num_new_tokens) // self.block_size)
        revived = sum(1 for b in cached if self.gpu.ref_counts[b] == 0)
        return max(0, total - have) + revived

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] = ()) -> bool:
        return self.blocks_needed(seq, num_new_tokens, cached) <= self.gpu.num_free

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] = (),
                 avoid: Container[int] | None = None) -> None:
        """Give ``seq`` blocks for its next ``num_new_tokens`` tokens (after ``cached``), none of ``avoid``."""
        if self.enable_prefix_caching and not seq.block_table:  # admitted: the blocks it will compute
            self.update_hashes(seq)
            marks = seq.block_hashes[len(cached):]
            for block_hash in marks:
                self._computing[block_hash] = self._computing.get(block_hash, 0) + 1
            self._computing_of[seq.seq_id] = (len(cached), marks)
        if cached:
            for block_id in cached:
                self.gpu.touch(block_id)
            seq.block_table.extend(cached)
            seq.num_computed_tokens += len(cached) * self.block_size
            self._num_registered[seq.seq_id] = len(cached)
        if seq.num_cached_tokens < 0:
            seq.num_cached_tokens = len(cached) * self.block_size
            self.prefix_stats.queried_tokens += seq.num_prompt_tokens
            self.prefix_stats.hit_tokens += seq.num_cached_tokens
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        while len(seq.block_table) < total:
            seq.block_table.append(self.gpu.allocate(avoid))

    def commit(self, seq: Sequence) -> None:
        """Publish the hashes of blocks whose tokens are now all computed."""
        if not self.enable_prefix_caching:
            return
        self.update_hashes(seq)
        done = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        start = self._num_registered.get(seq.seq_id, 0)
        for i in range(start, done):
            self.gpu.register(seq.block_table[i], seq.block_hashes[i])
        self._num_registered[seq.seq_id] = max(start, done)
        first, marks = self._computing_of.get(seq.seq_id, (0, []))
        if done > first and marks:
            self._unmark(marks[: done - first])
            self._computing_of[seq.seq_id] = (done, marks[done - first:])

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's blocks (tail first, so the head stays cached longest)."""
        pool = self.cpu if seq.status.value == "swapped" else self.gpu
        for block_id in reversed(seq.block_table):
            pool.release(block_id)
        seq.block_table = []
        self._num_registered.pop(seq.seq_id, None)
        self._unmark(self._computing_of.pop(seq.seq_id, (0, []))[1])

    def _unmark(self, hashes: list[bytes]) -> None:
        for block_hash in hashes:
            left = self._computing.pop(block_hash) - 1
            if left:
                self._computing[block_hash] = left

    # ----- swapping ------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= self.cpu.num_free

    def num_swap_out_copies(self, seq: Sequence) -> int:
        """Blocks ``swap_out`` would copy: those not already in the CPU pool by hash."""
        self.update_hashes(seq)
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        shared = sum(1 for h in seq.block_hashes[:num_full] if self.cpu.lookup(h) is not None)
        return len(seq.block_table) - shared

    def num_recompute_tokens(self, seq: Sequence) -> int:
        """Computed tokens a recompute would redo.

        Leading blocks that other sequences also hold stay in the GPU prefix cache, so a
        recompute finds them there instead of computing them again.
        """
        kept = 0
        if self.enable_prefix_caching:
            for block_id in seq.block_table[: seq.num_computed_tokens // self.block_size]:
                if self.gpu.ref_counts[block_id] < 2 or self.gpu.block_hash[block_id] is None:
                    break
                kept += 1
        return seq.num_computed_tokens - kept * self.block_size

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move the sequence's blocks to the CPU pool; returns (gpu, cpu) copies to make.

        A full block already in the CPU pool (same hash) is shared, not copied again.
        """
        self.update_hashes(seq)
        copies = self._move(seq, self.gpu, self.cpu)
        self._num_registered.pop(seq.seq_id, None)
        self._unmark(self._computing_of.pop(seq.seq_id, (0, []))[1])  # NOTE: no one waits on a swapped-out sequence
        return copies

    def can_swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(total, len(seq.block_table)) <= self.gpu.num_free

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring the sequence's blocks back to the GPU; returns (cpu, gpu) copies to make."""
        copies = self._move(seq, self.cpu, self.gpu)
        self._num_registered[seq.seq_id] = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        return copies

    def _move(self, seq: Sequence, src: BlockPool, dst: BlockPool) -> list[tuple[int, int]]:
        """Give ``seq`` blocks in ``dst`` for those it holds in ``src``; a full block ``dst``
        already holds (same hash) is shared. Returns the (src, dst) copies to make."""
        copies: list[tuple[int, int]] = []
        table: list[int] = []
        num_hashed = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        for i, block in enumerate(seq.block_table):
            block_hash = seq.block_hashes[i] if i < num_hashed else None
            moved = dst.lookup(block_hash) if block_hash is not None else None
            if moved is not None:
                dst.touch(moved)
            else:
                moved = dst.allocate()
                copies.append((block, moved))
                if block_hash is not None:
                    dst.register(moved, block_hash)
            table.append(moved)
        for block in reversed(seq.block_table):
            src.release(block)
        seq.block_table = table
        return copies
