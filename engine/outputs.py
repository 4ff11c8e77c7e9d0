"""What the engine hands back: completions and request outputs (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log probability under the model, its rank (how many tokens are at least as
    likely, as vLLM counts: 1 = more likely than any other; tied tokens share the worse rank),
    its text and its exact bytes (``None`` where the engine has no tokenizer; the text of a
    piece of a multi-byte character is U+FFFD, its bytes are that piece)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None
    token_bytes: bytes | None = None


@dataclass
class CompletionOutput:
    """One completion of a request; text and token ids are cumulative."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None  # per token: {token_id: Logprob}, the chosen one then the top k
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    # What changed since the previous RequestOutput of this request (for streaming).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    lora_request: None = None  # LoRA adapters are not supported: always None

    def finished(self) -> bool:
        """Whether this completion has ended (a method, as in vLLM)."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after a step (or at the end of ``LLM.generate``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: "RequestMetrics | None" = None
    # per prompt token: None for the first, then {token_id: Logprob}, the prompt's own token
    # first and then the top k (``SamplingParams.prompt_logprobs``); None when not asked for
    prompt_logprobs: "list[dict[int, Logprob] | None] | None" = None
    lora_request: None = None  # LoRA adapters are not supported: always None
    # why the engine gave the request up without running it to the end (its completions end
    # "abort"): a structured-output grammar that did not compile, say; None otherwise
    error: str | None = None
    scores: "list[ContinuationScore] | None" = None  # a scoring request's (``LLMEngine.add_scoring_request``)


@dataclass
class ContinuationScore:
    """How likely the model finds one continuation of a prompt."""

    index: int  # which of the request's continuations
    logprob: float  # the sum of its tokens' logprobs, each given the prompt and the tokens before it
    num_tokens: int
    is_greedy: bool  # every token is the model's most likely one (greedy decoding would produce it)
    token_ids: list[int] = field(default_factory=list)  # what it was scored as (a text one's tokenization)
    token_logprobs: list[float] = field(default_factory=list)


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.monotonic()``) of one request's life in the engine."""

    arrival_time: float
    first_scheduled_time: float | None = None  # its first prompt tokens went into a step
    first_launched_time: float | None = None  # that step was launched (the host's eager launch done)
    first_token_time: float | None = None
    finished_time: float | None = None
