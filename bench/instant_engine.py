"""A bench-only engine whose tokens cost nothing: each request ends at the first step after it
was added, with ``max_tokens`` tokens, so a worker driving it spends its time on Redis alone.
With ``tokens_per_step`` and ``step_s`` it keeps a GPU's cadence instead (one token a step, a
step every 30 ms, ...) without computing anything, for the Redis cost of long streamed jobs.

It satisfies ``worker.engine_host.EngineLike``; ``sluiceway worker`` never builds it (only
``bench/fleet.py`` hands it to a ``Worker``). Imports no torch.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from engine.outputs import CompletionOutput, RequestOutput
from engine.stats import EngineStats

# NOTE: roughly four characters a token, as English text runs, so result and stream entries
# carry as many bytes as a real model's would.
WORD = " tok"


@dataclass(frozen=True)
class _SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int = 8192


@dataclass(frozen=True)
class _CacheConfig:
    block_size: int = 16


@dataclass(frozen=True)
class InstantConfig:
    """The part of ``engine.config.EngineConfig`` the worker reads."""

    scheduler: _SchedulerConfig
    cache: _CacheConfig = field(default_factory=_CacheConfig)


@dataclass
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float
    n: int = 1
    produced: int = 0


class InstantEngine:
    """Every request gets ``tokens_per_step`` tokens a step (0: all at once), finish reason ``length``;
    a step that has requests lasts ``step_s``."""

    tokenizer = None  # prompts arrive as token ids (a text prompt counts one token a word)
    tokenizer_path = None

    def __init__(self, max_num_seqs: int = 256, max_model_len: int = 8192, tokens_per_step: int = 0,
                 step_s: float = 0.0, vocab_size: int = 32000) -> None:
        self.config = InstantConfig(_SchedulerConfig(max_num_seqs))
        self.vocab_size = vocab_size
        self.tokens_per_step = tokens_per_step
        self.step_s = step_s
        self.max_model_len = max_model_len
        self.kv_bytes_per_token = 0
        self._waiting: dict[str, _Request] = {}
        self._prompt_tokens = 0
        self._generated = 0

    def add_request(self, request_id: str, prompt: str | list[int], params: Any, priority: int = 0,
                    final_only: bool = False, resume_token_ids: list[int] | None = None) -> None:
        ids = list(prompt) if isinstance(prompt, list) else [1] * max(1, len(prompt.split()))
        max_tokens = params.max_tokens if params.max_tokens is not None else 16
        done = len(resume_token_ids or [])
        self._waiting[request_id] = _Request(request_id, ids, max(0, max_tokens - done), time.time(),
                                             getattr(params, "n", 1) or 1)

    def output_token_ids(self, request_id: str) -> list[list[int]] | None:
        request = self._waiting.get(request_id)
        if request is None:
            return None
        return [[(i % 1000) + 10 for i in range(request.produced)]]  # what the worker checkpoints

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            self._waiting.pop(rid, None)

    def num_unfinished_seqs(self) -> int:
        return len(self._waiting)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        return [1] * sum(1 + len(m.get("content") or "") // 4 for m in messages)

    def step(self) -> list[RequestOutput]:
        if self.step_s and self._waiting:
            time.sleep(self.step_s)  # NOTE: the GPU's step time, spent without computing
        outputs, finished = [], []
        for request in self._waiting.values():
            start = request.produced
            end = request.max_tokens if not self.tokens_per_step else min(request.max_tokens,
                                                                          start + self.tokens_per_step)
            request.produced = end
            ids = [(i % 1000) + 10 for i in range(end)]
            done = end >= request.max_tokens
            completions = [CompletionOutput(index=i, text=WORD * end, token_ids=ids, cumulative_logprob=None,
                                            logprobs=None, finish_reason="length" if done else None,
                                            delta_text=WORD * (end - start), delta_token_ids=ids[start:])
                           for i in range(request.n)]
            outputs.append(RequestOutput(request.request_id, None, request.prompt_token_ids, completions, done))
            self._generated += end - start
            if done:
                self._prompt_tokens += len(request.prompt_token_ids)
                finished.append(request.request_id)
        for request_id in finished:
            del self._waiting[request_id]
        return outputs

    def get_stats(self) -> EngineStats:
        return EngineStats(num_running=len(self._waiting), num_waiting=0, num_swapped=0, num_gpu_blocks=1 << 20,
                           num_free_gpu_blocks=1 << 20, num_cpu_blocks=0, num_free_cpu_blocks=0, swap_pool_bytes=0,
                           prefix_cache_hit_rate=0.0, num_preemptions=0, num_swapped_out_blocks=0,
                           num_swapped_in_blocks=0, swap_out_bytes=0, swap_in_bytes=0,
                           num_prompt_tokens=self._prompt_tokens, num_generation_tokens=self._generated)

    def resize_swap_pool(self, num_bytes: int) -> int:
        return 0

    def shutdown(self) -> None:
        self._waiting.clear()
