"""``LLMEngine``: add requests, step, read incremental outputs. The worker drives this API."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from engine.block_manager import BlockManager
from engine.config import EngineArgs
from engine.executor import make_executor
from engine.model_info import resolve_model_info
from engine.observer import StepObserver, StepObservers
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.sequence import Request, Sequence, SequenceStatus
from engine.sampler import uses_penalties
from engine.stopping import StopChecker
from engine.swap import preemption_cost_model, swap_chunk_blocks, swap_pool_blocks
from engine.tokenizer import Detokenizer, apply_chat_template, eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    num_gpu_blocks: int
    num_free_gpu_blocks: int
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    swap_pool_bytes: int  # swap pool capacity, all ranks together
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_swapped_out_blocks: int
    num_swapped_in_blocks: int
    swap_out_bytes: int
    swap_in_bytes: int
    num_prompt_tokens: int  # cumulative: prompt tokens computed
    num_generation_tokens: int  # cumulative: tokens sampled
    swap_pool_resident_bytes: int = 0  # host memory the swap pool holds now (chunks touched), all ranks
    num_swap_outs: int = 0  # cumulative: sequences swapped out
    num_swap_ins: int = 0  # cumulative: sequences swapped back in
    num_recomputes: int = 0  # cumulative: sequences preempted by recompute (includes a full swap pool)


class LLMEngine:
    """A continuous-batching engine over a paged KV cache.

    ``step()`` is schedule -> execute -> postprocess; requests join and leave at every step.
    Not thread-safe: drive it from one thread.
    """

    def __init__(self, args: EngineArgs | None = None, **kwargs: Any) -> None:
        if args is None:
            args = EngineArgs.from_kwargs(**kwargs)
        elif kwargs:
            raise ValueError(f"pass either EngineArgs or keyword arguments, not both ({', '.join(kwargs)})")
        self.args = args
        self.info = resolve_model_info(args)
        self.max_model_len = self.info.max_model_len
        self.tokenizer = load_tokenizer(args.tokenizer or self.info.path) if (args.tokenizer or self.info.path) else None
        self.vocab_size = self.info.hf_config.vocab_size
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.info.hf_config, self.info.path)
        self.executor = make_executor(self.info, args.num_gpu_blocks_override)
        self.block_manager = BlockManager(
            args.block_size, self.executor.num_gpu_blocks, self.executor.num_cpu_blocks,
            enable_prefix_caching=args.enable_prefix_caching, cpu_chunk_blocks=swap_chunk_blocks(self.info),
        )
        self.scheduler = Scheduler(
            SchedulerConfig(args.max_num_seqs, self.info.max_num_batched_tokens, self.max_model_len,
                            args.preemption_mode),
            self.block_manager, preemption_cost_model(self.info),
        )
        from engine.sampler import Sampler

        self.sampler = Sampler(self.vocab_size, self.eos_token_ids, seed=args.seed)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.stop_checker = StopChecker(self.eos_token_ids, self.max_model_len)
        self.requests: dict[str, Request] = {}
        # async scheduling: one step in flight whose tokens are not read back yet
        self._async = args.async_scheduling is not False
        self._inflight: _Launched | None = None
        self._num_history_requests = 0  # live requests whose sampling reads every earlier token
        self._arrivals = 0
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._step_observers = StepObservers(launch_runs_forward=self.info.device.type != "cuda")
        logger.info(
            "engine ready: model=%s dtype=%s kv_cache=%s device=%s tp=%d gpu_blocks=%d cpu_blocks=%d max_model_len=%d",
            args.model, self.info.dtype, self.info.kv_dtype, self.info.device, args.tensor_parallel_size,
            self.executor.num_gpu_blocks, self.executor.num_cpu_blocks, self.max_model_len,
        )

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    # ----- requests -------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | None,
        params: SamplingParams | None = None,
        priority: int = 0,
        prompt_token_ids: list[int] | None = None,
        final_only: bool = False,
    ) -> None:
        """Queue a request; raises ``ValueError`` naming the problem if it can never run.

        ``final_only``: ``step()`` reports the request once, when it finishes, instead of
        after every token (what offline batch callers want, and cheaper per step).
        """
        params = params or SamplingParams()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        text, token_ids = self._tokenize(prompt, prompt_token_ids)
        self._check_fits(len(token_ids), params)
        now = time.monotonic()
        seqs = [
            Sequence(request_id, i, list(token_ids), len(token_ids), params, priority, self._arrivals)
            for i in range(params.n)
        ]
        self._arrivals += 1
        request = Request(request_id, text, list(token_ids), params, seqs, RequestMetrics(now), priority,
                          final_only=final_only)
        self.requests[request_id] = request
        if uses_penalties(params):
            self._num_history_requests += 1
        for seq in seqs:
            self.detokenizer.start(seq)
            self.scheduler.add(seq)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop requests wherever they are; they are not reported by ``step()`` again."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            request = self._forget(rid)
            if request is None:
                continue
            for seq in request.seqs:
                if not seq.is_finished:
                    seq.finish_reason = "abort"
                    self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    def admission_capacity(self) -> int:
        """How many more requests to hand over now.

        NOTE: twice ``max_num_seqs`` in flight, so that a finished sequence's slot is
        refilled from the engine's own waiting queue at the next step instead of waiting
        on the caller's next read.
        """
        in_flight = sum(len(r.seqs) for r in self.requests.values())
        return max(0, 2 * self.args.max_num_seqs - in_flight)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return apply_chat_template(self.tokenizer, messages)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.info.bytes_per_token * self.info.tensor_parallel_size

    # ----- the step -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, turn sampled tokens into incremental outputs.

        With ``async_scheduling`` a step is launched before the previous step's tokens are
        read back (they feed its inputs on the device), and the previous step's outputs are
        made while it runs: each call returns the outputs of the step before. A step that
        needs every token on the host first (repetition, presence or frequency penalties)
        runs synchronously. Step observers (``add_step_observer``) get a record of each call.
        """
        started, generated = time.perf_counter(), self._num_generation_tokens
        previous = self._inflight  # launched by the call before (only async calls leave one in flight)
        if not self._async or self._num_history_requests:
            outputs = self._resolve(self._inflight)
            self._inflight = None
            scheduled = self.scheduler.schedule()
            launched = self._launch(scheduled, None)
            outputs += self._resolve(launched)
        else:
            scheduled = self.scheduler.schedule()
            fed = previous.sample.token_ids if previous is not None and previous.sample is not None else None
            launched = self._inflight = self._launch(scheduled, fed)
            outputs = self._resolve(previous)
        resolved_launched = launched is not None and launched is not self._inflight  # this call read it back
        self._step_observers.step_done(started, scheduled, self._num_generation_tokens - generated,
                                       previous is not None, resolved_launched)
        return outputs

    def add_step_observer(self, observer: StepObserver) -> None:
        """Call ``observer(record)`` with an ``engine.observer.StepRecord`` at the end of every ``step()``."""
        self._step_observers.add(observer)

    def remove_step_observer(self, observer: StepObserver) -> None:
        """Stop calling ``observer``; nothing happens if it is not observing."""
        self._step_observers.remove(observer)

    def _launch(self, scheduled: SchedulerOutput, fed_tokens) -> "_Launched | None":
        """Run the step and choose its tokens on the device; advance what does not depend on them."""
        if not (scheduled.scheduled or scheduled.blocks_to_swap_out or scheduled.blocks_to_swap_in):
            return None
        logits = self.executor.execute(scheduled, fed_tokens)
        now = time.monotonic()
        bs = self.block_manager.block_size
        sampling, filled = [], []
        for item in scheduled.scheduled:
            seq = item.seq
            samples = item.samples
            before = seq.num_computed_tokens
            if before < seq.num_prompt_tokens:
                self._num_prompt_tokens += min(item.num_new_tokens, seq.num_prompt_tokens - before)
                metrics = self.requests[seq.request_id].metrics
                if metrics.first_scheduled_time is None:
                    metrics.first_scheduled_time = now
            seq.num_computed_tokens = before + item.num_new_tokens
            if seq.num_computed_tokens // bs != before // bs:  # a block filled up: publish its hash
                filled.append(seq)
            if samples:
                sampling.append(seq)
        # NOTE: sampled before the new tokens count as pending: min_tokens and seeds read the length
        sample = self.sampler.sample(logits, sampling) if sampling else None
        for row, seq in enumerate(sampling):
            seq.num_pending += 1
            seq.pending_row = row
        return _Launched(sampling, sample, filled)

    def _resolve(self, launched: "_Launched | None") -> list[RequestOutput]:
        """Read a launched step's tokens back: append them, detokenize, check stops, make outputs."""
        if launched is None:
            return []
        now = time.monotonic()
        touched: dict[str, Request] = {}
        if launched.sampling:
            result = launched.sample.result()
            self.executor.check()
            token_ids, logprobs, top = result.token_ids, result.logprobs, result.top_logprobs
            for i, seq in enumerate(launched.sampling):
                seq.num_pending -= 1
                if seq.is_finished:  # aborted, or stopped by the step before (its token is dropped)
                    continue
                self._num_generation_tokens += 1
                seq.token_ids.append(token_ids[i])
                seq.cumulative_logprob += logprobs[i]
                if seq.params.logprobs is not None:
                    seq.logprobs.append(top[i])
                delta = self.detokenizer.step(seq)
                if delta:
                    seq.text += delta
                request = self.requests[seq.request_id]
                if request.metrics.first_token_time is None:
                    request.metrics.first_token_time = now
                if self.stop_checker.check(seq, len(delta)):
                    self.scheduler.finish(seq)
                elif request.final_only:
                    continue
                touched[seq.request_id] = request
        for seq in launched.filled:
            if seq.status is SequenceStatus.RUNNING:  # not preempted or finished since
                self.block_manager.commit(seq)
        outputs = []
        for rid, request in touched.items():
            finished = request.finished
            if finished:
                request.metrics.finished_time = now
                self._forget(rid)
            elif request.final_only:
                continue
            outputs.append(self._make_output(request, finished))
        return outputs

    def _forget(self, request_id: str) -> Request | None:
        request = self.requests.pop(request_id, None)
        if request is not None and uses_penalties(request.params):
            self._num_history_requests -= 1
        return request

    def _make_output(self, request: Request, finished: bool) -> RequestOutput:
        completions = []
        for seq in request.seqs:
            holdback = 0 if seq.is_finished else self.stop_checker.holdback(seq)
            visible = max(seq.emitted_text_len, len(seq.text) - holdback)
            out_ids = seq.output_token_ids
            completions.append(CompletionOutput(
                index=seq.index,
                text=seq.text,
                token_ids=list(out_ids),
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                delta_text=seq.text[seq.emitted_text_len:visible],
                delta_token_ids=list(out_ids[seq.emitted_token_len:]),
            ))
            seq.emitted_text_len = visible
            seq.emitted_token_len = len(out_ids)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions,
                             finished, max(request.seqs[0].num_cached_tokens, 0), request.metrics)

    # ----- helpers --------------------------------------------------------------------
    def _tokenize(self, prompt: str | list[int] | None, token_ids: list[int] | None) -> tuple[str | None, list[int]]:
        if isinstance(prompt, list) and token_ids is None:
            prompt, token_ids = None, prompt
        if (prompt is None) == (token_ids is None):
            raise ValueError("give exactly one of prompt (text) and prompt_token_ids")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass prompt_token_ids")
            token_ids = self.tokenizer(prompt)["input_ids"]
        if not token_ids:
            raise ValueError("prompt must not be empty")
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt_token_ids: {t!r} is not a token id in [0, {self.vocab_size})")
        return prompt, list(token_ids)

    def _check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise ValueError(
                f"prompt is {num_prompt_tokens} tokens long; the model's context (max_model_len) is {limit}"
            )
        if num_prompt_tokens + params.max_tokens > limit:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) = "
                f"{num_prompt_tokens + params.max_tokens} exceeds max_model_len {limit}"
            )
        blocks = -(-(num_prompt_tokens + params.max_tokens) // self.args.block_size)
        if blocks > self.block_manager.gpu.num_blocks:
            raise ValueError(
                f"prompt + max_tokens needs {blocks} KV blocks but the cache has only "
                f"{self.block_manager.gpu.num_blocks}; lower max_tokens or give the cache more memory"
            )

    # ----- swap pool -------------------------------------------------------------------
    def resize_swap_pool(self, num_bytes: int) -> int:
        """Grow or shrink the CPU swap pool toward ``num_bytes`` per GPU; returns the bytes it now has.

        Like ``swap_space``, per GPU. The pool moves in whole chunks (rounded down, capped by
        ``max_cpu_blocks_override``) and swapped-out sequences keep their blocks: growing
        appends chunks, whose host memory is taken on their first swap-out; shrinking drops
        chunks from the end while they are entirely free and releases their memory on every
        rank, so it may stop above ``num_bytes`` until those blocks come back in.
        """
        if isinstance(num_bytes, bool) or not isinstance(num_bytes, int) or num_bytes < 0:
            raise ValueError(f"num_bytes must be a non-negative integer, got {num_bytes!r}")
        pool = self.block_manager.cpu
        before = pool.num_blocks
        after = pool.resize(swap_pool_blocks(num_bytes, self.info))
        if after != before:
            self.executor.resize_swap_pool(after)
        return after * self.info.bytes_per_block

    # ----- stats and lifecycle --------------------------------------------------------
    def get_stats(self) -> EngineStats:
        s, bm = self.scheduler, self.block_manager
        per_block = self.info.bytes_per_block * self.info.tensor_parallel_size
        return EngineStats(
            num_running=len(s.running), num_waiting=len(s.waiting), num_swapped=len(s.swapped),
            num_gpu_blocks=bm.gpu.num_blocks, num_free_gpu_blocks=bm.gpu.num_free,
            num_cpu_blocks=bm.cpu.num_blocks, num_free_cpu_blocks=bm.cpu.num_free,
            swap_pool_bytes=bm.cpu.num_blocks * per_block,
            prefix_cache_hit_rate=bm.prefix_stats.hit_rate,
            num_preemptions=s.stats.num_preemptions,
            num_swapped_out_blocks=s.stats.num_swapped_out_blocks,
            num_swapped_in_blocks=s.stats.num_swapped_in_blocks,
            swap_out_bytes=s.stats.num_swapped_out_blocks * per_block,
            swap_in_bytes=s.stats.num_swapped_in_blocks * per_block,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens,
            swap_pool_resident_bytes=bm.cpu.num_used_chunks * bm.cpu.chunk_blocks * per_block,
            num_swap_outs=s.stats.num_swap_outs,
            num_swap_ins=s.stats.num_swap_ins,
            num_recomputes=s.stats.num_recomputes,
        )

    def shutdown(self) -> None:
        executor = getattr(self, "executor", None)
        if executor is not None:
            executor.shutdown()


@dataclass
class _Launched:
    """A step run on the device whose tokens are not read back yet."""

    sampling: list[Sequence]  # sampled sequences, in the order of the sampler's rows
    sample: Any  # engine.sampler.DeviceSample, or None when nothing was sampled
    filled: list[Sequence]  # sequences whose step filled a block (its hash is published once read back)

