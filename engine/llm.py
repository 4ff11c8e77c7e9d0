"""``LLM``: the offline API, as vLLM users know it."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

from engine.config import EngineArgs
from engine.llm_engine import LLMEngine
from engine.outputs import ContinuationScore, RequestOutput
from engine.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]


class LLM:
    """Generate completions for a batch of prompts with one engine.

    ``LLM(model, **kwargs)`` takes every field of ``engine.config.EngineArgs`` (vLLM's names
    and defaults); an unknown or invalid argument raises ``ValueError`` naming it.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        self._args = EngineArgs.from_kwargs(model, **kwargs)
        self.llm_engine = LLMEngine(self._args)
        self._ids = itertools.count()  # request ids "0", "1", ... as vLLM numbers them
        self._default_params: SamplingParams | None = None

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request given no ``SamplingParams`` samples with: the model's
        ``generation_config.json`` sampling fields (``generation_config="auto"``, the default;
        ``"vllm"`` skips them) with ``override_generation_config`` laid over, else the defaults."""
        if self._default_params is None:
            found = _generation_defaults(self._args, self.llm_engine.config.model.path)
            self._default_params = SamplingParams(**found)
        return self._default_params

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: Any = True,
        lora_request: None = None,
        priority: Seq[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        ``prompts``: a string, a list of token ids, a dict with ``prompt`` or
        ``prompt_token_ids``, or a list of any of these. No ``sampling_params``: the model's
        defaults (``get_default_sampling_params()``). ``use_tqdm``: a bool, or a tqdm-like
        factory for the progress bar. ``lora_request`` must be None (no LoRA support).
        """
        _no_lora(lora_request)
        prompts = _as_prompt_list(prompts)
        params = _broadcast("sampling_params", sampling_params or self.get_default_sampling_params(), len(prompts))
        priorities = _broadcast("priority", list(priority) if priority is not None else 0, len(prompts))
        for p in params:
            self._check_logprobs(p)

        def add(rid: str, prompt: PromptType, p: SamplingParams, prio: int) -> None:
            text, token_ids = _split_prompt(prompt)
            self.llm_engine.add_request(rid, text, p, priority=prio, prompt_token_ids=token_ids, final_only=True)

        return self._run(self._add_all(add, zip(prompts, params, priorities)), use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: Any = True,
        lora_request: None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the chat template (the tokenizer's, or ``chat_template``), then generate.

        ``messages``: one conversation or a list of them; a message's content is a string or
        OpenAI-style text parts. ``tools`` and ``chat_template_kwargs`` reach the template.
        ``chat_template_content_format`` is accepted for vLLM's sake: content is always
        rendered as a string. ``mm_processor_kwargs`` must be None (text-only models).
        """
        from engine.models.tokenizer import apply_chat_template

        _no_lora(lora_request)
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(f"chat_template_content_format={chat_template_content_format!r} is not supported; "
                             "content is rendered as a string ('auto' or 'string')")
        if mm_processor_kwargs:
            raise ValueError("mm_processor_kwargs is not supported: the engine runs text-only models")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": apply_chat_template(
                self.llm_engine.tokenizer, list(c), chat_template=chat_template,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                tools=tools, chat_template_kwargs=chat_template_kwargs)}
            for c in conversations
        ]
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        for out in outputs:  # the rendered conversation, as vLLM reports it
            out.prompt = self.llm_engine.tokenizer.decode(out.prompt_token_ids)
        return outputs

    def score_continuations(
        self,
        prompts: PromptType | Seq[PromptType],
        continuations: Seq[str | list[int]] | Seq[Seq[str | list[int]]],
        use_tqdm: Any = False,
    ) -> list[ContinuationScore] | list[list[ContinuationScore]]:
        """The log-likelihood of each continuation of a prompt: per continuation its summed
        logprob, token count and whether greedy decoding produces it.

        ``prompts``: one prompt (as ``generate`` takes it) with ``continuations`` a list of
        candidates, each text or token ids; or a list of prompts with one list of candidates
        each (then a list of lists comes back). Each prompt is computed once and its candidates
        share it through the prefix cache. A text candidate is tokenized as text that follows
        other text, without special tokens: give it the space that separates it from the prompt
        (``" Paris"``); a list of prompts needs a list of candidates for each.
        """
        single = isinstance(prompts, (str, dict)) or (
            isinstance(prompts, Seq) and bool(prompts) and all(isinstance(t, int) for t in prompts))
        prompt_list = _as_prompt_list(prompts)
        _check_candidates("continuations", continuations)
        groups = [continuations] if single else list(continuations)
        if len(groups) != len(prompt_list):
            raise ValueError(f"continuations: got {len(groups)} lists of candidates for {len(prompt_list)} prompts")
        for i, candidates in enumerate(groups if not single else []):
            _check_candidates(f"continuations.{i}", candidates)

        def add(rid: str, prompt: PromptType, candidates: Seq[str | list[int]]) -> None:
            text, token_ids = _split_prompt(prompt)
            self.llm_engine.add_scoring_request(rid, text, list(candidates), prompt_token_ids=token_ids)

        scores = [out.scores for out in self._run(self._add_all(add, zip(prompt_list, groups)), use_tqdm)]
        return scores[0] if single else scores

    def _check_logprobs(self, params: SamplingParams) -> None:
        limit = self._args.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and limit != -1 and k > limit:
                raise ValueError(f"{name} ({k}) exceeds max_logprobs ({limit}); raise max_logprobs")

    def _add_all(self, add: Callable[..., None], items: Iterable[tuple[Any, ...]]) -> list[str]:
        """Give each item a request id and ``add(request_id, *item)`` it to the engine; the ids.

        NOTE: an item the engine refuses takes back the ones added before it, so a refused call
        leaves nothing behind to run in (and be reported by) the next one."""
        ids: list[str] = []
        try:
            for item in items:
                rid = str(next(self._ids))
                add(rid, *item)
                ids.append(rid)
        except BaseException:
            self.llm_engine.abort_request(ids)
            raise
        return ids

    def _run(self, ids: list[str], use_tqdm: Any) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            factory = use_tqdm if callable(use_tqdm) else tqdm
            bar = factory(total=len(ids), desc="generate", unit="req", dynamic_ncols=True)
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


# generation_config.json keys that set sampling defaults, and the SamplingParams field each sets
_GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def _generation_defaults(args: EngineArgs, model_path: Path | None) -> dict[str, Any]:
    """SamplingParams fields from the model's generation config and ``override_generation_config``."""
    source = args.generation_config
    folder = None if source == "vllm" else (model_path if source == "auto" else Path(source))
    config: dict[str, Any] = {}
    if folder is not None and (folder / "generation_config.json").exists():
        config = json.loads((folder / "generation_config.json").read_text())
    elif source not in ("auto", "vllm"):
        raise ValueError(f"generation_config: no generation_config.json in {source!r}")
    config.update(args.override_generation_config or {})
    return {field: config[key] for key, field in _GENERATION_KEYS.items() if config.get(key) is not None}


def _no_lora(lora_request: Any) -> None:
    if lora_request is not None:
        raise ValueError("lora_request is not supported: the engine serves no LoRA adapters (pass None)")


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, Seq) and prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [list(prompts)]
    if not isinstance(prompts, Seq) or isinstance(prompts, bytes):
        raise ValueError(f"prompts must be a string, token ids, or a list of them; got {type(prompts).__name__}")
    return list(prompts)


def _check_candidates(where: str, candidates: Any) -> None:
    """A list of candidates, else a ``ValueError`` naming ``where``.

    NOTE: a string is a sequence too: taken for a list, it would be scored character by character."""
    if isinstance(candidates, (str, bytes)) or not isinstance(candidates, Seq):
        raise ValueError(f"{where}: expected a list of candidates (strings or token id lists), got "
                         f"{type(candidates).__name__} {candidates!r:.60}")


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
