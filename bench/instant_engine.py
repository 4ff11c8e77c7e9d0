"""A bench-only engine that produces every token at once: the worker and the gateway, timed alone.

``InstantEngine`` is an ``EngineLike`` (``worker/engine_host.py``) whose ``step()`` finishes
every request added since the previous step with ``max_tokens`` made-up tokens (``"x"``
each), so what a benchmark measures is the path around the engine: Redis, the worker, the
gateway. It lives in ``bench/`` because nothing else may reach it: ``sluiceway worker``
only ever builds ``LLMEngine``.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace

from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

TOKEN_TEXT = "x"


class InstantEngine:
    """Every request ends at the step after it was added, with all its tokens; or, with
    ``tokens_per_step``, gets that many tokens at each step (a stream of many entries)."""

    def __init__(self, max_num_seqs: int = 256, max_model_len: int = 4096, vocab_size: int = 32000,
                 tokens_per_step: int | None = None) -> None:
        self.config = SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=max_num_seqs),
                                      cache=SimpleNamespace(block_size=16))
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.tokenizer = None  # prompts come as token ids
        self.tokenizer_path = None
        self._waiting: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}
        self._generated = 0
        self.tokens_per_step = tokens_per_step

    @property
    def kv_bytes_per_token(self) -> int:
        return 1

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0,
                    final_only: bool = False, resume_token_ids: list[int] | None = None) -> None:
        if not isinstance(prompt, list):
            raise ValueError("the instant engine takes prompts as token ids only")
        self._waiting[request_id] = (prompt, params, list(resume_token_ids or []))

    def output_token_ids(self, request_id: str) -> list[list[int]] | None:
        return None

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            self._waiting.pop(rid, None)

    def num_unfinished_seqs(self) -> int:
        return len(self._waiting)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        raise ValueError("the instant engine has no chat template")

    def step(self) -> list[RequestOutput]:
        outputs, done = [], []
        for rid, (prompt, params, have) in self._waiting.items():
            total = params.max_tokens or 16
            end = total if self.tokens_per_step is None else min(total, len(have) + self.tokens_per_step)
            made = [(prompt[-1] + i) % self.vocab_size for i in range(len(have), end)]
            have.extend(made)
            self._generated += len(made)
            finished = len(have) >= total
            completions = [CompletionOutput(index=i, text=TOKEN_TEXT * len(have), token_ids=list(have),
                                            cumulative_logprob=None, logprobs=None,
                                            finish_reason="length" if finished else None,
                                            delta_text=TOKEN_TEXT * len(made), delta_token_ids=made)
                           for i in range(params.n)]
            outputs.append(RequestOutput(request_id=rid, prompt=None, prompt_token_ids=prompt, outputs=completions,
                                         finished=finished))
            if finished:
                done.append(rid)
        for rid in done:
            del self._waiting[rid]
        return outputs

    def get_stats(self) -> EngineStats:
        return EngineStats(num_running=len(self._waiting), num_waiting=0, num_swapped=0, num_gpu_blocks=1 << 20,
                           num_free_gpu_blocks=1 << 20, num_cpu_blocks=0, num_free_cpu_blocks=0, swap_pool_bytes=0,
                           prefix_cache_hit_rate=0.0, num_preemptions=0, num_swapped_out_blocks=0,
                           num_swapped_in_blocks=0, swap_out_bytes=0, swap_in_bytes=0, num_prompt_tokens=0,
                           num_generation_tokens=self._generated)

    def resize_swap_pool(self, num_bytes: int) -> int:
        return 0

    def shutdown(self) -> None:
        self._waiting.clear()

