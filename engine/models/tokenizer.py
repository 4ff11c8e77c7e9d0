"""Tokenizer loading, chat templates and incremental detokenization."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.core.sequence import Sequence

_PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded with the output for spacing context


def load_tokenizer(path: str | Path):
    """The HF fast tokenizer saved in ``path`` (a model folder)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # transformers raises many types here
        raise ValueError(f"tokenizer: cannot load a tokenizer from {str(path)!r}: {exc}") from exc


def eos_token_ids(tokenizer: Any, hf_config: Any, model_path: Path | None) -> set[int]:
    """Every id that ends generation: generation_config.json, the config, the tokenizer."""
    ids: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    if model_path is not None and (model_path / "generation_config.json").exists():
        import json

        add(json.loads((model_path / "generation_config.json").read_text()).get("eos_token_id"))
    add(getattr(hf_config, "eos_token_id", None))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return ids


def apply_chat_template(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    if tokenizer is None:
        raise ValueError("messages: this model has no tokenizer, so chat messages cannot be rendered")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("messages: the model's tokenizer has no chat template")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class Detokenizer:
    """Turns each new token into a text delta without re-decoding the whole output.

    A token that ends in the middle of a multi-byte character adds no text until the
    following tokens complete the character.

    With a fast tokenizer each sequence keeps a ``tokenizers`` ``DecodeStream`` primed with
    the last prompt tokens (for spacing), one native call per token; otherwise the window
    since the last emitted text is decoded twice and the difference is the delta.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._backend = _stream_backend(tokenizer)

    def start(self, seq: Sequence) -> None:
        seq.detok_prefix_offset = max(seq.num_prompt_tokens - _PROMPT_CONTEXT_TOKENS, 0)
        seq.detok_read_offset = seq.num_prompt_tokens
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            context = seq.token_ids[seq.detok_prefix_offset : seq.num_prompt_tokens]
            seq.detok_stream = DecodeStream(ids=context, skip_special_tokens=seq.params.skip_special_tokens)

    def step(self, seq: Sequence) -> str:
        """Decode the newest token of ``seq``; returns the new text (possibly empty)."""
        if self.tokenizer is None:
            return ""
        stream = seq.detok_stream
        if stream is not None:
            return stream.step(self._backend, seq.token_ids[-1]) or ""
        skip = seq.params.skip_special_tokens
        ids = seq.token_ids
        prefix = self.tokenizer.decode(ids[seq.detok_prefix_offset : seq.detok_read_offset], skip_special_tokens=skip)
        full = self.tokenizer.decode(ids[seq.detok_prefix_offset :], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            seq.detok_prefix_offset = seq.detok_read_offset
            seq.detok_read_offset = len(ids)
            return full[len(prefix) :]
        return ""


def _stream_backend(tokenizer: Any) -> Any:
    """The native ``tokenizers.Tokenizer`` behind a fast HF tokenizer, when ``DecodeStream`` can use it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None
    if not isinstance(backend, Tokenizer):
        return None
    try:
        DecodeStream(ids=[], skip_special_tokens=True)  # older releases take no priming ids
    except TypeError:
        return None
    return backend
