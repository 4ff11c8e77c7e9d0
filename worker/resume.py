"""Where a job that runs again resumes: the output an earlier run of it already produced.

A streamed job resumes from its tokens stream (completion 0's tokens, placed by offset);
any other job from the progress checkpoint its last run left in its hash (``progress``,
``{"token_ids": [...]}``, written every ``--checkpoint-seconds`` by the step loop). The
engine then prefills prompt + those tokens and generates only the rest
(``LLMEngine.add_request(..., resume_token_ids=...)``).

NOTE: a job with ``n`` > 1 runs again from the start (its completions would each need their
own resume point); so does a job asking for ``logprobs``, whose earlier tokens' log-probabilities
neither the stream nor the checkpoint holds. Anything unreadable in either place is ignored
(the job then runs from the start): the hash and the stream can be written by any producer.
"""

from __future__ import annotations

import json
import logging

from producers.deltas import ExactDeltas
from producers.protocol import Job, Keys, ProtocolError, TokenDelta
from worker.admission import Work
from worker.logs import event

log = logging.getLogger(__name__)


def can_resume(job: Job) -> bool:
    """Whether a re-run of ``job`` continues from an earlier run's output (else it restarts)."""
    params = job.sampling_params
    return params.n == 1 and params.logprobs is None and job.score is None  # a scoring job generates nothing


def from_checkpoint(job: Job, progress: str) -> list[int] | None:
    """The output tokens of ``job``'s progress checkpoint, or None (none, unusable, or not resumable)."""
    if not progress or not can_resume(job):
        return None
    try:
        ids = json.loads(progress)["token_ids"]
    except (ValueError, TypeError, KeyError):
        ids = None
    return _checked(job, ids, "checkpoint")


def from_stream(job: Job, entries: list[dict]) -> list[int] | None:
    """Completion 0's tokens in ``job``'s tokens stream entries, read by offset, or None."""
    reader, ids = ExactDeltas(), []
    try:
        for fields in entries:
            delta = TokenDelta.from_fields(fields)
            if delta.offset is None and delta.token_ids:
                return _checked(job, None, "stream")  # a v1 writer's entries: no offsets to continue
            delta = reader.take(delta)
            if delta is not None and delta.index == 0:
                ids.extend(delta.token_ids)
    except ProtocolError:
        return _checked(job, None, "stream")
    return _checked(job, ids, "stream")


def from_streams(client, keys: Keys, works: list[Work]) -> None:
    """Give each streamed job started again (``works`` just started) the output its tokens stream holds.

    NOTE: read after START made these runs the owners, so no other run appends to those
    streams any more: what is read here is where each run's deltas continue."""
    again = [w for w in works if w.job.stream and w.stream_entries and can_resume(w.job)]
    if not again:
        return
    pipe = client.pipeline(transaction=False)
    for work in again:
        pipe.xrange(keys.tokens(work.id))
    for work, entries in zip(again, pipe.execute(raise_on_error=False)):
        if isinstance(entries, Exception):  # NOTE: not fatal: the job runs from the start
            event(log, "job.resume_unread", logging.WARNING, job=work.id, error=str(entries))
        else:
            work.resume_token_ids = from_stream(work.job, [fields for _, fields in entries])


def _checked(job: Job, ids, source: str) -> list[int] | None:
    limit = job.sampling_params.max_tokens
    if isinstance(ids, list) and len(ids) <= limit and all(type(t) is int and t >= 0 for t in ids):
        return ids or None
    event(log, "job.resume_ignored", logging.WARNING, job=job.id, source=source,
          reason=f"not a list of at most max_tokens ({limit}) token ids")
    return None
