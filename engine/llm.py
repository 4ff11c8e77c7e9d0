"""``LLM``: the offline API, as vLLM users know it."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Any

from engine.config import EngineArgs
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]


class LLM:
    """Generate completions for a batch of prompts with one engine.

    ``LLM(model, **kwargs)`` takes every field of ``engine.config.EngineArgs`` (vLLM's names
    and defaults); an unknown or invalid argument raises ``ValueError`` naming it.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.llm_engine = LLMEngine(EngineArgs.from_kwargs(model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Seq[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        ``prompts``: a string, a list of token ids, a dict with ``prompt`` or
        ``prompt_token_ids``, or a list of any of these.
        """
        prompts = _as_prompt_list(prompts)
        params = _broadcast("sampling_params", sampling_params or SamplingParams(), len(prompts))
        priorities = _broadcast("priority", list(priority) if priority is not None else 0, len(prompts))
        ids = []
        for prompt, p, prio in zip(prompts, params, priorities):
            rid = f"llm-{next(self._ids)}"
            text, token_ids = _split_prompt(prompt)
            self.llm_engine.add_request(rid, text, p, priority=prio, prompt_token_ids=token_ids, final_only=True)
            ids.append(rid)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Render each conversation with the tokenizer's chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.llm_engine.apply_chat_template(list(c))} for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req", dynamic_ncols=True)
        try:
            while self.llm_engine.has_unfinished_requests():
                for out in self.llm_engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            self.llm_engine.abort_request(ids)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [final[i] for i in ids]

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks and free the cache."""
        self.llm_engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        engine = self.__dict__.get("llm_engine")
        if engine is not None:
            engine.shutdown()


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, Seq) and prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [list(prompts)]
    if not isinstance(prompts, Seq) or isinstance(prompts, bytes):
        raise ValueError(f"prompts must be a string, token ids, or a list of them; got {type(prompts).__name__}")
    return list(prompts)


def _split_prompt(prompt: PromptType) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        unknown = set(prompt) - {"prompt", "prompt_token_ids"}
        if unknown:
            raise ValueError(f"prompt dict has unknown key(s): {', '.join(sorted(unknown))}")
        return prompt.get("prompt"), prompt.get("prompt_token_ids")
    if isinstance(prompt, Seq):
        return None, list(prompt)
    raise ValueError(f"each prompt must be a string, token ids or a dict; got {type(prompt).__name__}")


def _broadcast(name: str, value: Any, n: int) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name}: got {len(value)} values for {n} prompts")
        return list(value)
    return [value] * n
