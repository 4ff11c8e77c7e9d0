"""The engine host: the engine, driven from the step-loop thread alone, with errors contained.

Prompts normally arrive as token ids (``worker/prepare.py`` tokenizes text and chats on its
own thread); a text prompt is tokenized here only when the worker has no tokenizer of its
own to do that with.

A job the engine refuses (prompt or prompt + max_tokens beyond the context, a token id
outside the vocabulary, a chat the template cannot render, ...) fails alone, with the
engine's message. When a
step raises, the jobs that joined since the last good step are the suspects: one suspect
is failed; several are taken out and re-admitted one per step until the step that breaks
names its job (they have produced no output yet, so nothing is published twice). A step
that breaks with no newcomer fails the jobs in the engine: they were the ones running.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from engine.errors import ContextLengthError
from producers.protocol import ErrorCode
from worker.admission import Work
from worker.logs import event
from worker.metrics import Metrics
from worker.prepare import job_context_error
from worker.ranks import Ranks

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.llm_engine import EngineStats
    from engine.outputs import RequestOutput
    from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

MAX_CONSECUTIVE_ERRORS = 10  # steps in a row that raise before the engine is taken for broken


class EngineBroken(RuntimeError):
    """The engine failed step after step; the worker stops and its jobs go to other workers."""


class EngineLike(Protocol):
    """What the worker uses of an engine (``engine.LLMEngine`` is one), and nothing more."""

    config: "EngineConfig"  # read: scheduler.max_num_seqs, cache.block_size
    max_model_len: int
    tokenizer: Any | None  # the step loop's own; None: prompts must come as token ids
    tokenizer_path: Any | None  # where the preparer loads a second instance from
    # held while the engine schedules and launches a step (``engine.launched.under_launch_lock``);
    # the worker's threads take it around long Python work. Optional: an engine without one is not waited on.
    launch_lock: Any

    @property
    def kv_bytes_per_token(self) -> int: ...

    def add_request(self, request_id: str, prompt: str | list[int], params: "SamplingParams",
                    priority: int = 0, final_only: bool = False, resume_token_ids: list[int] | None = None) -> Any: ...

    def add_scoring_request(self, request_id: str, prompt: str | list[int], continuations: list[str | list[int]],
                            priority: int = 0) -> Any: ...

    def output_token_ids(self, request_id: str) -> list[list[int]] | None: ...

    def abort_request(self, request_id: str | Iterable[str]) -> None: ...

    def num_unfinished_seqs(self) -> int: ...

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            tools: list[dict[str, Any]] | None = None) -> list[int]: ...

    def step(self, before_schedule: Callable[[], object] | None = None) -> "list[RequestOutput]": ...

    def get_stats(self) -> "EngineStats": ...

    def resize_swap_pool(self, num_bytes: int) -> int: ...

    def shutdown(self) -> None: ...


@dataclass(frozen=True)
class SwapGeometry:
    """What the swap-pool policy needs of the engine, per GPU (``worker/swap_sizing.py``)."""

    kv_bytes_per_token: int  # one token's KV on one GPU
    gpu_kv_tokens: int  # tokens the GPU KV cache holds
    max_model_len: int


class ModelUnavailable(ValueError):
    """The engine could not be built from the worker's model setting: its files cannot be found
    or fetched (``engine.errors.ModelNotFound``)."""


def build_engine(engine_kwargs: dict[str, Any]) -> EngineLike:
    """An ``LLMEngine`` from ``EngineArgs`` keyword arguments; ``ModelUnavailable`` naming the model
    when its files cannot be found or fetched."""
    from engine import EngineArgs, LLMEngine
    from engine.errors import ModelNotFound

    try:
        return LLMEngine(EngineArgs(**engine_kwargs))
    except ModelNotFound as exc:  # the loader's message says which and where
        raise ModelUnavailable(f"model: {exc}") from exc


class EngineHost:
    """Owns the engine and the jobs in it; every method runs on the step-loop thread."""

    def __init__(self, engine: EngineLike, metrics: Metrics, ranks: Ranks | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.ranks = ranks  # None: the job's priority alone ranks it in the engine
        self.works: dict[str, Work] = {}  # job id -> work, for every request in the engine
        self.probation: deque[Work] = deque()  # suspects of an engine error, re-admitted one per step
        # Suspects of an engine error: jobs admitted since the last good step, and those of the
        # step before it (with async scheduling a step reads back the previous step's tokens,
        # so a fault a job causes may surface one step after its own).
        self._suspects: list[str] = []
        self._settling: list[str] = []
        self._errors_in_a_row = 0
        self.num_admitted = 0
        self.max_num_seqs = engine.config.scheduler.max_num_seqs
        # NOTE: prompt tokens one step-loop turn admits (``Admission.take``), whole prompts counted,
        # prefix-cache hits included: sixteen steps' worth. At four, grading jobs (1,500 shared of
        # 1,716 tokens) came in 19 a turn and a step found 4,400 tokens to compute of its 8,192; at
        # about 0.1 us a token to check, a full turn stays under 15 ms of the step loop.
        self.admit_tokens_per_turn = 16 * engine.config.scheduler.max_num_batched_tokens
        # NOTE: jobs the intake reads and parses ahead of the step loop taking them: a quarter of
        # the seats (at least 64), two turns of grading prompts. Unbounded, a worker starting on a
        # backlog parsed 1,088 jobs at once, and the step loop's first launches waited on the
        # intake holding the GIL (0.24-0.41 s each, against 0.01-0.03 s for the engine alone).
        self.read_ahead = max(64, self.max_num_seqs // 4)
        # NOTE: seats the first queue may take beyond what the others may: with the engine full
        # of bulk work, an interactive job is still read at once and preempts its way in.
        self.top_queue_reserve = max(1, self.max_num_seqs // 8)
        self.launch_lock = getattr(engine, "launch_lock", None) or threading.RLock()

    # --- admission ------------------------------------------------------------------------------
    def capacity(self) -> int:
        """New jobs the engine can take now (none while suspects are re-admitted one by one).

        NOTE: up to twice ``max_num_seqs`` sequences in the engine, so that a finished
        sequence's slot is refilled from the engine's own waiting queue at the next step
        instead of waiting on the worker's next read of the queues; plus
        ``top_queue_reserve`` that only the first queue's jobs take (``RedisIntake``).
        """
        if self.probation:
            return 0
        return max(0, 2 * self.max_num_seqs + self.top_queue_reserve - self.engine.num_unfinished_seqs())

    def admit(self, work: Work) -> tuple[str, ErrorCode] | None:
        """Add ``work``'s request to the engine; return why it was refused (the job fails) and its code, or None."""
        job = work.job
        try:
            params = job.sampling_params
            prompt = self._prompt(work)
            if isinstance(prompt, list):  # NOTE: a job given as token ids was never prepared: the rule is checked here
                error = job_context_error(job, len(prompt), self.max_model_len, params)
                if error is not None:
                    return error, ErrorCode.CONTEXT_LENGTH_EXCEEDED
            # NOTE: a job that is not streamed is reported once, when it ends: cheaper per step.
            self._add(work, prompt, params)
        except ContextLengthError as exc:
            return str(exc), ErrorCode.CONTEXT_LENGTH_EXCEEDED
        except ValueError as exc:  # a token id outside the vocabulary, a chat the template refuses, ...
            return str(exc), ErrorCode.INVALID_JOB
        except Exception as exc:
            event(log, "engine.refused", logging.ERROR, exc_info=True, job=job.id)
            return f"the engine refused the job: {type(exc).__name__}: {exc}", ErrorCode.ENGINE_ERROR
        work.admitted_at = time.time()
        self.works[job.id] = work
        self._suspects.append(job.id)
        self.num_admitted += 1
        self.metrics.admitted.inc()
        return None

    def _add(self, work: Work, prompt: str | list[int], params: "SamplingParams") -> None:
        job, resume = work.job, work.resume_token_ids
        priority = self.ranks.engine_priority(work) if self.ranks is not None else job.priority
        if job.score is not None:  # NOTE: nothing is generated, so there is nothing to resume from
            self.engine.add_scoring_request(job.id, prompt, list(job.score.continuations), priority=priority)
            return
        if resume:
            try:
                self.engine.add_request(job.id, prompt, params, priority=priority, final_only=not job.stream,
                                        resume_token_ids=resume)
                event(log, "job.resumed", job=job.id, attempt=work.attempt, tokens=len(resume))
                return
            except ValueError as exc:  # NOTE: a resume point the engine refuses: run from the start
                event(log, "job.resume_refused", logging.WARNING, job=job.id, error=str(exc))
                work.resume_token_ids = None
        self.engine.add_request(job.id, prompt, params, priority=priority, final_only=not job.stream)

    def running(self) -> list[Work]:
        """The works whose requests are in the engine now."""
        return list(self.works.values())

    def progress(self, work: Work) -> list[int] | None:
        """The output tokens ``work``'s request has generated so far (n = 1), or None."""
        read = getattr(self.engine, "output_token_ids", None)  # NOTE: an engine without it: no checkpoints
        if read is None or self.works.get(work.id) is not work:
            return None
        ids = read(work.id)
        return ids[0] if ids is not None and len(ids) == 1 else None

    def _prompt(self, work: Work) -> str | list[int]:
        job = work.job
        if work.prompt_token_ids is not None:  # tokenized off the step loop (worker/prepare.py)
            return work.prompt_token_ids
        if job.prompt is not None:
            return job.prompt
        if job.prompt_token_ids is not None:
            return list(job.prompt_token_ids)
        return list(self.engine.apply_chat_template(job.template_messages(), tools=job.template_tools()))

    def abort(self, job_ids: list[str]) -> list[Work]:
        """Abort the requests of ``job_ids`` that are in the engine; return their works."""
        works = [self.works.pop(j) for j in job_ids if j in self.works]
        works += [w for w in self.probation if w.id in job_ids]
        self.probation = deque(w for w in self.probation if w.id not in job_ids)
        in_engine = [w.id for w in works if w.admitted_at is not None]
        if in_engine:
            try:
                self.engine.abort_request(in_engine)
            except Exception:
                event(log, "engine.abort_failed", logging.ERROR, exc_info=True, jobs=len(in_engine))
        return works

    def abort_all(self) -> list[Work]:
        """Abort every job in the engine or on probation; return their works."""
        return self.abort(list(self.works) + [w.id for w in self.probation])

    def holds(self, work: Work) -> bool:
        """Whether this very run of a job (not another delivery of it) is in the engine or on probation."""
        return self.works.get(work.id) is work or any(w is work for w in self.probation)

    def work_of(self, job_id: str) -> Work | None:
        return self.works.get(job_id)

    def __len__(self) -> int:
        return len(self.works)

    # --- what the rest of the worker reads ----------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    @property
    def has_tokenizer(self) -> bool:
        return getattr(self.engine, "tokenizer", None) is not None

    @property
    def tokenizer(self) -> Any | None:
        """The engine's own tokenizer, for the step-loop thread alone (None: prompts come as token ids)."""
        return getattr(self.engine, "tokenizer", None)

    @property
    def tokenizer_path(self) -> Any | None:
        """Where a second instance of the engine's tokenizer loads from (None: nowhere known)."""
        return getattr(self.engine, "tokenizer_path", None)

    def stats(self) -> "EngineStats":
        return self.engine.get_stats()

    def swap_geometry(self, tensor_parallel_size: int) -> SwapGeometry | None:
        """The swap policy's view of the engine, or None if its pool cannot be resized."""
        if not hasattr(self.engine, "resize_swap_pool"):
            return None
        # NOTE: sizes are per GPU, as --swap-space is; each GPU's pool holds its shard of the KV.
        per_gpu = max(1, int(self.engine.kv_bytes_per_token) // tensor_parallel_size)
        gpu_tokens = self.stats().num_gpu_blocks * self.engine.config.cache.block_size
        return SwapGeometry(per_gpu, gpu_tokens, self.max_model_len)

    def resize_swap_pool(self, num_bytes: int) -> int:
        return self.engine.resize_swap_pool(num_bytes)

    # --- stepping ------------------------------------------------------------------------------
    def on_lane_outputs(self, deliver: Callable[[list], object] | None) -> None:
        """Where the express lane hands outputs ready in the middle of a step (``LLMEngine.on_lane_outputs``)."""
        hook = getattr(self.engine, "on_lane_outputs", None)
        if hook is not None:
            hook(deliver)

    def has_work(self) -> bool:
        return bool(self.works or self.probation)

    def step(self, before_schedule: Callable[[], object] | None = None) -> tuple[list, list[tuple[Work, str, ErrorCode]]]:
        """One engine step: (request outputs, [(work, error, code)] for jobs an engine error failed);
        ``before_schedule``: late admission (``LLMEngine.step``)."""
        refused = []
        if self.probation and not self._suspects and not self._settling:
            work = self.probation.popleft()
            why = self.admit(work)
            if why is not None:
                refused.append((work, *why))
        if not self.works:
            return [], refused
        try:
            outputs = self.engine.step(before_schedule) if before_schedule is not None else self.engine.step()
        except Exception as exc:
            return [], refused + self._contain(exc)
        self._settling, self._suspects = self._suspects, []
        self._errors_in_a_row = 0
        if any(getattr(o, "error", None) for o in outputs):
            outputs = self._refuse_errored(outputs, refused)
        return outputs, refused

    def _refuse_errored(self, outputs: list, refused: list[tuple[Work, str, ErrorCode]]) -> list:
        """Requests the engine gave up after admitting them (a structured-output grammar that did
        not compile in time) fail as invalid jobs; the other outputs go on."""
        kept = []
        for output in outputs:
            work = self.works.pop(output.request_id, None) if output.error else None
            if work is None:
                kept.append(output)
            else:
                refused.append((work, output.error, ErrorCode.INVALID_JOB))
        return kept

    def done(self, job_id: str) -> Work | None:
        """Forget a finished request; return its work."""
        return self.works.pop(job_id, None)

    def _contain(self, exc: Exception) -> list[tuple[Work, str, ErrorCode]]:
        self.metrics.engine_errors.inc()
        self._errors_in_a_row += 1
        suspects = [j for j in self._settling + self._suspects if j in self.works]
        self._suspects, self._settling = [], []
        event(log, "engine.step_failed", logging.ERROR, exc_info=exc, suspects=len(suspects),
              in_engine=len(self.works), in_a_row=self._errors_in_a_row)
        if self._errors_in_a_row >= MAX_CONSECUTIVE_ERRORS:
            raise EngineBroken(f"{self._errors_in_a_row} engine steps in a row raised; last: {exc!r}") from exc
        if len(suspects) > 1:
            for work in self.abort(suspects):
                work.admitted_at = None
                self.probation.append(work)
            return []
        error = f"engine error: {type(exc).__name__}: {exc}"
        return [(work, error, ErrorCode.ENGINE_ERROR) for work in self.abort(suspects or list(self.works))]

    def shutdown(self) -> None:
        try:
            self.engine.shutdown()
        except Exception:
            event(log, "engine.shutdown_failed", logging.WARNING, exc_info=True)
