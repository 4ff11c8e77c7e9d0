"""``LLMEngine``: add requests, step, read incremental outputs. The worker drives this API."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from engine.config import EngineArgs
from engine.engine_requests import EngineRequests
from engine.stats import EngineStats
from engine.core.block_manager import BlockManager
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput
from engine.core.sequence import Request, Sequence
from engine.core.stopping import StopChecker
from engine.launched import LaunchedStep, account_step, makes_first_tokens, under_launch_lock
from engine.core.swap import preemption_cost_model, resize_swap_pool, swap_chunk_blocks
from engine.executor.executor import make_executor
from engine.express_lane import ExpressLane
from engine.models.resolve import create_engine_config
from engine.models.tokenizer import Detokenizer, apply_chat_template, eos_token_ids, load_tokenizer
from engine.prompts import PromptInputs
from engine.observer import StepObserver, StepObservers
from engine.outputs import RequestOutput
from engine.request_output import make_request_output
from engine.runner.prompt_logprobs import PromptLogprobs
from engine.runner.sampler import LogitStats, Sampler
from engine.scoring import SCORING_PARAMS, is_gate
from engine.structured.manager import StructuredOutputs

logger = logging.getLogger(__name__)


class LLMEngine(EngineRequests):
    """A continuous-batching engine over a paged KV cache.

    ``step()`` is schedule -> execute -> postprocess; requests join and leave at every step.
    Not thread-safe: drive it from one thread.
    """

    def __init__(self, args: EngineArgs | None = None, **kwargs: Any) -> None:
        if args is None:
            args = EngineArgs.from_kwargs(**kwargs)
        elif kwargs:
            raise ValueError(f"pass either EngineArgs or keyword arguments, not both ({', '.join(kwargs)})")
        self.config = config = create_engine_config(args)
        model, cache = config.model, config.cache
        self.max_model_len = model.max_model_len
        self.tokenizer_path = model.tokenizer or model.path  # a second thread loads its own from here
        self.tokenizer = load_tokenizer(self.tokenizer_path) if self.tokenizer_path else None
        self.vocab_size = config.shape.vocab_size
        self.eos_token_ids = eos_token_ids(self.tokenizer, model.hf_config, model.path)
        self.executor = make_executor(config)
        self.block_manager = BlockManager(
            cache.block_size, self.executor.num_gpu_blocks, self.executor.num_cpu_blocks,
            enable_prefix_caching=cache.enable_prefix_caching, cpu_chunk_blocks=swap_chunk_blocks(config),
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager, preemption_cost_model(config))
        self.sampler = Sampler(self.vocab_size, self.eos_token_ids, seed=model.seed, tokenizer=self.tokenizer)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.stop_checker = StopChecker(self.eos_token_ids, self.max_model_len)
        self.inputs = PromptInputs(self.tokenizer, self.vocab_size, self.max_model_len, self.block_manager)
        self.requests: dict[str, Request] = {}
        self.structured: StructuredOutputs | None = None  # made by the first constrained request
        self._structured_timeout_s = args.structured_outputs_timeout_s
        self._num_seqs = 0  # sequences of the requests in self.requests
        self._inflight: LaunchedStep | None = None  # async scheduling: the step whose tokens are not read back
        self._num_history_requests = 0  # live requests whose sampling reads every earlier token
        self._arrivals = 0
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._resumed_finished: list[str] = []  # requests whose resumed tokens ended them: reported next step
        self._step_observers = StepObservers(launch_runs_forward=model.device.type != "cuda")
        self._express = config.scheduler.express_lane_tokens > 0  # the express lane (docs/SWAP.md)
        # held while a step is scheduled and launched (``under_launch_lock``); reentrant: a long
        # launch runs the express lane's launches inside it
        self.launch_lock = threading.RLock()
        self.lane = ExpressLane(lambda: self.scheduler.schedule_express(), self.executor, self.block_manager,
                                functools.partial(self._execute, previous=None, express=True), self._postprocess)
        if self._express:
            self.block_manager.track_frees()
        logger.info(
            "engine ready: model=%s dtype=%s kv_cache=%s device=%s tp=%d gpu_blocks=%d cpu_blocks=%d max_model_len=%d",
            args.model, model.dtype, config.kv_dtype, model.device, config.parallel.tensor_parallel_size,
            self.executor.num_gpu_blocks, self.executor.num_cpu_blocks, self.max_model_len,
        )

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    # ----- requests: engine/engine_requests.py -------------------------------------

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        return apply_chat_template(self.tokenizer, messages, tools=tools)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token takes over all ranks."""
        return self.config.shape.total_kv_bytes_per_token(self.config.kv_dtype.itemsize)

    # ----- the step -------------------------------------------------------------------
    def step(self, before_schedule: Callable[[], object] | None = None) -> list[RequestOutput]:
        """Schedule, run the model, turn sampled tokens into incremental outputs.

        With ``async_scheduling`` a step is launched before the previous step's tokens are
        read back (they feed its inputs on the device), and the previous step's outputs are
        made while it runs: each call returns the outputs of the step before. A step that
        needs every token on the host first (repetition, presence or frequency penalties)
        runs synchronously. A step with structured-output rows is sampled at the start of the
        next call instead, once the step before has advanced their matchers; its forward still
        runs ahead. Step observers (``add_step_observer``) get a record of each call.

        ``before_schedule`` (late admission): called just before this call schedules, after the
        step in flight has finished on the device, so that requests it adds (a server's jobs that
        arrived meanwhile) join the step launched now rather than the one after it. The device
        then idles while this step is scheduled and launched. A finished step that made first
        tokens is then read back before the launch rather than after it. With the express lane
        (``express_lane_tokens``) the wait runs arriving prompts that outrank running work beside
        the step in flight; when their first tokens are ready before that step ends, the call
        returns just their outputs, and the next call waits on for that step.
        """
        started, generated = time.perf_counter(), self._num_generation_tokens
        resumed_done = self._report_resumed_finished() + self._admit_compiled()
        lane: tuple[str, ...] = ()  # requests run in the express lane by this call
        previous = self._inflight  # launched by the call before (only async calls leave one in flight)
        if previous is not None and previous.logits is not None:
            self._sample(previous)  # deferred by the call before: the matchers have every token before it now
        sync = not self.config.scheduler.async_scheduling or self._num_history_requests
        # NOTE: the lane's scheduler rules, not only the engine built for it (a bench turns it off between runs)
        late_lane = self._express and self.scheduler.express.tokens > 0 and before_schedule is not None and not sync
        lane_outputs = self.lane.finish() if not (late_lane and previous is not None) else []
        if sync:
            outputs = lane_outputs + self._postprocess(previous)
            self._inflight = None
            if before_schedule is not None:
                before_schedule()
            scheduled = self._schedule()
            launched = self._execute(scheduled, None)
            outputs += self._postprocess(launched)
        else:
            outputs, feeding = lane_outputs, previous
            if before_schedule is not None:
                if late_lane and previous is not None:
                    express, outputs, in_flight = self.lane.beside(previous, before_schedule)
                    lane = (express.first_scheduled if express is not None else ()) + self.lane.delivered()
                    if in_flight:  # NOTE: its first tokens go out now; the next call waits on ``previous`` again
                        self._step_observers.step_done(started, express.scheduled,
                                                       self._num_generation_tokens - generated, False, True,
                                                       lane, express.forward, lane)
                        return resumed_done + outputs
                if previous is not None and previous.sample is not None:
                    previous.sample.wait()
                if previous is not None and makes_first_tokens(previous):
                    # NOTE: the device is done with it: its first tokens are read back now, not
                    # after the next step's launch (several ms of host time for a mixed step)
                    outputs, feeding = outputs + self._postprocess(previous), None
                    self._inflight = None
                before_schedule()
            scheduled = self._schedule()
            between = functools.partial(self.lane.between, before_schedule) if late_lane else None
            launched = self._inflight = self._execute(scheduled, feeding, defer=True, between=between)
            outputs += self._postprocess(feeding)
        lane += self.lane.delivered()
        resolved_launched = launched is not None and launched is not self._inflight  # this call read it back
        first, forward = (launched.first_scheduled, launched.forward) if launched is not None else ((), None)
        self._step_observers.step_done(started, scheduled, self._num_generation_tokens - generated,
                                       previous is not None, resolved_launched, first, forward, lane)
        return resumed_done + outputs

    @under_launch_lock
    def _schedule(self) -> SchedulerOutput:
        self.block_manager.next_epoch()  # NOTE: blocks freed from here on may still be this step's
        return self.scheduler.schedule()

    def _admit_compiled(self) -> list[RequestOutput]:
        """Constrained requests whose grammar compiled join the scheduler; those whose grammar
        failed end (``RequestOutput.error`` says why)."""
        if self.structured is None or not self.structured.num_waiting:
            return []
        idle = self._inflight is None and not self.scheduler.has_unfinished()
        outputs = []
        for request, why in self.structured.admit(self.scheduler, idle):
            self._forget(request.request_id)
            output = make_request_output(request, True)
            output.error = why
            outputs.append(output)
        return outputs

    def _report_resumed_finished(self) -> list[RequestOutput]:
        """Outputs of the requests ``add_request`` found already ended by their resumed tokens."""
        done, self._resumed_finished = [self.requests.get(rid) for rid in self._resumed_finished], []
        for request in (r for r in done if r is not None):
            request.metrics.finished_time = time.monotonic()
            self._forget(request.request_id)
        return [make_request_output(r, True) for r in done if r is not None]

    def output_token_ids(self, request_id: str) -> list[list[int]] | None:
        """Each completion's output read back so far, to checkpoint for ``resume_token_ids`` (None: unknown)."""
        request = self.requests.get(request_id)
        scoring = request is None or request.params is SCORING_PARAMS  # a scoring request keeps nothing
        return None if scoring else [list(seq.output_token_ids) for seq in request.seqs]

    def on_lane_outputs(self, deliver: Callable[[list[RequestOutput]], object] | None) -> None:
        """With the express lane: a lane step launched while a long step is being launched hands
        its outputs to ``deliver`` (on the calling thread, inside ``step``) as soon as its first
        tokens are ready, instead of ``step`` returning them after the launch. None: ``step``
        returns every output."""
        self.lane.deliver = deliver

    def add_step_observer(self, observer: StepObserver) -> None:
        """Call ``observer(record)`` with an ``engine.observer.StepRecord`` at the end of every ``step()``."""
        self._step_observers.add(observer)

    def remove_step_observer(self, observer: StepObserver) -> None:
        """Stop calling ``observer``; nothing happens if it is not observing."""
        self._step_observers.remove(observer)

    @under_launch_lock
    def _execute(self, scheduled: SchedulerOutput, previous: LaunchedStep | None, defer: bool = False,
                 express: bool = False, between: Callable[[], object] | None = None) -> LaunchedStep | None:
        """Run the step and choose its tokens on the device, fed the previous step's where they are pending.

        ``defer`` (async scheduling): a step with constrained rows keeps its logits and is
        sampled at the start of the next call, once the previous step's tokens have advanced
        the matchers; its bitmask is then filled on the host while its forward runs.
        """
        if scheduled.is_empty:
            return None
        fed = previous.sample.token_ids if previous is not None and previous.sample is not None else None
        scheduled_at = time.monotonic()
        if express:
            logits = self.executor.execute_express(scheduled)
        else:
            logits = self.executor.execute(scheduled, fed, between)  # (sampled rows + prompt-logprob rows, V)
        stats = self.executor.logit_stats  # a decode graph's, with its logits
        self.scheduler.update_from_output(scheduled)
        sampling, num_prompt, first = account_step(scheduled, self.requests, scheduled_at)
        self._num_prompt_tokens += num_prompt
        n = len(sampling)
        prompt = PromptLogprobs.launch(scheduled, logits[n:]) if logits is not None and logits.shape[0] > n else None
        launched = LaunchedStep(scheduled, sampling, None, prompt, first_scheduled=first,
                                forward=self.executor.forward_path,
                                # NOTE: an express step ends before the step in flight beside it: its end settles nothing
                                epoch=0 if express else self.block_manager.gpu.epoch)
        if sampling and defer and any(seq.grammar is not None for seq in sampling):
            launched.logits, launched.logit_stats = logits[:n], stats
        elif sampling:
            self._sample(launched, logits[:n], stats)
        if self._express:
            launched.marker = self.executor.marker()
        return launched

    def _sample(self, launched: LaunchedStep, logits: Any = None, stats: LogitStats | None = None) -> None:
        """Choose a launched step's tokens on the device (the deferred logits unless given)."""
        if logits is None:
            logits, stats = launched.logits, launched.logit_stats
        launched.logits = launched.logit_stats = None
        sampling = launched.sampling
        bitmask = self.structured.bitmask(sampling) if self.structured is not None else None
        # NOTE: sampled before the new tokens count as pending: min_tokens and seeds read the length
        launched.sample = self.sampler.sample(logits, sampling, bitmask, stats)
        for row, seq in enumerate(sampling):
            seq.num_pending += 1
            seq.pending_row = row

    def _postprocess(self, launched: LaunchedStep | None) -> list[RequestOutput]:
        """Read a launched step's tokens back: append them, detokenize, check stops, make outputs."""
        if launched is None:
            return []
        touched: dict[str, Request] = {}
        gates: list[Sequence] = []  # scoring requests' shared prompts, computed by this step
        if launched.prompt is not None:
            launched.prompt.collect(self.detokenizer)
        if launched.sampling:
            result = launched.sample.result()
            self.executor.check()
            self.block_manager.settle(launched.epoch)  # NOTE: it has ended, and every step before it
        # NOTE: after the read-back's wait for the device: a graph-replayed step launches in
        # microseconds, so a time taken before it put first tokens ahead of their GPU work
        now = time.monotonic()
        if launched.sampling:
            token_ids, logprobs, top = result.token_ids, result.logprobs, result.top_logprobs
            for i, seq in enumerate(launched.sampling):
                seq.num_pending -= 1
                if seq.is_finished:  # aborted, or stopped by the step before (its token is dropped)
                    continue
                if is_gate(seq):
                    gates.append(seq)
                    continue
                self._num_generation_tokens += 1
                seq.token_ids.append(token_ids[i])
                request = self.requests[seq.request_id]
                if not StructuredOutputs.accept(seq, token_ids[i]):  # the constraint left no token (allowed_token_ids...)
                    self._dead_end(request, seq.num_output_tokens - 1)
                    touched[seq.request_id] = request
                    continue
                seq.cumulative_logprob += logprobs[i]
                if seq.params.logprobs is not None:
                    seq.logprobs.append(self.detokenizer.name_tokens(top[i]))
                delta = self.detokenizer.step(seq)
                if delta:
                    seq.text += delta
                if request.metrics.first_token_time is None:
                    request.metrics.first_token_time = now
                if self.stop_checker.check(seq, len(delta)):
                    self.scheduler.finish_stopped(seq)
                elif request.final_only:
                    continue
                touched[seq.request_id] = request
        self.scheduler.commit_filled_blocks(launched.scheduled)
        for gate in gates:
            self._open_gate(gate)
        outputs = []
        for rid, request in touched.items():
            finished = request.finished
            if finished:
                request.metrics.finished_time = now
                self._forget(rid)
            elif request.final_only:
                continue
            outputs.append(make_request_output(request, finished))
        return outputs

    def _dead_end(self, request: Request, position: int) -> None:
        """End a request whose constraint and sampling filters left no token to take: it fails
        (``error``) rather than end as if complete, every sequence with it (NOTE: its answer
        would be cut short, and a constrained answer that ends early does not parse)."""
        request.error = (f"sampling.structured_outputs: at output token {position} the constraint allows no token"
                         " that allowed_token_ids or bad_words leave (they exclude every token it"
                         " accepts there)")
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)

    def _open_gate(self, gate: Sequence) -> None:
        """A scoring request's prompt is computed and published: retire it, admit the continuations."""
        self.scheduler.finish(gate)
        request = self.requests.get(gate.request_id)
        if request is not None and request.gate is gate:
            request.gate = None
            for seq in request.seqs:
                if not seq.is_finished:
                    self.scheduler.add(seq)

    # ----- swap pool -------------------------------------------------------------------
    def resize_swap_pool(self, num_bytes: int) -> int:
        """Grow or shrink the CPU swap pool toward ``num_bytes`` per GPU (like ``swap_space``);
        returns the bytes it now has (``engine.core.swap.resize_swap_pool``)."""
        return resize_swap_pool(self.block_manager.cpu, self.executor, self.config, num_bytes)

    # ----- stats and lifecycle --------------------------------------------------------
    def get_stats(self) -> EngineStats:
        per_block = self.config.kv_bytes_per_block * self.config.parallel.tensor_parallel_size
        return EngineStats.collect(self.scheduler, self.block_manager, per_block, self._num_prompt_tokens,
                                   self._num_generation_tokens)

    def shutdown(self) -> None:
        if getattr(self, "structured", None) is not None:
            self.structured.shutdown()
        executor = getattr(self, "executor", None)
        if executor is not None:
            executor.shutdown()
