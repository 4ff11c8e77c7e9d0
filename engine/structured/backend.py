"""The grammar backend seam: compile a constraint, match tokens, fill and apply token bitmasks.

A backend turns a ``StructuredOutputsParams`` into a compiled grammar (thread-safe: the
engine compiles off its step thread), makes one matcher per sequence from it, fills a batch
of bitmasks on the host and applies a bitmask to logits on the device. A bitmask row is
``ceil(vocab / 32)`` int32 words, bit ``t % 32`` of word ``t // 32`` set where token ``t`` is
allowed; ``-1`` everywhere allows every token. xgrammar is the one backend today.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Protocol

import torch

from engine.structured_outputs import StructuredOutputsParams


class GrammarMatcher(Protocol):
    def accept_token(self, token_id: int) -> bool: ...
    def is_terminated(self) -> bool: ...


class GrammarBackend(Protocol):
    def parse(self, params: StructuredOutputsParams) -> Any:
        """The constraint as the backend's grammar (quick); ``ValueError`` naming ``structured_outputs.<field>``."""

    def compile(self, grammar: Any) -> Any:
        """The compiled grammar (slow: run off the step thread; several may run at once)."""

    def matcher(self, compiled: Any) -> GrammarMatcher: ...

    def fill_bitmask(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Write ``matchers[i]``'s allowed tokens into ``bitmask[rows[i]]`` (host, int32)."""

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Set the disallowed logits to -inf in place (both on the logits' device)."""


def bitmask_width(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def apply_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Plain-torch reference of ``apply_bitmask``: (N, V) logits, (N, ceil(V/32)) int32 words."""
    n, vocab = logits.shape
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().view(n, -1)[:, :vocab]  # (N, V)
    logits.masked_fill_(~allowed, float("-inf"))


class XGrammarBackend:
    """xgrammar's compiler and matchers over the model's tokenizer (padded to the model's vocab).

    The tokenizer's vocabulary is read on the first compile (a large one takes a second or
    two), on a compile thread, so an engine that never sees a constraint never pays for it.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], threads: int = 0) -> None:
        import xgrammar

        self._xgr = xgrammar
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._threads = threads or max(1, min(8, (os.cpu_count() or 2) // 2))
        self._compiler = None
        self._lock = threading.Lock()
        self._batch = xgrammar.BatchGrammarMatcher(max_threads=self._threads)

    def parse(self, params: StructuredOutputsParams) -> Any:
        xgr, kind = self._xgr, params.kind
        try:
            if kind in ("json", "json_object"):
                schema = params.json if kind == "json" else {"type": "object"}
                # NOTE: JSON's whitespace is allowed, up to 2 characters at a place: unbounded, a
                # model could pad forever and never close the object
                grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=True, max_whitespace_cnt=2)
                return self._without_raw_control_characters(grammar)
            if kind == "regex":
                return xgr.Grammar.from_regex(params.regex)
            return xgr.Grammar.from_ebnf(choice_grammar(params.choice) if kind == "choice" else params.grammar)
        except RuntimeError as exc:  # xgrammar's parse and conversion errors
            raise ValueError(f"structured_outputs.{kind}: {_backend_message(exc)}") from None

    def _without_raw_control_characters(self, grammar: Any) -> Any:
        """Keep control characters out of length-limited JSON strings.

        NOTE: xgrammar 0.2.9 writes a string with minLength/maxLength as characters of the
        class "anything but a quote, a backslash, CR or LF", which lets the other control
        characters through unescaped: JSON forbids them and ``json.loads`` refuses such output.
        Its other strings exclude them; these get the same class (escapes stay out of
        length-limited strings, as they were).
        """
        text = str(grammar)
        if _LOOSE_STRING_CHARACTER not in text:
            return grammar
        return self._xgr.Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHARACTER, _JSON_STRING_CHARACTER))

    def compile(self, grammar: Any) -> Any:
        return self._compiler_for_vocab().compile_grammar(grammar)

    def _compiler_for_vocab(self) -> Any:
        with self._lock:
            if self._compiler is None:
                info = self._xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                                stop_token_ids=self._stop_token_ids)
                # NOTE: the compiler is thread-safe: several constraints compile at once
                self._compiler = self._xgr.GrammarCompiler(info, max_threads=self._threads)
            return self._compiler

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return self._xgr.GrammarMatcher(compiled)

    def fill_bitmask(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, rows[0])
        else:
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self._xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1])


_LOOSE_STRING_CHARACTER = r'[^\"\\\r\n]'  # as xgrammar prints it
_JSON_STRING_CHARACTER = r'[^\0-\x1f\"\\]'


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices``."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _backend_message(exc: Exception) -> str:
    """xgrammar's message without its source location (``[time] file.cc:123: ...``)."""
    text = str(exc).strip()
    head, sep, rest = text.partition(": ")
    if sep and head.startswith("[") and ".cc:" in head:
        text = rest
    return text if len(text) <= 300 else text[:297] + "..."
