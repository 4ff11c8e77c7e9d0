"""Logprobs as the OpenAI API shapes them, from the protocol's per-token entries (torch-free:
the gateway and ``sluiceway bulk --format openai`` both use it).

Each entry (a result's ``outputs[i].top_logprobs`` item, or one of a token entry's
``logprobs``) is ``{"token_id", "token", "bytes", "logprob", "rank", "top": [...]}`` with
``top`` the k most likely tokens, most likely first (PROTOCOL.md, "Logprobs").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def plain(entries: Iterable[Any]) -> list[Mapping[str, Any]]:
    """Entries as mappings, whether read as JSON (a result) or as pydantic records (a token delta)."""
    return [e.model_dump() if hasattr(e, "model_dump") else e for e in entries]


def chat_logprobs(entries: Iterable[Any]) -> dict[str, Any]:
    """``choices[i].logprobs`` of a chat completion (or of one chunk)."""
    entries = plain(entries)
    return {"content": [
        {"token": e["token"], "logprob": e["logprob"], "bytes": list(e.get("bytes") or []),
         "top_logprobs": [{"token": t["token"], "logprob": t["logprob"], "bytes": list(t.get("bytes") or [])}
                          for t in e.get("top") or ()]}
        for e in entries
    ], "refusal": None}


def completion_logprobs(entries: Iterable[Any], text_offset: int = 0) -> dict[str, Any]:
    """``choices[i].logprobs`` of a legacy completion; ``text_offset`` is where the first token starts.
    Each ``top_logprobs`` holds the k most likely tokens and the sampled one; an entry whose
    logprob is None (an echoed prompt's first token) has null for both, as OpenAI answers it."""
    entries = plain(entries)
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for e in entries:
        tokens.append(e["token"])
        token_logprobs.append(e["logprob"])
        offsets.append(text_offset)
        text_offset += len(e["token"])
        if e["logprob"] is None:
            top_logprobs.append(None)
            continue
        top = {t["token"]: t["logprob"] for t in e.get("top") or ()}
        # NOTE: the legacy API always counts the sampled token among the top ones (up to
        # logprobs + 1 of them), so a client can read its rival tokens against it
        top.setdefault(e["token"], e["logprob"])
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}
