"""The request half of ``LLMEngine``: adding, aborting and forgetting requests (the step half
is ``engine/llm_engine.py``). A base class of ``LLMEngine``: its methods use the engine's
inputs, sampler, scheduler, detokenizer and request table, which ``LLMEngine.__init__`` makes."""

from __future__ import annotations

import time
from collections.abc import Iterable

from engine.core.resume import check_resume, resume_sequence
from engine.core.sequence import Request, Sequence
from engine.outputs import RequestMetrics
from engine.runner.sampler import uses_penalties
from engine.sampling_params import SamplingParams
from engine.scoring import scoring_request
from engine.structured.manager import StructuredOutputs


class EngineRequests:
    """``add_request``, ``add_scoring_request``, ``abort_request`` and the request counts."""

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | None,
        params: SamplingParams | None = None,
        priority: int = 0,
        prompt_token_ids: list[int] | None = None,
        final_only: bool = False,
        resume_token_ids: list[int] | None = None,
    ) -> None:
        """Queue a request; raises ``ValueError`` naming the problem if it can never run.

        ``final_only``: ``step()`` reports the request once, when it finishes, instead of
        after every token (what offline batch callers want, and cheaper per step).

        ``resume_token_ids``: output an interrupted run of this request produced (``n`` = 1),
        prefilled with the prompt and counted as generated; deltas cover only new tokens
        (``engine/core/resume.py``). If they already end it, the next ``step()`` says so.
        """
        params = params or SamplingParams()
        self.inputs.check_request(request_id, priority, self.requests)
        text, token_ids = self.inputs.tokenize(prompt, prompt_token_ids)
        keep = params.prompt_keep(self.max_model_len)
        if keep is not None:
            token_ids = token_ids[-keep:]
        self.inputs.check_fits(len(token_ids), params)
        self.sampler.check(params)
        resume = check_resume(resume_token_ids, params, self.vocab_size)
        compiling = self._structured().compile(params.structured_outputs) if params.structured_outputs else None
        now = time.monotonic()
        # NOTE: the first completion alone collects the prompt logprobs; the others may take prefix-cache hits
        want_prompt = 1 if params.prompt_logprobs is not None else None
        seqs = [
            Sequence(request_id, i, list(token_ids), len(token_ids), params, priority, self._arrivals,
                     prompt_logprobs_from=want_prompt if i == 0 else None)
            for i in range(params.n)
        ]
        self._arrivals += 1
        request = Request(request_id, text, list(token_ids), params, seqs, RequestMetrics(now), priority,
                          final_only=final_only)
        self.requests[request_id] = request
        self._num_seqs += len(seqs)
        if uses_penalties(params):
            self._num_history_requests += 1
        for seq in seqs:
            self.detokenizer.start(seq)
            if resume and resume_sequence(seq, resume, self.detokenizer, self.stop_checker):
                self.scheduler.finish(seq)
                self._resumed_finished.append(request_id)
                continue
            if compiling is None:
                self.scheduler.add(seq)
        if compiling is not None and not request.finished:
            self.structured.wait(request, compiling)  # NOTE: it joins the scheduler once compiled

    def _structured(self) -> StructuredOutputs:
        """The structured-output state, made on first use (the backend is imported only then)."""
        if self.structured is None:
            self.structured = StructuredOutputs.for_model(
                self.tokenizer, self.vocab_size, self.eos_token_ids, self._structured_timeout_s,
                pin_memory=self.config.model.device.type == "cuda")
        return self.structured

    def add_scoring_request(
        self,
        request_id: str,
        prompt: str | list[int] | None,
        continuations: list[str | list[int]],
        priority: int = 0,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        """Queue a request for the log-likelihood of each continuation (token ids, or text
        tokenized as it follows the prompt: give it its leading space, ``" Paris"``) of
        ``prompt``, computed once (``engine/scoring.py``). Its one, final ``RequestOutput`` has
        ``scores``, no completions."""
        self.inputs.check_request(request_id, priority, self.requests)
        request, first = scoring_request(self.inputs, request_id, prompt, prompt_token_ids, continuations, priority,
                                         self._arrivals, self.block_manager.block_size,
                                         self.block_manager.enable_prefix_caching)
        self._arrivals += 1
        self.requests[request_id] = request
        self._num_seqs += len(request.seqs)
        for seq in first:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop requests wherever they are; they are not reported by ``step()`` again."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            request = self._forget(rid)
            if request is None:
                continue
            for seq in request.seqs + ([request.gate] if request.gate is not None else []):
                if not seq.is_finished:
                    seq.finish_reason = "abort"
                    self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    def num_unfinished_seqs(self) -> int:
        """Sequences of the unfinished requests (``n`` per request; finished siblings included)."""
        return self._num_seqs

    def _forget(self, request_id: str) -> Request | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if self.structured is not None:
            self.structured.discard(request_id)
        self._num_seqs -= len(request.seqs)
        if uses_penalties(request.params):
            self._num_history_requests -= 1
        return request
