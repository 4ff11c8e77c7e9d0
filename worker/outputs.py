"""Engine outputs -> protocol objects: the result of a finished job, a streamed job's deltas."""

from __future__ import annotations

import math
from typing import Any

from engine.models.tokenizer import TokenBytes
from engine.outputs import Logprob, RequestOutput
from producers.protocol import (
    Completion,
    ContinuationScore,
    JobResult,
    Timings,
    TokenDelta,
    TokenLogprob,
    TokenText,
    TopLogprobs,
    Usage,
)
from worker.admission import Work

_MINUS_INFINITY = -9999.0  # JSON has no infinity; the OpenAI API writes this for an impossible token


class PromptText:
    """The prompt as text and its first token (v1.4), for a job that asks for prompt logprobs:
    what an OpenAI ``echo`` answers besides the logprobs. Runs on the step-loop thread, with the
    engine's own tokenizer (``TokenBytes`` names a token as the engine names its logprob entries)."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.names = TokenBytes(tokenizer) if tokenizer is not None else None

    def fields(self, work: Work, output: RequestOutput) -> dict[str, Any]:
        """``prompt_text`` and ``prompt_first_token``; nothing for other jobs."""
        params = work.job.sampling_params
        ids = output.prompt_token_ids
        if params.prompt_logprobs is None or output.prompt_logprobs is None or not ids:
            return {}
        text, first = "", TokenText(token_id=ids[0], token="", bytes=[])
        if self.names is not None:
            token, raw = self.names.text_and_bytes(ids[0])
            first = TokenText(token_id=ids[0], token=token, bytes=list(raw))
        if isinstance(work.job.prompt, str) and params.truncate_prompt_tokens is None:
            text = work.job.prompt  # NOTE: as given, as vLLM echoes a text prompt
        elif self.tokenizer is not None:
            text = self.tokenizer.decode(ids)  # token ids, a chat, a truncated prompt: the tokens that ran
        return {"prompt_text": text, "prompt_first_token": first}


def prompt_logprobs(work: Work, output: RequestOutput) -> list[TopLogprobs | None] | None:
    """The output's prompt logprobs in the protocol's shape (None first), or None when not asked for."""
    if output.prompt_logprobs is None:
        return None
    k = work.job.sampling_params.prompt_logprobs or 0
    return [top_logprobs(step, k) if step is not None else None for step in output.prompt_logprobs]


def deltas(work: Work, output: RequestOutput, prompt: PromptText | None = None) -> list[TokenDelta]:
    """What each completion added since the last output; a completion's last delta carries its
    finish_reason, completion 0's first the prompt's fields (``PromptText``) when asked for."""
    found = []
    for completion in output.outputs:
        if completion.index in work.streamed_to_end:
            continue
        if completion.finish_reason is not None:
            work.streamed_to_end.add(completion.index)
        elif not completion.delta_text and not completion.delta_token_ids:
            continue
        new = len(completion.delta_token_ids)
        logprobs = None
        if completion.logprobs is not None and new <= len(completion.logprobs):
            k = work.job.sampling_params.logprobs or 0
            logprobs = [top_logprobs(step, k) for step in completion.logprobs[len(completion.logprobs) - new:]]
        offset = len(completion.token_ids) - new
        first = prompt.fields(work, output) if prompt is not None and completion.index == 0 and offset == 0 else {}
        if first:
            first["prompt_logprobs"] = prompt_logprobs(work, output)
        found.append(TokenDelta(index=completion.index, offset=offset, text=completion.delta_text,
                                token_ids=list(completion.delta_token_ids), finish_reason=completion.finish_reason,
                                logprobs=logprobs, **first))
    return found


def top_logprobs(step: dict[int, Logprob], k: int) -> TopLogprobs:
    """One token's engine logprobs (its own entry first, then the top ``k``) in the protocol's shape."""
    items = list(step.items())
    token, own = items[0]
    # NOTE: the step holds each token once: k entries when the chosen token is among the top k,
    # k + 1 when not. Its rank cannot tell where it ties with the k-th (tied tokens share a rank)
    top = sorted((_token(t, lp) for t, lp in (items if len(items) <= k else items[1:])), key=lambda e: e.rank)
    return TopLogprobs(**_token(token, own).model_dump(), top=top)


def _token(token: int, lp: Logprob) -> TokenLogprob:
    value = lp.logprob if math.isfinite(lp.logprob) else _MINUS_INFINITY
    return TokenLogprob(token_id=token, token=lp.decoded_token or "", bytes=list(lp.token_bytes or b""),
                        logprob=value, rank=lp.rank or 0)


# The fields a merge knows how to join; a delta carrying any other (set) field is written as it is.
_MERGEABLE = {"index", "offset", "text", "token_ids", "finish_reason"}


def merge_deltas(found: list[TokenDelta]) -> list[TokenDelta]:
    """Join each run of consecutive deltas of one completion into one (texts and token ids end to
    end), so a round writes one stream entry per completion instead of one per step.

    NOTE: a reader by offset cannot tell the difference; the entries only get fewer and larger."""
    merged: list[TokenDelta] = []
    for delta in found:
        last = merged[-1] if merged else None
        if (last is not None and last.index == delta.index and last.finish_reason is None
                and last.offset is not None and delta.offset == last.offset + len(last.token_ids)
                and _plain(last) and _plain(delta)):
            merged[-1] = last.model_copy(update={"text": last.text + delta.text,
                                                 "token_ids": [*last.token_ids, *delta.token_ids],
                                                 "finish_reason": delta.finish_reason})
        else:
            merged.append(delta)
    return merged


def _plain(delta: TokenDelta) -> bool:
    extra = delta.model_dump(exclude=_MERGEABLE)
    return all(value in (None, [], {}, "") for value in extra.values())


def job_result(work: Work, output: RequestOutput, now: float, prompt: PromptText | None = None) -> JobResult:
    """The ``result`` of a job whose request finished; ``prompt`` adds the prompt's text and first
    token to a job that asks for prompt logprobs (v1.4)."""
    params = work.job.sampling_params
    k = params.logprobs or 0
    completions = [
        Completion(
            text=c.text, token_ids=list(c.token_ids), finish_reason=c.finish_reason,
            # NOTE: a resumed run saw only its own tokens' logprobs: the sum over the whole
            # completion is unknown, so it is null rather than a partial sum
            cumulative_logprob=None if work.resume_token_ids else c.cumulative_logprob,
            # the documented shape: {token_id: logprob}, the float of each engine Logprob
            logprobs=[{str(t): lp.logprob for t, lp in step.items()} for step in c.logprobs]
            if c.logprobs is not None else None,
            top_logprobs=[top_logprobs(step, k) for step in c.logprobs] if c.logprobs is not None else None,
        )
        for c in sorted(output.outputs, key=lambda c: c.index)
    ]
    echo = prompt.fields(work, output) if prompt is not None else {}
    return JobResult(
        id=work.id,
        text=completions[0].text if completions else "",
        outputs=completions,
        usage=Usage(prompt_tokens=len(output.prompt_token_ids),
                    completion_tokens=sum(len(c.token_ids) for c in completions)),
        metadata=work.job.metadata,
        timings=timings(work, output, now),
        prompt_logprobs=prompt_logprobs(work, output),
        scores=[ContinuationScore(index=s.index, logprob=s.logprob, num_tokens=s.num_tokens, is_greedy=s.is_greedy,
                                  token_logprobs=list(s.token_logprobs), token_ids=list(s.token_ids))
                for s in output.scores]
        if output.scores is not None else None,
        **echo,
    )


def timings(work: Work, output: RequestOutput, now: float) -> Timings:
    admitted = work.admitted_at
    ttft = None
    m = output.metrics
    if m is not None and m.first_token_time is not None:
        ttft = m.first_token_time - m.arrival_time
    elif admitted is not None and work.first_token_at is not None:
        ttft = work.first_token_at - admitted
    enqueued = work.enqueued_at
    scheduled = launched = None
    if m is not None and m.first_scheduled_time is not None and admitted is not None:
        # NOTE: the engine's clock is monotonic; its arrival is the admission, on the wall clock here
        scheduled = admitted + (m.first_scheduled_time - m.arrival_time)
        if m.first_launched_time is not None:
            launched = admitted + (m.first_launched_time - m.arrival_time)

    def since_enqueued(at: float | None) -> float | None:
        return _round(at - enqueued) if at is not None and enqueued is not None else None

    return Timings(
        queue_s=since_enqueued(admitted),
        ttft_s=_round(ttft) if ttft is not None else None,
        total_s=since_enqueued(now),
        read_s=since_enqueued(work.started_at or None),
        ready_s=since_enqueued(work.ready_at),
        scheduled_s=since_enqueued(scheduled),
        launched_s=since_enqueued(launched),
    )


def kv_tokens(output: RequestOutput) -> int:
    """Tokens of KV a finished request held at its end (prompt + every completion)."""
    return len(output.prompt_token_ids) + sum(len(c.token_ids) for c in output.outputs)


def _round(seconds: float) -> float:
    return round(max(0.0, seconds), 6)
