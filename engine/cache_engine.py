"""The KV cache tensors of one rank: the GPU pool and the CPU swap pool, and block copies."""

from __future__ import annotations

import torch


class CacheEngine:
    """Owns ``(L, 2, num_blocks, block_size, kv_heads, head_dim)`` caches on the device and the host.

    One tensor per pool, so a swap is a single indexed copy over every layer at once.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.device = device
        shape = (num_layers, 2, num_gpu_blocks, block_size, num_kv_heads, head_dim)
        self.gpu = torch.zeros(shape, dtype=dtype, device=device)
        pin = device.type == "cuda"
        # NOTE: empty, not zeros: the host pool is only touched where blocks are swapped.
        self.cpu = torch.empty(shape[:2] + (num_cpu_blocks,) + shape[3:], dtype=dtype, pin_memory=pin)
        self.kv_caches = [(self.gpu[i, 0], self.gpu[i, 1]) for i in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def swap_out(self, pairs: torch.Tensor) -> None:
        """Copy GPU blocks to CPU blocks; ``pairs``: (K, 2) int64 of (gpu, cpu)."""
        if pairs.numel() == 0:
            return
        src, dst = pairs[:, 0].to(self.device), pairs[:, 1]
        self.cpu[:, :, dst] = self.gpu[:, :, src].to("cpu")

    def swap_in(self, pairs: torch.Tensor) -> None:
        """Copy CPU blocks to GPU blocks; ``pairs``: (K, 2) int64 of (cpu, gpu)."""
        if pairs.numel() == 0:
            return
        src, dst = pairs[:, 0], pairs[:, 1].to(self.device)
        self.gpu[:, :, dst] = self.cpu[:, :, src].to(self.device, non_blocking=True)
