"""A request's state as the engine reports it: a ``RequestOutput`` with each completion's delta."""

from __future__ import annotations

from engine.core.sequence import Request
from engine.core.stopping import StopChecker
from engine.outputs import CompletionOutput, RequestOutput
from engine.scoring import SCORING_PARAMS, continuation_scores


def make_request_output(request: Request, finished: bool) -> RequestOutput:
    """The request's output now; marks what it hands out as deltas as emitted."""
    completions = []
    scoring = request.params is SCORING_PARAMS
    for seq in request.seqs if not scoring else []:
        holdback = 0 if seq.is_finished else StopChecker.holdback(seq)
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
    first = request.seqs[0]
    return RequestOutput(
        request.request_id, request.prompt, request.prompt_token_ids, completions, finished,
        max(first.num_cached_tokens, 0), request.metrics,
        prompt_logprobs=[None] + list(first.prompt_logprobs) if request.params.prompt_logprobs is not None else None,
        scores=continuation_scores(request) if scoring else None,
        error=request.error,
    )
