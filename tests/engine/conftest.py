"""Fixtures of the engine suite."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# NOTE: triton decides compiled vs interpreted when each kernel is defined, i.e. when the
# engine first imports sluiceway_kernels/; on a machine without CUDA the kernels must be interpreted
# (the kernel suite and the Triton-backend test here need it), so set it before importing.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.runner.attention import get_attention_backend  # noqa: E402
from engine.runner.attention.metadata import AttentionMetadata, ForwardContext  # noqa: E402
from engine.models.shape import ModelShape  # noqa: E402
from engine.models.tiny import build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """``factory(arch="llama", **kw) -> Path``: a tiny checkpoint from ``engine.models.tiny``.

    Built once per session for each set of arguments and shared, so treat it as read-only.
    """
    built: dict[tuple, Path] = {}

    def factory(arch: str = "llama", **kw) -> Path:
        key = (arch, repr(sorted(kw.items())))
        if key not in built:
            built[key] = build_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch=arch, **kw)
        return built[key]

    return factory


@pytest.fixture
def make_cpu_engine(tiny_model_factory):
    """``make(**engine_args) -> LLMEngine``: a one-layer tiny llama on the CPU without a swap
    pool, shut down at teardown."""
    from engine import LLMEngine

    engines = []

    def make(**overrides) -> LLMEngine:
        model = tiny_model_factory(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1)
        engines.append(LLMEngine(**{**dict(model=str(model), device="cpu", swap_space=0), **overrides}))
        return engines[-1]

    yield make
    for engine in engines:
        engine.shutdown()


@pytest.fixture
def make_paged_cache():
    """``make_paged_cache(hf_config, block_size=4, num_blocks=64, backend="torch") -> PagedCache``."""
    return PagedCache


class PagedCache:
    """A real paged KV cache whose blocks are handed out in scrambled order, and the step
    metadata over it, built the way the model runner builds it."""

    def __init__(self, config, block_size: int = 4, num_blocks: int = 64, seed: int = 0, backend: str = "torch"):
        kv = ModelShape.from_hf_config(config)
        shape = (num_blocks, block_size, kv.num_kv_heads, kv.head_dim)
        self.kv_caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_hidden_layers)]
        self.block_size = block_size
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables: dict[str, list[int]] = {}
        self.backend = get_attention_backend(backend, "cpu")

    def step(self, model, chunks: list[tuple[str, list[int], int]]) -> list[torch.Tensor]:
        """One forward over ``(seq_id, tokens, start)`` chunks: tokens[start:] are new, the
        earlier ones are already cached. Returns each chunk's (new, vocab) logits."""
        bs = self.block_size
        ids, positions, slots, tables, context_lens, starts = [], [], [], [], [], [0]
        for seq_id, tokens, start in chunks:
            table = self.tables.setdefault(seq_id, [])
            while len(table) * bs < len(tokens):
                table.append(self.free.pop())
            ids += tokens[start:]
            positions += range(start, len(tokens))
            slots += [table[p // bs] * bs + p % bs for p in range(start, len(tokens))]
            tables.append(table)
            context_lens.append(len(tokens))
            starts.append(starts[-1] + len(tokens) - start)
        width = max(len(t) for t in tables)
        query_lens = [b - a for a, b in zip(starts, starts[1:])]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            context_lens=torch.tensor(context_lens, dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            max_query_len=max(query_lens),
            max_context_len=max(context_lens),
            decode_only=all(n == 1 for n in query_lens),
            # as the runner counts them: the leading single-token queries of a step with prompts
            num_decodes=0 if max(query_lens) == 1 else next(i for i, n in enumerate(query_lens) if n != 1),
        )
        with torch.inference_mode():
            hidden = model(torch.tensor(ids), torch.tensor(positions), ForwardContext(meta, self.kv_caches, self.backend))
            logits = model.compute_logits(hidden)  # (T, vocab)
        return list(logits.split(query_lens))
