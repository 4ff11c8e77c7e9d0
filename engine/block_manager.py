"""Paged KV-cache bookkeeping: block pools with reference counts and a prefix cache.

Plain Python, no torch. A block holds ``block_size`` consecutive tokens of one sequence.
A full block is identified by a hash chained over every token up to its end, so two
sequences that share a prefix share its blocks (automatic prefix caching). A block whose
reference count drops to zero keeps its hash and contents until it is reallocated, so a
later request can still hit it (free blocks are evicted least recently freed first).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from engine.sequence import Sequence


def chain_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    """Hash of a full block given the hash of the block before it."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(b"".join(t.to_bytes(4, "little", signed=False) for t in tokens))
    return h.digest()


class BlockPool:
    """A fixed set of block ids (GPU or CPU), their reference counts and a hash index."""

    def __init__(self, num_blocks: int, caching: bool) -> None:
        self.num_blocks = num_blocks
        self.caching = caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self) -> int:
        """Take the least recently freed block, dropping whatever it cached."""
        block_id, _ = self.free.popitem(last=False)
        old = self.block_hash[block_id]
        if old is not None:
            if self.cached.get(old) == block_id:
                del self.cached[old]
            self.block_hash[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id

    def touch(self, block_id: int) -> None:
        """Add a reference to a (possibly free but still cached) block."""
        if self.ref_counts[block_id] == 0:
            del self.free[block_id]
        self.ref_counts[block_id] += 1

    def release(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] < 0:
            raise RuntimeError(f"block {block_id} released more often than referenced")
        if self.ref_counts[block_id] == 0:
            self.free[block_id] = None

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash) if self.caching else None

    def register(self, block_id: int, block_hash: bytes) -> None:
        if not self.caching or self.block_hash[block_id] is not None:
            return
        if block_hash not in self.cached:
            self.cached[block_hash] = block_id
        self.block_hash[block_id] = block_hash


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
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.gpu = BlockPool(num_gpu_blocks, enable_prefix_caching)
        self.cpu = BlockPool(num_cpu_blocks, enable_prefix_caching)
        self.prefix_stats = PrefixCacheStats()
        self._num_registered: dict[int, int] = {}  # seq_id -> full blocks registered

    # ----- hashing -------------------------------------------------------------------
    def update_hashes(self, seq: Sequence) -> None:
        """Extend ``seq.block_hashes`` over every full block of its tokens."""
        bs = self.block_size
        while (len(seq.block_hashes) + 1) * bs <= seq.num_tokens:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(chain_hash(parent, seq.token_ids[i * bs : (i + 1) * bs]))

    # ----- GPU allocation ------------------------------------------------------------
    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """GPU blocks already holding the longest cached prefix of a fresh sequence.

        At least one token is always left to compute, since its logits are needed.
        """
        if not self.enable_prefix_caching or seq.num_computed_tokens or seq.block_table:
            return []
        self.update_hashes(seq)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in seq.block_hashes[:max_blocks]:
            block_id = self.gpu.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, cached: list[int] = ()) -> int:
        """Free GPU blocks that scheduling ``num_new_tokens`` more would consume."""
        have = len(seq.block_table) + len(cached)
        total = -(-(seq.num_computed_tokens + len(cached) * self.block_size + num_new_tokens) // self.block_size)
        revived = sum(1 for b in cached if self.gpu.ref_counts[b] == 0)
        return max(0, total - have) + revived

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] = ()) -> bool:
        return self.blocks_needed(seq, num_new_tokens, cached) <= self.gpu.num_free

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] = ()) -> None:
        """Give ``seq`` blocks for its next ``num_new_tokens`` tokens (after ``cached``)."""
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
            seq.block_table.append(self.gpu.allocate())

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

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's blocks (tail first, so the head stays cached longest)."""
        pool = self.cpu if seq.status.value == "swapped" else self.gpu
        for block_id in reversed(seq.block_table):
            pool.release(block_id)
        seq.block_table = []
        self._num_registered.pop(seq.seq_id, None)

    # ----- swapping ------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= self.cpu.num_free

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move the sequence's blocks to the CPU pool; returns (gpu, cpu) copies to make.

        A full block already in the CPU pool (same hash) is shared, not copied again.
        """
        self.update_hashes(seq)
        copies: list[tuple[int, int]] = []
        cpu_table: list[int] = []
        num_full = seq.num_computed_tokens // self.block_size
        for i, gpu_block in enumerate(seq.block_table):
            block_hash = seq.block_hashes[i] if i < min(num_full, len(seq.block_hashes)) else None
            cpu_block = self.cpu.lookup(block_hash) if block_hash is not None else None
            if cpu_block is not None:
                self.cpu.touch(cpu_block)
            else:
                cpu_block = self.cpu.allocate()
                copies.append((gpu_block, cpu_block))
                if block_hash is not None:
                    self.cpu.register(cpu_block, block_hash)
            cpu_table.append(cpu_block)
        for gpu_block in reversed(seq.block_table):
            self.gpu.release(gpu_block)
        seq.block_table = cpu_table
        self._num_registered.pop(seq.seq_id, None)
        return copies

    def can_swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(total, len(seq.block_table)) <= self.gpu.num_free

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring the sequence's blocks back to the GPU; returns (cpu, gpu) copies to make."""
        copies: list[tuple[int, int]] = []
        gpu_table: list[int] = []
        num_full = seq.num_computed_tokens // self.block_size
        for i, cpu_block in enumerate(seq.block_table):
            block_hash = seq.block_hashes[i] if i < min(num_full, len(seq.block_hashes)) else None
            gpu_block = self.gpu.lookup(block_hash) if block_hash is not None else None
            if gpu_block is not None:
                self.gpu.touch(gpu_block)
            else:
                gpu_block = self.gpu.allocate()
                copies.append((cpu_block, gpu_block))
                if block_hash is not None:
                    self.gpu.register(gpu_block, block_hash)
            gpu_table.append(gpu_block)
        for cpu_block in reversed(seq.block_table):
            self.cpu.release(cpu_block)
        seq.block_table = gpu_table
        self._num_registered[seq.seq_id] = min(num_full, len(seq.block_hashes))
        return copies
