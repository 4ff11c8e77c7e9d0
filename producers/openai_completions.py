"""What only ``/v1/completions`` takes: OpenAI's four forms of ``prompt`` (several prompts, each
its own job), ``echo``, and the fields it refuses (``suffix``, a ``best_of`` ranking).

Part of the one translation (``producers.openai_format.translate_request`` calls these).
"""

from __future__ import annotations

from typing import Any

from producers.openai_errors import RequestError, invalid_value

COMPLETION_MAX_TOKENS = 16  # the OpenAI (and vLLM) default of /v1/completions; chat's is the context's end
# NOTE: prompts in one completions request, each its own job: what eval harnesses batch (lm-eval's
# batch_size) with room to spare, while one request's jobs stay few enough to wait on together
MAX_PROMPTS = 256
PROMPT_FORMS = ("must be a string, an array of strings, an array of token ids or an array of token-id arrays"
                f" (not empty; at most {MAX_PROMPTS} prompts)")
ECHO_READS = ("prompt_text", "prompt_first_token")  # what an echo reads of its result (protocol 1.4)


def completion_prompts(body: dict[str, Any]) -> list[dict[str, Any]]:
    """OpenAI's four forms of ``prompt`` as the jobs' prompts: a string or an array of token ids is
    one prompt; an array of strings or of token-id arrays is one prompt per entry, all of a kind."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise invalid_value("prompt", prompt, PROMPT_FORMS)
    if all(_is_token_id(t) for t in prompt):
        return [{"prompt_token_ids": prompt}]
    if len(prompt) > MAX_PROMPTS:
        raise RequestError(f"prompt: {len(prompt):,} prompts is over the limit of {MAX_PROMPTS} per request"
                           " (MAX_PROMPTS); send them in several requests", "prompt", code="invalid_value")
    texts = isinstance(prompt[0], str)
    prompts = []
    for i, item in enumerate(prompt):
        if texts and isinstance(item, str):
            prompts.append({"prompt": item})
        elif not texts and isinstance(item, list) and item and all(_is_token_id(t) for t in item):
            prompts.append({"prompt_token_ids": item})
        else:
            kind = "a string, as prompt.0 is" if texts else "a non-empty array of token ids, as prompt.0 is"
            if i == 0:
                kind = "a string or a non-empty array of token ids"
            raise invalid_value(f"prompt.{i}", item, f"must be {kind} (an array of prompts is all strings or all"
                                                     " token-id arrays)")
    return prompts


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def echo(sampling: dict[str, Any], meta: dict[str, Any], max_tokens: Any) -> Any:
    """``echo``: the answer starts with the prompt. Its text, its tokens and their logprobs come
    with the job's prompt logprobs (protocol 1.4), k as ``logprobs`` asks (0 without), so the
    prompt is computed whole (no prefix-cache hit); ``max_tokens`` 0 answers the prompt alone
    after one token generated and dropped (vLLM's way: the engine generates at least one)."""
    sampling["prompt_logprobs"] = meta.get("logprobs") or 0
    alone = max_tokens == 0 and not isinstance(max_tokens, bool)
    meta["echo"] = "prompt" if alone else "prompt+completion"
    return 1 if alone else max_tokens


def check_completion_only(body: dict[str, Any]) -> None:
    """``suffix`` (insertion) and a ``best_of`` other than ``n`` (ranking) are refused."""
    if body.get("suffix") is not None:
        raise RequestError("suffix: insertion is not supported by this server", "suffix")
    best_of, n = body.get("best_of"), body.get("n")
    if best_of is not None and best_of != (1 if n is None else n):  # NOTE: a null n is not given, as OpenAI reads it
        raise invalid_value("best_of", best_of, "must equal n (best_of ranking is not supported)")
