"""A bench-only engine that answers every request at its next step, for measuring what is not
the engine (Redis, the worker's loop, the gateway). It satisfies ``worker.engine_host.EngineLike``;
nothing outside ``bench/`` imports it, so ``sluiceway worker`` can never run it."""

from __future__ import annotations

import time
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.stats import EngineStats

TOKEN = 7  # the one token id every completion is made of


class InstantEngine:
    """Each request ends at the step after it is added, with ``max_tokens`` copies of one token."""

    def __init__(self, max_num_seqs: int = 256, max_model_len: int = 4096) -> None:
        self.config = SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=max_num_seqs),
                                      cache=SimpleNamespace(block_size=16))
        self.max_model_len = max_model_len
        self.tokenizer = None  # prompts come as token ids or chats (apply_chat_template below)
        self.tokenizer_path = None
        self.kv_bytes_per_token = 0
        self._waiting: dict[str, tuple[list[int], int, float]] = {}
        self.generated = 0

    def add_request(self, request_id: str, prompt: Any, params: Any, priority: int = 0, final_only: bool = False,
                    resume_token_ids: list[int] | None = None) -> None:
        ids = list(prompt) if isinstance(prompt, list) else [TOKEN] * max(1, len(str(prompt)) // 4)
        self._waiting[request_id] = (ids, int(params.max_tokens or 1), time.monotonic())

    def output_token_ids(self, request_id: str) -> list[list[int]] | None:
        return [[]] if request_id in self._waiting else None

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            self._waiting.pop(rid, None)

    def num_unfinished_seqs(self) -> int:
        return len(self._waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return [TOKEN] * max(1, sum(len(m["content"]) for m in messages) // 4)

    def step(self) -> list[RequestOutput]:
        now = time.monotonic()
        outputs = []
        for rid, (prompt, n, arrived) in self._waiting.items():
            completion = CompletionOutput(0, "x" * n, [TOKEN] * n, None, None, finish_reason="length")
            metrics = RequestMetrics(arrived, first_scheduled_time=now, first_token_time=now, finished_time=now)
            outputs.append(RequestOutput(rid, None, prompt, [completion], True, metrics=metrics))
            self.generated += n
        self._waiting.clear()
        return outputs

    def get_stats(self) -> EngineStats:
        return EngineStats(num_running=len(self._waiting), num_waiting=0, num_swapped=0, num_gpu_blocks=1 << 20,
                           num_free_gpu_blocks=1 << 20, num_cpu_blocks=0, num_free_cpu_blocks=0, swap_pool_bytes=0,
                           prefix_cache_hit_rate=0.0, num_preemptions=0, num_swapped_out_blocks=0,
                           num_swapped_in_blocks=0, swap_out_bytes=0, swap_in_bytes=0, num_prompt_tokens=0,
                           num_generation_tokens=self.generated)

    def shutdown(self) -> None:
        self._waiting.clear()
