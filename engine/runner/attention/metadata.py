"""What one forward pass needs to know about attention, passed explicitly to every layer."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built by the model runner from the scheduler's output.

    The batch holds B sequences and T new tokens in all. Sequence b contributes
    ``query_start_loc[b+1] - query_start_loc[b]`` new tokens (its query), which sit at the
    end of its ``context_lens[b]`` tokens; the earlier ones are already in the paged cache.
    """

    slot_mapping: torch.Tensor  # (T,) int64: cache slot (block * block_size + offset) per new token, -1 = skip
    block_tables: torch.Tensor  # (B, max_blocks) int32, padded with 0 past each sequence's blocks
    context_lens: torch.Tensor  # (B,) int32: tokens of each sequence after this step (cached + new)
    query_start_loc: torch.Tensor  # (B+1,) int32: cumulative query lengths
    max_query_len: int
    max_context_len: int
    decode_only: bool  # every query has length 1 (the CUDA-graph path)
    num_decodes: int = 0  # leading sequences whose query is one token (a mixed step's decodes)
    _parts: tuple[AttentionMetadata, AttentionMetadata] | None = field(default=None, repr=False, compare=False)

    def split(self) -> tuple[AttentionMetadata, AttentionMetadata]:
        """A mixed step's (leading decodes, the rest) as metadata of their own, sliced once a
        step rather than in every layer (the prefill part's ``query_start_loc`` starts at 0).

        NOTE: every layer of a mixed step sends its decodes and its prompts to different
        kernels; slicing the step's tensors there cost seven tensor ops a layer, one of them a
        kernel launch, on the eager path whose launches bound a prefill's latency.
        """
        if self._parts is None:
            d = self.num_decodes
            decodes = replace(self, slot_mapping=self.slot_mapping[:d], block_tables=self.block_tables[:d],
                              context_lens=self.context_lens[:d], query_start_loc=self.query_start_loc[:d + 1],
                              max_query_len=1, decode_only=True, num_decodes=0)
            rest = replace(self, slot_mapping=self.slot_mapping[d:], block_tables=self.block_tables[d:],
                           context_lens=self.context_lens[d:], query_start_loc=self.query_start_loc[d:] - d,
                           num_decodes=0)
            self._parts = (decodes, rest)
        return self._parts


class AttentionBackend(Protocol):
    """The attention seam: plain torch (CPU, reference) or Triton (GPU)."""

    def forward(
        self,
        q: torch.Tensor,  # (T, Hq, D)
        k: torch.Tensor,  # (T, Hkv, D) new keys, stored into the cache first
        v: torch.Tensor,  # (T, Hkv, D)
        k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
        v_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
        meta: AttentionMetadata,
        scale: float,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # a float8 cache's (k_scale, v_scale)
    ) -> torch.Tensor:  # (T, Hq, D)
        ...

    def forward_rotary(
        self,
        q: torch.Tensor,  # (T, Hq, D) un-rotated
        k: torch.Tensor,  # (T, Hkv, D) un-rotated
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        positions: torch.Tensor,  # (T,)
        cos_sin_cache: torch.Tensor,  # (max_pos, R) neox rotary table: cos | sin
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
        out: torch.Tensor | None = None,  # (T, Hq, D), D contiguous: written and returned
    ) -> torch.Tensor:  # (T, Hq, D)
        """``forward`` after rotating q and k at ``positions`` (q and k may be rotated in place)."""
        ...


@dataclass
class ForwardContext:
    """Everything a model's forward needs beyond token ids and positions, for one step."""

    attn: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k_cache, v_cache)
    backend: AttentionBackend
