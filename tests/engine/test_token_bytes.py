"""Each token's own text and exact bytes, for byte-level BPE and SentencePiece-style vocabularies."""

from __future__ import annotations

import pytest

from engine.models.tokenizer import TokenBytes

TEXT = "Zürich 🚀 is nice"


def test_byte_level_tokens_join_into_the_text(tiny_model_factory):
    from engine.models.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_model_factory("llama"))
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    named = TokenBytes(tok)
    pieces = [named.text_and_bytes(i) for i in ids]
    assert b"".join(b for _, b in pieces).decode() == TEXT
    assert any(text == "\ufffd" for text, _ in pieces)  # the emoji is split over tokens
    assert [text for text, _ in pieces] == [tok.decode([i]) for i in ids]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert named.text_and_bytes(eos) == ("<|im_end|>", b"<|im_end|>")


def test_sentencepiece_style_tokens_with_byte_fallback_join_into_the_text():
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for piece in ["\u2581", "Z", "r", "i", "c", "h", "\u2581is", "\u2581nice", "\u2581Z"]:
        vocab.setdefault(piece, len(vocab))
    model = tokenizers.models.BPE(vocab=vocab, merges=[], byte_fallback=True)
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    d = tokenizers.decoders
    tok.decoder = d.Sequence([d.Replace("\u2581", " "), d.ByteFallback(), d.Fuse(), d.Strip(" ", 1, 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    ids = fast(TEXT, add_special_tokens=False)["input_ids"]
    named = TokenBytes(fast)
    assert not named._byte_level
    joined = b"".join(named.text_and_bytes(i)[1] for i in ids)
    assert joined.decode() in (TEXT, " " + TEXT)  # Metaspace marks the first word's start too
    assert named.text_and_bytes(vocab["<0xF0>"])[1] == b"\xf0"
