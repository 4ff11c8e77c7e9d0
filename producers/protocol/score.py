"""Protocol v1.2's scoring job: the ``score`` object that asks for log-likelihoods instead of text.

``{"score": {"continuations": [" Paris", " Lyon"]}}`` beside the prompt: the worker returns,
per continuation, the sum of its tokens' logprobs given the prompt, its token count, the
token ids it was scored as and whether greedy decoding produces it (PROTOCOL.md, "Scoring
jobs"). A continuation is text (tokenized as text that follows other text, without special
tokens: it carries its own leading space) or token ids.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, field_validator

from producers.protocol.limits import (
    MAX_CONTINUATIONS,
    MAX_PROMPT_BYTES,
    MAX_PROMPT_TOKEN_IDS,
    abbreviate,
    check_size,
    utf8_len,
)


class Score(BaseModel):
    """A job's ``score``: the continuations whose log-likelihood it asks for."""

    model_config = ConfigDict(extra="forbid", strict=True)
    continuations: list[str | list[int]]

    @field_validator("continuations", mode="before")
    @classmethod
    def _sizes(cls, value: object) -> object:
        if not isinstance(value, list):
            return value  # the type error is pydantic's to report
        if not value:
            raise ValueError("must hold at least one continuation")
        check_size("", len(value), MAX_CONTINUATIONS, "MAX_CONTINUATIONS", "continuations")
        total_bytes = total_ids = 0
        for i, item in enumerate(value):
            if isinstance(item, str):
                if not item:
                    raise ValueError(f"continuation {i} is an empty string")
                total_bytes += utf8_len(item)
            elif isinstance(item, list):
                if not item:
                    raise ValueError(f"continuation {i} is an empty list of token ids")
                total_ids += len(item)
                bad = next((t for t in item if isinstance(t, bool) or not isinstance(t, int) or t < 0), None)
                if bad is not None:
                    raise ValueError(f"continuation {i}: {abbreviate(bad)} is not a token id (a non-negative integer)")
        check_size("continuations together are", total_bytes, MAX_PROMPT_BYTES, "MAX_PROMPT_BYTES", "bytes in UTF-8")
        check_size("continuations together are", total_ids, MAX_PROMPT_TOKEN_IDS, "MAX_PROMPT_TOKEN_IDS", "token ids")
        return value


class ContinuationScore(BaseModel):
    """One continuation's score in a scoring job's result (``scores``, in the job's order)."""

    index: int
    logprob: float  # the sum of its tokens' logprobs
    num_tokens: int
    is_greedy: bool  # every token is the model's most likely one after what precedes it
    token_logprobs: list[float]
    # the token ids it was scored as (a text continuation's tokenization); None from a worker
    # that predates the field
    token_ids: list[int] | None = None
