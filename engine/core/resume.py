"""Resuming a request from the output tokens an interrupted run already produced.

The resumed tokens are appended to the sequence after its prompt, so the scheduler
prefills prompt + resumed tokens in one motion (``num_computed_tokens`` catches up as with
any prompt), while ``num_prompt_tokens`` stays the prompt's: every length, ``min_tokens``
and stop check, the penalties and the output counts treat them as generated. They are
detokenized one by one, exactly as the run that made them did, so the text, its stop-string
holdback and the next delta continue where that run's stream left off.
"""

from __future__ import annotations

from typing import Any

from engine.core.sequence import Sequence
from engine.core.stopping import StopChecker
from engine.sampling_params import SamplingParams


def check_resume(resume_token_ids: list[int] | None, params: SamplingParams, vocab_size: int) -> list[int]:
    """The resumed tokens, checked (``ValueError`` naming the problem); [] for none."""
    if resume_token_ids is None:
        return []
    if not isinstance(resume_token_ids, list):
        raise ValueError(f"resume_token_ids must be a list of token ids, got {type(resume_token_ids).__name__}")
    if resume_token_ids and params.n != 1:
        raise ValueError(f"resume_token_ids: only a request with n = 1 can resume, this one has n = {params.n}")
    if len(resume_token_ids) > params.max_tokens:
        raise ValueError(f"resume_token_ids: {len(resume_token_ids)} tokens is over max_tokens ({params.max_tokens})")
    for t in resume_token_ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ValueError(f"resume_token_ids: {t!r} is not a token id in [0, {vocab_size})")
    return list(resume_token_ids)


def resume_sequence(seq: Sequence, resume: list[int], detokenizer: Any, stop_checker: StopChecker) -> bool:
    """Append ``resume`` to a fresh sequence as generated output, detokenized and already
    emitted; return whether those tokens already end it (its ``finish_reason`` set).

    NOTE: the run that made these tokens checked every one of them but the last against the
    stops (it went on generating), so checking the last one, with the whole text as new, is
    the check that run would have made next."""
    for token in resume:
        seq.token_ids.append(token)
        seq.text += detokenizer.step(seq)
    streamed = max(0, len(seq.text) - stop_checker.holdback(seq))  # what that run's deltas held
    finished = stop_checker.check(seq, len(seq.text))  # may cut a stop string off the text
    seq.emitted_token_len = seq.num_output_tokens
    seq.emitted_text_len = min(streamed, len(seq.text))
    return finished
