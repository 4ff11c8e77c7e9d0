"""Sampling parameters for one request.

Torch-free on purpose: the wire protocol in ``producers`` reuses this class, and web apps
that install ``producers`` have no GPU stack.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from engine.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)

# NOTE: vLLM's floor: a positive temperature below it is raised to it (logits / T overflows
# float32 below about 1e-37, and the inf logits then make NaN probabilities)
MIN_TEMPERATURE = 1e-2
_logged: set[str] = set()


@dataclass
class SamplingParams:
    """How to sample the completions of one prompt (the fields vLLM users know)."""

    n: int = 1  # completions returned for the prompt
    temperature: float = 1.0  # 0 means greedy; a positive value below MIN_TEMPERATURE is raised to it
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # 0 or -1 keeps every token
    min_p: float = 0.0  # drop tokens below min_p * p(most likely token)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None  # a seeded request samples the same tokens in any batch; -1 is None
    stop: list[str] = field(default_factory=list)  # strings that end generation, not returned
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the end of the context (as does a larger value)
    min_tokens: int = 0  # no stop (eos, stop ids, stop strings) before this many tokens
    logprobs: int | None = None  # top-k logprobs per generated token (plus the chosen one)
    prompt_logprobs: int | None = None  # top-k logprobs per prompt token (plus the prompt's own; None first)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # keep the stop string / stop token's text in the text
    bad_words: list[str] = field(default_factory=list)  # words never generated (as their tokens)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: the context)
    detokenize: bool = True  # False: token ids only, text stays empty
    spaces_between_special_tokens: bool = True  # no effect with fast tokenizers (the only kind loaded)
    extra_args: dict[str, Any] | None = None  # carried untouched, for the caller's own use
    structured_outputs: StructuredOutputsParams | None = None  # a JSON schema, regex, choice or grammar

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # NOTE: a list (or tuple) only: list() of a number raises TypeError, and of a string or a
        # dict it would make a list of characters or keys; None is the default, as in vLLM.
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple)):
                raise ValueError(f"{name} must be a list, got {value!r}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check_int("n", self.n, low=1)
        _check_number("temperature", self.temperature, low=0.0)
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            if "temperature" not in _logged:
                _logged.add("temperature")
                logger.warning("temperature %s is below %s and is taken as %s, as vLLM takes it (logged once)",
                               self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, low=-1)
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_number(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if self.seed < -1:
                raise ValueError(f"seed must be -1 (no seed) or an integer >= 0, got {self.seed}")
            if self.seed == -1:  # NOTE: vLLM's "no seed": drawn as an unseeded request is
                self.seed = None
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, low=0)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), low=0, high=20)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "detokenize",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        self._check_vocabulary_fields()
        self._check_structured_outputs()

    def _check_vocabulary_fields(self) -> None:
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        # NOTE: lists only, as for stop: list() of a number raises TypeError, and of a dict (JSON
        # from a client) or a string of digits it makes keys or characters, read as words or ids
        for name in ("bad_words", "allowed_token_ids"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple)):
                raise ValueError(f"{name} must be a list, got {value!r}")
        self.bad_words = list(self.bad_words or [])
        for word in self.bad_words:
            if not isinstance(word, str) or not word.strip():
                raise ValueError(f"bad_words must hold non-empty strings, got {word!r}")
        if not isinstance(self.logit_bias or {}, dict):
            raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
        bias = {}
        for token, value in (self.logit_bias or {}).items():
            # NOTE: JSON object keys are strings; a token id given as "42" is read as 42 (ASCII
            # digits only: str.isdigit also passes '²', which int() refuses, and '١', read as 1)
            if isinstance(token, str) and token.isascii() and token.isdigit():
                token = int(token)
            _check_int("logit_bias token id", token, low=0)
            bias[token] = _check_number(f"logit_bias[{token}]", value)
            if not -100.0 <= bias[token] <= 100.0:
                raise ValueError(f"logit_bias[{token}] must be in [-100, 100], got {value}")
        self.logit_bias = bias
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (give None to allow every token)")
            for t in self.allowed_token_ids:
                _check_int("allowed_token_ids", t, low=0)
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, low=-1)
            if self.truncate_prompt_tokens == 0:
                raise ValueError("truncate_prompt_tokens must be -1 or >= 1, got 0")
        if not self.detokenize and self.stop:
            raise ValueError(f"stop strings ({self.stop[0]!r}...) need detokenize=True")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict or None, got {type(self.extra_args).__name__}")

    def _check_structured_outputs(self) -> None:
        self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        if self.structured_outputs is None:
            return
        # NOTE: a constrained output ends with an end-of-sequence token when the constraint is
        # complete; ignoring that token, or forbidding it (min_tokens), would leave no token to take
        if self.ignore_eos:
            raise ValueError("structured_outputs: ignore_eos must be false (a constrained output ends "
                             "with an end-of-sequence token when it is complete)")
        if self.min_tokens:
            raise ValueError(f"structured_outputs: min_tokens must be 0, got {self.min_tokens} (a complete "
                             "constrained output allows only the end-of-sequence token)")

    def prompt_keep(self, max_model_len: int) -> int | None:
        """How many of the prompt's last tokens a request runs with (``truncate_prompt_tokens``;
        -1: as many as the context holds, leaving room for one token), or None: all of them."""
        if self.truncate_prompt_tokens is None:
            return None
        return self.truncate_prompt_tokens if self.truncate_prompt_tokens > 0 else max_model_len - 1

    @property
    def reads_history(self) -> bool:
        """Whether sampling reads every earlier token: penalties, or a bad word of several tokens."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.bad_words))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready form (every field, defaults included)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "SamplingParams":
        """Build from JSON data; unknown keys raise ``ValueError`` naming them."""
        data = dict(data or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown sampling field(s): {', '.join(unknown)}")
        return cls(**data)


def _check_number(name: str, value: Any, low: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return float(value)


def _check_int(name: str, value: Any, low: int | None = None, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
    return value
