"""Requests and their sequences: plain Python state shared by the scheduler and the engine."""

from __future__ import annotations

import enum
import itertools
from typing import Any
from dataclasses import dataclass, field

from engine.outputs import RequestMetrics
from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # nothing (or nothing any more) in the GPU cache
    RUNNING = "running"  # holds GPU blocks, in the running batch
    SWAPPED = "swapped"  # its blocks sit in the CPU swap pool
    FINISHED = "finished"


_seq_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One completion being generated: tokens, their cache blocks and how far compute got.

    ``num_computed_tokens`` catches up with ``len(token_ids)``: prefill, chunked prefill,
    prefix-cache hits and recompute after preemption are all the same motion.
    """

    request_id: str
    index: int  # which of the request's n completions
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    priority: int = 0
    arrival_order: int = 0  # FCFS tie-break within a priority
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache at first admission
    block_table: list[int] = field(default_factory=list)  # GPU (or, when swapped, CPU) block ids
    block_hashes: list[bytes] = field(default_factory=list)  # chained hash of each full block
    # Output state, kept by the engine's postprocessing.
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    # Prompt logprobs: the logprob of each prompt token from position ``prompt_logprobs_from``
    # on (None: none wanted), collected as the prompt is computed (one dict per token, its own first).
    prompt_logprobs_from: int | None = None
    prompt_logprobs: list[dict[int, Any]] = field(default_factory=list)
    prompt_greedy: list[bool] = field(default_factory=list)  # per such token: greedy decoding picks it
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: str = ""  # detokenized output text (stop strings cut off)
    emitted_text_len: int = 0  # how much of ``text`` has been handed out as deltas
    emitted_token_len: int = 0
    detok_prefix_offset: int = 0
    detok_read_offset: int = 0
    detok_stream: Any = None  # the detokenizer's per-sequence native decoder, when it uses one
    # Async scheduling: a launched step sampled a token for this sequence whose value is
    # still on the device (at most one at a time); ``pending_row`` is its row in that step's
    # sampled tokens, from which the next step's input is fed on the device.
    num_pending: int = 0
    pending_row: int = -1
    # Rank preemption (engine/core/ranking.py), kept by the scheduler.
    num_preemptions: int = 0  # times it lost its seat
    passed_over: int = 0  # steps higher-rank work took a seat while this one waited since it last got one
    safe_until_step: int = 0  # it is not preempted for rank before this scheduler step
    # Structured outputs: the backend's matcher of the constraint, advanced by each token read
    # back; it lives here, not with the blocks, so it survives swap and recompute.
    grammar: Any = None

    @property
    def num_tokens(self) -> int:
        """Tokens the sequence has, a pending (sampled, not yet read back) one included."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_cacheable_tokens(self) -> int:
        """Leading tokens a prefix-cache hit may cover: one token is always left to compute, and
        so is every prompt position whose logits give a prompt logprob not collected yet."""
        limit = self.num_tokens - 1
        if self.prompt_logprobs_from is not None:
            missing = self.prompt_logprobs_from + len(self.prompt_logprobs)  # first token still wanted
            if missing < self.num_prompt_tokens:
                limit = min(limit, missing - 1)  # the logits at ``missing - 1`` predict it
        return limit

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, int, int]:
        """Higher priority first, then first come first served."""
        return (-self.priority, self.arrival_order, self.index)


@dataclass(eq=False)
class Request:
    """A prompt and its ``n`` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    priority: int = 0
    final_only: bool = False  # report only when finished (see LLMEngine.add_request)
    # A scoring request's shared prompt, computed before its continuations are admitted so that
    # they find it in the prefix cache (engine/scoring.py); not one of ``seqs``.
    gate: Sequence | None = None
    # why the engine gave the request up (its sequences end "abort"): ``RequestOutput.error``
    error: str | None = None

    @property
    def finished(self) -> bool:
        if len(self.seqs) == 1:
            return self.seqs[0].is_finished
        return all(s.is_finished for s in self.seqs)
