"""Structured outputs in the engine: grammars compiled once per distinct constraint off the
step thread, a matcher per sequence, and each step's token bitmask.

A constrained request waits here, outside the scheduler, until its grammar is compiled, so
the batch never waits on a compile; then its sequences get their matchers (which accept any
output the request already has, a resumed one) and join the scheduler. A matcher lives on
its ``Sequence``, not with its blocks, so it survives preemption by swap and by recompute.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch

from engine.core.sequence import Request, Sequence
from engine.structured.backend import GrammarBackend, bitmask_width
from engine.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)

_MAX_CACHED = 1024  # compiled grammars kept (least recently used dropped first)
_COMPILE_THREADS = 2
IDLE_GRAMMAR_WAIT_S = 0.05  # a step with nothing to run but grammars compiling waits this long for one


@dataclass
class _Waiting:
    request: Request
    future: Future
    deadline: float  # time.monotonic() past which the request fails


class StepBitmask:
    """One step's allowed tokens, filled on the host; ``apply`` masks the logits on their device."""

    def __init__(self, backend: GrammarBackend, host: torch.Tensor) -> None:
        self._backend = backend
        self.host = host  # (N, ceil(V/32)) int32, -1 in unconstrained rows

    def apply(self, logits: torch.Tensor) -> None:
        """Set the disallowed tokens' logits to -inf in place; ``logits``: (N, V) float32."""
        mask = self.host.to(logits.device, non_blocking=True)
        self._backend.apply_bitmask(logits, mask)


class StructuredOutputs:
    """The engine's structured-output state: the compile pool and cache, the waiting requests."""

    def __init__(self, backend: GrammarBackend, vocab_size: int, timeout_s: float, pin_memory: bool = False) -> None:
        self.backend = backend
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self._pin = pin_memory
        self._pool = ThreadPoolExecutor(max_workers=_COMPILE_THREADS, thread_name_prefix="sluiceway-grammar")
        self._compiled: OrderedDict[str, Future] = OrderedDict()
        self._waiting: dict[str, _Waiting] = {}

    @classmethod
    def for_model(cls, tokenizer: Any, vocab_size: int, eos_token_ids: set[int], timeout_s: float,
                  pin_memory: bool = False) -> "StructuredOutputs":
        """Over xgrammar and the model's tokenizer; ``ValueError`` if there is none or xgrammar is missing."""
        if tokenizer is None:
            raise ValueError("structured_outputs: this model has no tokenizer to build a grammar's vocabulary")
        try:
            from engine.structured.backend import XGrammarBackend

            backend = XGrammarBackend(tokenizer, vocab_size, sorted(eos_token_ids))
        except ImportError as exc:
            raise ValueError(f"structured_outputs: the grammar backend is not installed ({exc})") from None
        return cls(backend, vocab_size, timeout_s, pin_memory)

    # ----- compiling and waiting ---------------------------------------------------------
    def wait(self, request: Request, compiling: Future) -> None:
        """Hold ``request`` until ``compiling`` (``compile``'s) is done; ``take_ready`` hands it back."""
        self._waiting[request.request_id] = _Waiting(request, compiling, time.monotonic() + self.timeout_s)

    def compile(self, params: StructuredOutputsParams) -> Future:
        """Start (or reuse) the compile of a constraint; ``ValueError`` naming the field if it
        does not parse (parsing is quick and runs here; compiling runs on the pool)."""
        key = params.key
        future = self._compiled.get(key)
        if future is not None:
            self._compiled.move_to_end(key)
            return future
        grammar = self.backend.parse(params)  # quick, and it names a bad field at once
        future = self._pool.submit(self.backend.compile, grammar)
        self._compiled[key] = future
        while len(self._compiled) > _MAX_CACHED:
            oldest = next(iter(self._compiled))
            if not self._compiled[oldest].done():
                break  # NOTE: a compile still running stays; its waiters hold it
            del self._compiled[oldest]
        return future

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def discard(self, request_id: str) -> bool:
        """Forget a waiting request (aborted); whether it was waiting."""
        return self._waiting.pop(request_id, None) is not None

    def take_ready(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """The waiting requests whose grammar compiled (their sequences now have matchers), and
        those that failed with why: a compile error or the time limit."""
        now = time.monotonic()
        ready, failed = [], []
        for rid, item in list(self._waiting.items()):
            future, params = item.future, item.request.params.structured_outputs
            if not future.done():
                if now > item.deadline:
                    del self._waiting[rid]
                    failed.append((item.request, f"structured_outputs.{params.kind}: the grammar did not compile "
                                                 f"within {self.timeout_s:g} s (structured_outputs_timeout_s)"))
                continue
            del self._waiting[rid]
            error = future.exception()
            if error is not None:
                failed.append((item.request, f"structured_outputs.{params.kind}: the grammar did not compile: {error}"))
                continue
            why = self._start_matchers(item.request, future.result())
            if why is None:
                ready.append(item.request)
            else:
                failed.append((item.request, why))
        return ready, failed

    def admit(self, scheduler: Any, idle: bool) -> list[tuple[Request, str]]:
        """Add the sequences of requests whose grammar compiled to ``scheduler``; end (finish
        as aborted) those of requests whose grammar failed, and return those with why. ``idle``:
        the step has nothing else to run, so wait a little for a grammar first."""
        if idle:
            self.block_until_ready(IDLE_GRAMMAR_WAIT_S)
        ready, failed = self.take_ready()
        for request in ready:
            for seq in request.seqs:
                if not seq.is_finished:
                    scheduler.add(seq)
        now = time.monotonic()
        for request, _ in failed:
            for seq in request.seqs:
                if not seq.is_finished:
                    seq.finish_reason = "abort"
                    scheduler.finish(seq)
            request.metrics.finished_time = now
        return failed

    def block_until_ready(self, limit_s: float) -> None:
        """Wait up to ``limit_s`` (less if a deadline comes first) for one waiting grammar:
        for a step that has nothing else to run."""
        if not self._waiting:
            return
        nearest = min(w.deadline for w in self._waiting.values()) - time.monotonic()
        wait([w.future for w in self._waiting.values()], timeout=max(0.0, min(limit_s, nearest)),
             return_when=FIRST_COMPLETED)

    def _start_matchers(self, request: Request, compiled: Any) -> str | None:
        for seq in request.seqs:
            if seq.is_finished:
                continue
            seq.grammar = self.backend.matcher(compiled)
            for token in seq.output_token_ids:  # a resumed output replays through its matcher
                if not seq.grammar.accept_token(token):
                    return f"structured_outputs: the resumed output's token {token} breaks the constraint"
        return None

    # ----- each step ---------------------------------------------------------------------
    def bitmask(self, seqs: list[Sequence]) -> StepBitmask | None:
        """The allowed tokens of every constrained row of a step (None when no row is)."""
        # NOTE: a terminated matcher (its end-of-sequence accepted) has no next token: the backend
        # refuses to fill it. Its sequence has finished by then; were it not, the row allows every
        # token and ``accept`` ends the sequence.
        rows = [i for i, s in enumerate(seqs)
                if s.grammar is not None and not s.is_finished and not s.grammar.is_terminated()]
        if not rows:
            return None
        host = torch.empty((len(seqs), bitmask_width(self.vocab_size)), dtype=torch.int32, pin_memory=self._pin)
        if len(rows) < len(seqs):  # NOTE: only unconstrained rows are set here; the backend writes whole rows
            constrained = set(rows)
            host[[i for i in range(len(seqs)) if i not in constrained]] = -1
        self.backend.fill_bitmask([seqs[i].grammar for i in rows], host, rows)
        return StepBitmask(self.backend, host)

    @staticmethod
    def accept(seq: Sequence, token_id: int) -> bool:
        """Advance the sequence's matcher by its new token; False if the token breaks the constraint."""
        return seq.grammar is None or seq.grammar.accept_token(token_id)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
