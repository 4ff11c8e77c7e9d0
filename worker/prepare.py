"""The preparer: tokenizes prompts and renders chats on its own thread, never the step loop's.

Tokenizing a prompt of megabytes takes seconds; done inside ``engine.add_request`` on the
step loop, it stalled every running job's tokens that long. Here it happens between the
sources and the step loop: a job given as ``prompt`` or ``messages`` waits in admission
for this thread, which turns it into token ids with the engine's own tokenizer and chat
template (so the tokens, and the results, are the same) and checks them against the
context; a job that cannot run fails here with the engine's message, without the step
loop ever seeing it. The step loop then adds only token ids.
"""

from __future__ import annotations

import logging
from typing import Any

from engine.models.tokenizer import apply_chat_template, load_tokenizer
from engine.sampling_params import SamplingParams
from producers.protocol import ErrorCode, Job, Status
from worker.admission import Admission, Work
from worker.component import Component
from worker.logs import event

log = logging.getLogger(__name__)

WAIT_S = 0.25  # how long one tick waits for work, so a stop is noticed soon


def prompt_tokens(tokenizer: Any, job: Job) -> list[int]:
    """``job``'s prompt as token ids, exactly as ``LLMEngine.add_request`` would make them."""
    if job.prompt is not None:
        return list(tokenizer(job.prompt)["input_ids"])
    return list(apply_chat_template(tokenizer, job.template_messages(), tools=job.template_tools()))


def context_error(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> str | None:
    """Why a prompt of this many tokens can never run in the model's context, or None.

    NOTE: the protocol's rule (a job whose prompt + max_tokens passes the context fails
    ``context_length_exceeded``); ``LLMEngine`` itself, like vLLM, refuses only a prompt that
    fills the context (or the KV cache) and caps max_tokens at the context's end.
    """
    if num_prompt_tokens >= max_model_len:
        return f"prompt is {num_prompt_tokens} tokens long; the model's context (max_model_len) is {max_model_len}"
    if num_prompt_tokens + max_tokens > max_model_len:
        return (f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
                f"{num_prompt_tokens + max_tokens} exceeds max_model_len {max_model_len}")
    return None


def job_context_error(job: Job, num_prompt_tokens: int, max_model_len: int,
                      params: SamplingParams | None = None) -> str | None:
    """``context_error`` of ``job``, whose prompt is this many tokens: the prompt as the engine
    keeps it (``truncate_prompt_tokens``) with ``max_tokens`` (None: room for one token).

    NOTE: every job is held to this, whether the preparer tokenized it or it came as token ids
    (``EngineHost.admit``); a scoring job's continuations are checked by the engine.
    """
    if job.score is not None:
        return context_error(num_prompt_tokens, 1, max_model_len)
    params = params or job.sampling_params
    keep = params.prompt_keep(max_model_len)
    kept = num_prompt_tokens if keep is None else min(keep, num_prompt_tokens)
    return context_error(kept, params.max_tokens or 1, max_model_len)


def own_tokenizer(path: Any | None) -> Any | None:
    """A second instance of the engine's tokenizer (loaded from ``path``), for this thread alone, or None.

    NOTE: a second instance, not the engine's: an HF fast tokenizer must not be used from two
    threads at once, and the step loop's detokenizer uses the engine's all the time.
    """
    if path is None:
        event(log, "prepare.no_tokenizer", logging.WARNING, error="the engine names no tokenizer path",
              consequence="prompts are tokenized on the step loop")
        return None
    try:
        return load_tokenizer(path)
    except ValueError as exc:
        event(log, "prepare.no_tokenizer", logging.WARNING, error=str(exc),
              consequence="prompts are tokenized on the step loop")
        return None


class Preparer(Component):
    """Moves works from admission's to-prepare queue to its ready queue, tokenized; fails the rest."""

    name = "prepare"

    def __init__(self, max_model_len: int, admission: Admission, tokenizer: Any) -> None:
        super().__init__()
        self.max_model_len = max_model_len
        self.admission = admission  # made with prepare=True
        self.tokenizer = tokenizer  # this thread's own (``own_tokenizer``)
        self.num_failed = 0  # jobs this thread ended (the step loop never saw them)

    def tick(self) -> None:
        work = self.admission.next_to_prepare(WAIT_S)
        if work is None:
            if not self.admission.open:  # closed: nothing more comes until stopped
                self._stop.wait(WAIT_S)
            return
        try:
            error, code = self.prepare(work)
        except Exception as exc:  # a tokenizer or template fault fails the job, never the thread
            event(log, "prepare.failed", logging.ERROR, exc_info=True, job=work.id)
            error = f"the prompt could not be tokenized: {type(exc).__name__}: {exc}"
            code = ErrorCode.ENGINE_ERROR
        if error is not None:
            self.admission.prepared(work, ok=False)
            self.num_failed += 1
            work.sink.finish(work, Status.FAILED, error=error, code=code)
        elif not self.admission.prepared(work):
            work.sink.release(work)  # the worker began to stop while this job was tokenized

    def prepare(self, work: Work) -> tuple[str | None, ErrorCode | None]:
        """Tokenize ``work``'s prompt into ``work.prompt_token_ids``; return why it cannot run
        and its code, or ``(None, None)``."""
        try:
            ids = prompt_tokens(self.tokenizer, work.job)
        except ValueError as exc:  # a chat the template refuses, say
            return str(exc), ErrorCode.INVALID_JOB
        error = job_context_error(work.job, len(ids), self.max_model_len)
        if error is None:
            work.prompt_token_ids = ids
            return None, None
        return error, ErrorCode.CONTEXT_LENGTH_EXCEEDED
