"""A request's inputs, checked before it joins the engine: its id, its prompt, whether it fits."""

from __future__ import annotations

from typing import Any

from engine.core.block_manager import BlockManager
from engine.errors import ContextLengthError
from engine.sampling_params import SamplingParams

_ANCHOR = "\n"  # what a text continuation is tokenized after, where the tokenizer marks a text's start


class PromptInputs:
    """Tokenizes and checks prompts and continuations against the model and the cache;
    every problem is a ``ValueError`` (``ContextLengthError`` for length) naming it."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, block_manager: BlockManager) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.bm = block_manager
        self._marks_start: bool | None = None  # whether the tokenizer puts a space before a text's start

    @staticmethod
    def check_request(request_id: Any, priority: Any, requests: dict[str, Any]) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")

    def continuation_ids(self, continuation: str | list[int], index: int) -> list[int]:
        if isinstance(continuation, str):
            if self.tokenizer is None:
                raise ValueError(f"continuations.{index}: this model has no tokenizer; pass token ids")
            ids = self._following_text_ids(continuation)
        elif isinstance(continuation, (list, tuple)):
            ids = list(continuation)
        else:
            raise ValueError(f"continuations.{index}: expected a string or token ids, got {type(continuation).__name__}")
        if not ids:
            raise ValueError(f"continuations.{index}: must not be empty")
        self._check_ids(ids, f"continuations.{index}")
        return ids

    def _following_text_ids(self, text: str) -> list[int]:
        """The tokens of ``text`` where it follows other text, as a continuation follows its prompt.

        NOTE: a SentencePiece tokenizer (Llama 2's, Mistral's) marks the start of every text it
        encodes with a space: alone ``Yes`` is ``["▁Yes"]`` where after ``"Verdict:\\n"`` it is
        ``["Yes"]`` (and with some, `` Paris`` is ``["▁", "▁Paris"]`` where after a prompt it is
        ``["▁Paris"]``). Such a tokenizer encodes the text after ``_ANCHOR`` and cuts the anchor's
        tokens off; any other (byte-level BPE) encodes it alone, as it always did."""
        if self._marks_start is None:
            self._marks_start = self._after_anchor("a") not in (None, self._ids("a"))
        return (self._after_anchor(text) if self._marks_start else None) or self._ids(text)

    def _after_anchor(self, text: str) -> list[int] | None:
        """The tokens of ``_ANCHOR + text`` past the anchor's own; None where the two merge."""
        anchor, ids = self._ids(_ANCHOR), self._ids(_ANCHOR + text)
        return ids[len(anchor):] if ids[: len(anchor)] == anchor else None

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def tokenize(self, prompt: str | list[int] | None, token_ids: list[int] | None) -> tuple[str | None, list[int]]:
        if isinstance(prompt, list) and token_ids is None:
            prompt, token_ids = None, prompt
        if (prompt is None) == (token_ids is None):
            raise ValueError("give exactly one of prompt (text) and prompt_token_ids")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass prompt_token_ids")
            token_ids = self.tokenizer(prompt)["input_ids"]
        if not token_ids:
            raise ValueError("prompt must not be empty")
        self._check_ids(token_ids, "prompt_token_ids")
        return prompt, list(token_ids)

    def _check_ids(self, ids: Any, name: str) -> None:
        """Every element an int in [0, vocab_size), else a ``ValueError`` naming ``name`` and the first bad one.

        NOTE: the common case is checked with C-level passes (the element types, then min and
        max): a Python loop over each id cost 0.2 us a token, 6 ms of the step loop's turn that
        admits a few dozen grading prompts of 1,700 tokens."""
        if set(map(type, ids)) == {int} and 0 <= min(ids) and max(ids) < self.vocab_size:
            return
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"{name}: {t!r} is not a token id in [0, {self.vocab_size})")

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise ContextLengthError(
                f"prompt is {num_prompt_tokens} tokens long; the model's context (max_model_len) is {limit}"
            )
        # NOTE: as in vLLM, max_tokens past the context (or None) generates up to the context's
        # end and finishes "length"; the worker refuses such a job before it gets here
        wanted = limit if params.max_tokens is None else min(limit, num_prompt_tokens + params.max_tokens)
        self._check_blocks(wanted, "prompt + max_tokens", "lower max_tokens or give the cache more memory")

    def check_continuation_fits(self, num_prompt_tokens: int, num_tokens: int, index: int) -> None:
        """The prompt and continuation ``index`` of a scoring request fit the context and the cache.

        NOTE: together they may fill the context: the token a scoring sequence samples past its
        end is dropped, never computed, so it needs no position and no cache slot."""
        total = num_prompt_tokens + num_tokens
        if total > self.max_model_len:
            raise ContextLengthError(
                f"continuations.{index}: the prompt ({num_prompt_tokens} tokens) and this continuation"
                f" ({num_tokens}) are {total} tokens; the model's context (max_model_len) is {self.max_model_len}"
            )
        self._check_blocks(total, f"continuations.{index}: the prompt and this continuation",
                           "give the cache more memory")

    def _check_blocks(self, num_tokens: int, what: str, remedy: str) -> None:
        blocks = -(-num_tokens // self.bm.block_size)
        if blocks > self.bm.gpu.num_blocks:
            raise ContextLengthError(
                f"{what} needs {blocks} KV blocks but the cache has only {self.bm.gpu.num_blocks}; {remedy}"
            )
