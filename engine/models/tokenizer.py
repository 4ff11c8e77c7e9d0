"""Tokenizer loading, chat templates and incremental detokenization."""

from __future__ import annotations

import json
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
        add(json.loads((model_path / "generation_config.json").read_text()).get("eos_token_id"))
    add(getattr(hf_config, "eos_token_id", None))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return ids


def apply_chat_template(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Render one conversation with the model's chat template (or ``chat_template``) into token ids.

    A message's ``content`` may be a string or OpenAI-style parts (``[{"type": "text", "text": ...}]``),
    whose texts are joined with newlines. ``continue_final_message`` leaves the last (assistant)
    message open for the model to go on with; it excludes ``add_generation_prompt``.
    ``chat_template_kwargs`` are extra variables for the template.
    """
    if tokenizer is None:
        raise ValueError("messages: this model has no tokenizer, so chat messages cannot be rendered")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("messages: the model's tokenizer has no chat template (pass chat_template=...)")
    if add_generation_prompt and continue_final_message:
        raise ValueError("chat: add_generation_prompt and continue_final_message cannot both be true")
    extra = dict(chat_template_kwargs or {})
    text = tokenizer.apply_chat_template(
        [_flat_message(m) for m in messages], chat_template=chat_template, tools=tools,
        add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
        tokenize=False, **extra,
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _flat_message(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` with OpenAI-style content parts joined into one string, and each tool call's
    ``arguments``, given as a JSON string (OpenAI's form), parsed into an object, as vLLM hands
    them to the template (which writes them out with ``tojson``)."""
    if message.get("tool_calls"):
        message = {**message, "tool_calls": [_parsed_call(c) for c in message["tool_calls"]]}
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"messages: content part {str(part)[:60]!r} is not supported (only type 'text')")
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}


def _parsed_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}  # NOTE: empty: no arguments, as vLLM reads it
    except ValueError as exc:
        raise ValueError(f"messages: a tool call's arguments are not valid JSON ({exc}): {arguments[:60]!r}") from None
    return {**call, "function": {**function, "arguments": parsed}}


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
        self._token_bytes = TokenBytes(tokenizer)

    def start(self, seq: Sequence) -> None:
        seq.detok_prefix_offset = max(seq.num_prompt_tokens - _PROMPT_CONTEXT_TOKENS, 0)
        seq.detok_read_offset = seq.num_prompt_tokens
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            context = seq.token_ids[seq.detok_prefix_offset : seq.num_prompt_tokens]
            seq.detok_stream = DecodeStream(ids=context, skip_special_tokens=seq.params.skip_special_tokens)

    def name_tokens(self, logprobs: dict[int, Any] | None) -> dict[int, Any] | None:
        """Fill each ``Logprob``'s ``decoded_token`` with its token's own text and ``token_bytes``
        with its bytes."""
        if logprobs is not None and self.tokenizer is not None:
            for token, entry in logprobs.items():
                entry.decoded_token, entry.token_bytes = self._token_bytes.text_and_bytes(token)
        return logprobs

    def step(self, seq: Sequence) -> str:
        """Decode the newest token of ``seq``; returns the new text (possibly empty)."""
        if self.tokenizer is None or not seq.params.detokenize:
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


class TokenBytes:
    """Each token's own text and exact bytes, remembered per id.

    Byte-level BPE vocabularies (GPT-2, Llama 3, Qwen) spell each byte as one printable
    character, mapped back here; SentencePiece vocabularies (Llama 2, Mistral) spell bytes
    as ``<0xAB>`` and spaces as U+2581. Anything else (an added special token) is its
    decoded text in UTF-8.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._byte_level = _is_byte_level(tokenizer)
        self._unbyte = {c: b for b, c in _bytes_to_unicode().items()}
        self._known: dict[int, tuple[str, bytes]] = {}

    def text_and_bytes(self, token: int) -> tuple[str, bytes]:
        found = self._known.get(token)
        if found is None:
            text = self.tokenizer.decode([token])
            found = self._known[token] = (text, self._bytes(token, text))
        return found

    def _bytes(self, token: int, text: str) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if not isinstance(piece, str) or token in getattr(self.tokenizer, "all_special_ids", ()):
            return text.encode("utf-8")
        if self._byte_level and all(c in self._unbyte for c in piece):
            return bytes(self._unbyte[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        if "\u2581" in piece:
            return piece.replace("\u2581", " ").encode("utf-8")
        return text.encode("utf-8")


def _is_byte_level(tokenizer: Any) -> bool:
    """Whether the tokenizer's decoder (alone or in a sequence) is byte-level BPE's."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    try:
        state = decoder.__getstate__() if decoder is not None else b""  # the decoder's own JSON, small
    except Exception:  # a decoder that cannot describe itself: not treated as byte-level
        return False
    return b'"ByteLevel"' in (state if isinstance(state, bytes) else str(state).encode())


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: each byte value and the printable character that spells it in the vocabulary."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) \
        + list(range(ord("\xae"), ord("\xff") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table
