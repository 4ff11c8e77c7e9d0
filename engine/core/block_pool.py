"""A pool of KV-cache blocks: reference counts, least-recently-freed eviction, the prefix
cache's block hashes, and chunks that let a pool grow and shrink at run time
(``engine/core/block_manager.py`` maps sequences onto pools). Plain Python, no torch."""

from __future__ import annotations

import functools
import hashlib
import struct
from collections import OrderedDict
from collections.abc import Container, Iterable


def chain_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    """Hash of a full block given the hash of the block before it: each token id as 4 bytes,
    little-endian, unsigned.

    NOTE: packed by one ``struct`` call: a join over ``int.to_bytes`` per token made hashing the
    waiting queue's prompts the first step's longest part (2,048 grading prompts of 1,716
    tokens: about 1 s of host time on the H200's machine, before the GPU got any work)."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(_packer(len(tokens)).pack(*tokens))
    return h.digest()


@functools.lru_cache(maxsize=64)
def _packer(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}I")


class _Chunk:
    """One chunk of a pool: blocks ``base .. base + size - 1``."""

    __slots__ = ("base", "size", "fresh", "recycled")

    def __init__(self, base: int, size: int) -> None:
        self.base = base
        self.size = size
        self.fresh = 0  # blocks base + fresh .. are untouched since the chunk was added
        self.recycled: OrderedDict[int, None] = OrderedDict()  # freed blocks, least recently freed first

    @property
    def num_free(self) -> int:
        return self.size - self.fresh + len(self.recycled)


class BlockPool:
    """Block ids (GPU or CPU) with reference counts and a hash index, in chunks that come and go.

    Block ``b`` lives in chunk ``b // chunk_blocks``. Growing appends chunks, so live ids
    never change; shrinking removes chunks from the end, and only while the last chunk's
    blocks are all free (their cached hashes go with them), so the pool is always chunks
    ``0 .. num_chunks - 1`` and one number describes it to every rank. A free block is
    taken from the lowest chunk that has one (untouched blocks first, then the least
    recently freed), which packs use into low chunks and leaves high ones empty for the
    next shrink. The GPU pool is one chunk.
    """

    def __init__(self, num_blocks: int, caching: bool, chunk_blocks: int | None = None) -> None:
        if chunk_blocks is not None and chunk_blocks < 1:
            raise ValueError(f"chunk_blocks must be positive, got {chunk_blocks}")
        self.caching = caching
        self.chunk_blocks = chunk_blocks or max(1, num_blocks)
        self.num_free = 0
        self.ref_counts: list[int] = []
        self.block_hash: list[bytes | None] = []
        self.cached: dict[bytes, int] = {}
        self._chunks: list[_Chunk] = []
        # NOTE: the express lane's quarantine (``BlockManager.track_frees``): block -> the epoch
        # it was freed in, until the device has finished the steps that may still write it
        self.recently_freed: dict[int, int] | None = None
        self.epoch = 0
        self.resize(num_blocks)

    @property
    def num_blocks(self) -> int:
        return len(self._chunks) * self.chunk_blocks

    @property
    def num_chunks(self) -> int:
        return len(self._chunks)

    @property
    def num_used_chunks(self) -> int:
        """Chunks any block of which was handed out since the chunk was added."""
        return sum(1 for c in self._chunks if c.fresh)

    # ----- blocks --------------------------------------------------------------------
    def allocate(self, avoid: Container[int] | None = None) -> int:
        """Take a free block, dropping whatever it cached; never one of ``avoid``."""
        for chunk in self._chunks:
            if not chunk.num_free:
                continue
            if chunk.fresh < chunk.size:  # NOTE: an untouched block was never freed: never avoided
                block_id = chunk.base + chunk.fresh
                chunk.fresh += 1
            elif not avoid:
                block_id, _ = chunk.recycled.popitem(last=False)
                self._forget(block_id)
            else:
                block_id = next((b for b in chunk.recycled if b not in avoid), None)
                if block_id is None:
                    continue
                del chunk.recycled[block_id]
                self._forget(block_id)
            self.ref_counts[block_id] = 1
            self.num_free -= 1
            return block_id
        raise RuntimeError(f"no free block among {self.num_blocks}")

    def touch(self, block_id: int) -> None:
        """Add a reference to a (possibly free but still cached) block."""
        if self.ref_counts[block_id] == 0:
            del self._chunks[block_id // self.chunk_blocks].recycled[block_id]
            self.num_free -= 1
        self.ref_counts[block_id] += 1

    def release(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] < 0:
            raise RuntimeError(f"block {block_id} released more often than referenced")
        if self.ref_counts[block_id] == 0:
            self._chunks[block_id // self.chunk_blocks].recycled[block_id] = None
            self.num_free += 1
            if self.recently_freed is not None:
                self.recently_freed[block_id] = self.epoch

    def num_free_outside(self, avoid: Iterable[int]) -> int:
        """Free blocks that are not in ``avoid``."""
        return self.num_free - sum(1 for b in avoid if b < len(self.ref_counts) and self.ref_counts[b] == 0)

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash) if self.caching else None

    def register(self, block_id: int, block_hash: bytes) -> None:
        if not self.caching or self.block_hash[block_id] is not None:
            return
        if block_hash not in self.cached:
            self.cached[block_hash] = block_id
        self.block_hash[block_id] = block_hash

    def _forget(self, block_id: int) -> None:
        old = self.block_hash[block_id]
        if old is not None:
            if self.cached.get(old) == block_id:
                del self.cached[old]
            self.block_hash[block_id] = None

    # ----- chunks --------------------------------------------------------------------
    def resize(self, num_blocks: int) -> int:
        """Grow or shrink toward ``num_blocks`` in whole chunks (rounded down); returns the new size.

        Shrinking stops at the first chunk from the end that holds a referenced block.
        """
        target = max(0, num_blocks) // self.chunk_blocks
        while len(self._chunks) < target:
            chunk = _Chunk(self.num_blocks, self.chunk_blocks)
            self._chunks.append(chunk)
            self.ref_counts.extend([0] * chunk.size)
            self.block_hash.extend([None] * chunk.size)
            self.num_free += chunk.size
        while len(self._chunks) > target and self._chunks[-1].num_free == self._chunks[-1].size:
            chunk = self._chunks.pop()
            for block_id in chunk.recycled:
                self._forget(block_id)
            del self.ref_counts[chunk.base :]
            del self.block_hash[chunk.base :]
            self.num_free -= chunk.size
        return self.num_blocks
