"""Continuation scoring: how likely the model finds each of given continuations of one prompt.

A scoring request holds one sequence per continuation, whose prompt is the prompt followed
by the continuation; it wants the prompt logprobs of the continuation's tokens
(``Sequence.prompt_logprobs_from``) and generates one token, which is dropped. Plain Python.

NOTE: the prompt is computed once. With prefix caching on and more than one continuation, a
gate sequence (the prompt alone, index -1, not one of the request's ``seqs``) runs first;
once its prompt is computed and its full blocks published to the prefix cache, the engine
retires it and admits the continuations, which find the prompt there and each recompute only
from the block holding the prompt's last token (its logits give the continuation's first
token) on. Without prefix caching, or with one continuation, or a prompt shorter than a
block, there is nothing to share and the continuations are admitted at once.
"""

from __future__ import annotations

import time
from typing import Any

from engine.core.sequence import Request, Sequence
from engine.outputs import ContinuationScore, RequestMetrics
from engine.sampling_params import SamplingParams

# NOTE: one token is generated (the scheduler samples at a prompt's end); greedy and not
# detokenized, since it is dropped
SCORING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
GATE_INDEX = -1


def scoring_sequences(request_id: str, prompt_ids: list[int], continuations: list[list[int]], priority: int,
                      arrival: int, block_size: int, prefix_caching: bool) -> tuple[list[Sequence], Sequence | None]:
    """The continuations' sequences and the gate that computes the shared prompt first (or None)."""
    seqs = []
    for i, tokens in enumerate(continuations):
        ids = list(prompt_ids) + list(tokens)
        seqs.append(Sequence(request_id, i, ids, len(ids), SCORING_PARAMS, priority, arrival,
                             prompt_logprobs_from=len(prompt_ids)))
    shares = prefix_caching and len(continuations) > 1 and len(prompt_ids) - 1 >= block_size
    gate = Sequence(request_id, GATE_INDEX, list(prompt_ids), len(prompt_ids), SCORING_PARAMS, priority,
                    arrival) if shares else None
    return seqs, gate


def scoring_request(inputs: Any, request_id: str, prompt: str | list[int] | None, prompt_token_ids: list[int] | None,
                    continuations: list[str | list[int]], priority: int, arrival: int, block_size: int,
                    prefix_caching: bool) -> tuple[Request, list[Sequence]]:
    """A checked scoring request (``inputs``: the engine's ``PromptInputs``) and the sequences
    to schedule now: its gate, or its continuations when there is no prompt to share."""
    text, token_ids = inputs.tokenize(prompt, prompt_token_ids)
    if not isinstance(continuations, (list, tuple)) or not continuations:
        raise ValueError("continuations must be a non-empty list of strings or token id lists")
    tails = [inputs.continuation_ids(c, i) for i, c in enumerate(continuations)]
    inputs.check_fits(len(token_ids), SCORING_PARAMS)  # the prompt alone, as its gate runs it
    for i, tail in enumerate(tails):
        inputs.check_continuation_fits(len(token_ids), len(tail), i)
    seqs, gate = scoring_sequences(request_id, token_ids, tails, priority, arrival, block_size, prefix_caching)
    request = Request(request_id, text, list(token_ids), SCORING_PARAMS, seqs, RequestMetrics(time.monotonic()),
                      priority, final_only=True, gate=gate)
    return request, [gate] if gate is not None else seqs


def is_gate(seq: Sequence) -> bool:
    return seq.index == GATE_INDEX


def continuation_scores(request: Request) -> list[ContinuationScore]:
    """Each continuation's summed logprob, token count and whether greedy decoding produces it."""
    found = []
    for seq in request.seqs:
        ids = seq.token_ids[seq.prompt_logprobs_from : seq.num_prompt_tokens]
        logprobs = [entry[t].logprob for t, entry in zip(ids, seq.prompt_logprobs)]
        # NOTE: not rank 1: a token tied for the most likely is rank 2 (engine/runner/ranks.py), and
        # greedy decoding picks the first of those tied
        greedy = len(seq.prompt_greedy) == len(ids) and all(seq.prompt_greedy)
        found.append(ContinuationScore(seq.index, sum(logprobs), len(ids), greedy, list(ids), logprobs))
    return found
