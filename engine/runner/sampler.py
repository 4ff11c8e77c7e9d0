"""Turn logits into next tokens: penalties, temperature, min-p/top-k/top-p, seeded draws.

Sampling uses the exponential race (the Gumbel-max trick): argmax_i(logit_i / T - log E_i)
with E_i ~ Exp(1) is a draw from softmax(logits / T). One Triton kernel
(``sluiceway_kernels/sampling.py``) does it in a single pass over each row, making the noise from a
per-row 64-bit seed; its torch reference makes the same noise on the CPU. A seeded
request's row seed comes from (seed, completion index, position), so its tokens do not
depend on what else shares the batch, on preemption, or on the device; other rows draw
their seeds from the engine's seeded generator on the host.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from engine.core.sequence import Sequence
from engine.outputs import Logprob
from engine.runner.ranks import token_ranks, top_ranks
from sluiceway_kernels.argmax_logsumexp import argmax_logsumexp, argmax_logsumexp_ref
from sluiceway_kernels.sampling import GREEDY_BELOW, sample_from_logits, sample_from_logits_ref

_SEED_MIX = 0x9E3779B97F4A7C15


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per sampled sequence
    logprobs: list[float]  # raw-model logprob of each chosen token
    top_logprobs: list[dict[int, Logprob] | None]  # per sequence, when asked for (decoded_token unset)


@dataclass
class LogitStats:
    """What a decode graph computes past its LM head, so that a step sampled from its logits
    launches nothing more for it: each row's first argmax of the raw logits (``best``, int64),
    their logsumexp (``lse``), and the host rows of a greedy choice (``greedy_rows``: (2, B)
    float64, the token ids and their raw-model logprobs, as ``DeviceSample`` reads them back)."""

    best: torch.Tensor  # (B,) int64
    lse: torch.Tensor  # (B,) float32
    greedy_rows: torch.Tensor  # (2, B) float64

    def rows(self, n: int) -> "LogitStats":
        """The first ``n`` rows (a graph's padded batch cut to the real one)."""
        return LogitStats(self.best[:n], self.lse[:n], self.greedy_rows[:, :n])


def logit_stats(logits: torch.Tensor) -> LogitStats:
    """``LogitStats`` of (B, V) float32 raw logits (the GPU kernel; its reference on a CPU)."""
    best, lse = (argmax_logsumexp if logits.is_cuda else argmax_logsumexp_ref)(logits)  # (B,), (B,)
    return LogitStats(best, lse, torch.stack(_chosen_rows(logits, best, lse)))


def _chosen_rows(raw: torch.Tensor, chosen: torch.Tensor, raw_lse: torch.Tensor) -> list[torch.Tensor]:
    """The chosen token ids and their raw-model logprobs, as float64 rows for the host.

    NOTE: token ids are exact in float64, so one transfer carries ids and logprobs (and ranks)."""
    chosen_logprobs = raw.gather(1, chosen.unsqueeze(1)).squeeze(1) - raw_lse  # (N,), without the (N, V) log-softmax
    return [chosen.double(), chosen_logprobs.double()]


class DeviceSample:
    """A step's choices, on the device: ``token_ids`` (N,) int64 feeds the next step; the
    read-back to the host starts at once (pinned, asynchronous) and ``result()`` waits for it."""

    def __init__(self, token_ids: torch.Tensor, host: torch.Tensor, top, want: list[int | None]) -> None:
        self.token_ids = token_ids
        self._want = want
        self._event = None
        tensors = [host] + list(top or ())
        if host.device.type == "cuda":
            copies = []
            for t in tensors:
                pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                pinned.copy_(t, non_blocking=True)
                copies.append(pinned)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(host.device))
            tensors = copies
        self._host = tensors

    def ready(self) -> bool:
        """Whether the choices are on the host already (no wait)."""
        return self._event is None or self._event.query()

    def wait(self) -> None:
        """Block until the device has made these choices (and copied them to the host)."""
        if self._event is not None:
            self._event.synchronize()

    def result(self) -> SamplerOutput:
        self.wait()
        host = self._host[0].tolist()
        chosen_list = [int(t) for t in host[0]]
        chosen_lp = host[1]
        top: list[dict[int, Logprob] | None] = [None] * len(chosen_list)
        if len(self._host) == 4:
            vals, idx, top_rank = (t.tolist() for t in self._host[1:])
            ranks = host[2]
            for i, k in enumerate(self._want):
                if k is None:
                    continue
                # the chosen token first, then the top k, most likely first (engine/runner/ranks.py)
                entry = {chosen_list[i]: Logprob(chosen_lp[i], int(ranks[i]))}
                for j in range(k):
                    entry.setdefault(idx[i][j], Logprob(vals[i][j], top_rank[i][j]))
                top[i] = entry
        return SamplerOutput(chosen_list, chosen_lp, top)


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: set[int], seed: int = 0, tokenizer=None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.seed = seed
        self.tokenizer = tokenizer  # turns bad_words into token ids
        self._bad_words: dict[tuple[str, ...], list[list[int]]] = {}
        self._rng = random.Random(seed)  # row seeds of unseeded requests, made on the host: no sync

    def check(self, params) -> None:
        """Raise ``ValueError`` for sampling parameters this model's vocabulary cannot honour."""
        for name, ids in (("allowed_token_ids", params.allowed_token_ids or []), ("logit_bias", params.logit_bias)):
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"{name}: {bad} is not a token id in [0, {self.vocab_size})")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words: this model has no tokenizer to turn words into tokens")

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], bitmask=None,
               stats: LogitStats | None = None) -> "DeviceSample":
        """Choose every row's token on the device, without waiting for it: the tokens can feed
        the next step's inputs there, and ``result()`` reads them back later.

        ``logits``: (N, V) float32, row i belonging to ``seqs[i]``; ``bitmask``: the rows'
        structured-output constraints (``engine.structured.manager.StepBitmask``) or None;
        ``stats``: the logits' ``LogitStats`` when the forward computed them (a decode graph)."""
        if stats is not None and logits.shape[1] != self.vocab_size:
            stats = None  # NOTE: computed over padded columns: not this vocabulary's
        logits = logits[:, : self.vocab_size].float()
        raw = logits
        # every row's first argmax and logsumexp of the raw logits, in one pass on a GPU
        if stats is None:
            raw_best, raw_lse = (argmax_logsumexp if raw.is_cuda else argmax_logsumexp_ref)(raw)  # (N,), (N,)
        else:
            raw_best, raw_lse = stats.best, stats.lse
        # NOTE: the bias before the penalties, as vLLM and HF order them: a repetition penalty
        # scales the biased logit (it divides a positive logit, so the order changes the value)
        logits = self._apply_min_tokens(logits, seqs)
        logits = self._apply_vocabulary_rules(logits, seqs)
        logits = self._apply_penalties(logits, seqs)
        if bitmask is not None:  # NOTE: after every other rule; logprobs stay those of the raw logits
            logits = logits.clone() if logits is raw else logits
            bitmask.apply(logits)

        # NOTE: decided on the host from the parameters: a device-side test would cost a sync.
        temps = [s.params.temperature for s in seqs]
        want = [s.params.logprobs for s in seqs]
        greedy = all(t < GREEDY_BELOW for t in temps)
        if greedy and stats is not None and logits is raw and all(k is None for k in want):
            return DeviceSample(raw_best, stats.greedy_rows, None, want)  # all computed in the graph
        if greedy:
            chosen = self._first_argmax(logits, raw, raw_best)  # (N,)
        else:
            dev = logits.device
            temperatures = torch.tensor(temps, dtype=torch.float32).to(dev, non_blocking=True)
            seeds = torch.tensor(self._row_seeds(seqs), dtype=torch.int64).to(dev, non_blocking=True)
            draw = sample_from_logits if logits.is_cuda else sample_from_logits_ref
            if self._filters(seqs):
                # the filters act on the tempered distribution: temper first, then draw at T = 1
                greedy = temperatures < GREEDY_BELOW
                scaled = logits / torch.where(greedy, 1.0, temperatures).unsqueeze(1)
                scaled = self._filter(scaled, seqs)
                chosen = draw(scaled, (~greedy).float(), seeds)
                if any(t < GREEDY_BELOW for t in temps):  # a greedy row keeps the first argmax of its logits
                    chosen = torch.where(greedy, self._first_argmax(logits, raw, raw_best), chosen)
            else:
                chosen = draw(logits, temperatures, seeds)  # rows at T = 0 take the first argmax

        k_max = max((k for k in want if k is not None), default=None)
        top = None
        rows = _chosen_rows(raw, chosen, raw_lse)
        if k_max is not None:
            values, ids = raw.topk(max(k_max, 1), dim=-1)  # (N, k)
            top = (values - raw_lse.unsqueeze(1), ids, top_ranks(raw, values))  # logprobs, ids, ranks: (N, k)
            chosen_raw = raw.gather(1, chosen.unsqueeze(1))  # (N, 1)
            rows.append(token_ranks(raw, chosen_raw).squeeze(1).double())  # (N,) the chosen token's rank
        host = torch.stack(rows)  # (2 or 3, N)
        return DeviceSample(chosen, host, top, want)

    # ----- pieces --------------------------------------------------------------------
    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        rows = [i for i, s in enumerate(seqs) if uses_penalties(s.params)]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:  # NOTE: per row; penalties are rare and their token sets ragged
            p = seqs[i].params
            row = logits[i]
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(seqs[i].token_ids)), dtype=torch.long, device=logits.device)
                seen = seen[seen < self.vocab_size]
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            out = seqs[i].output_token_ids
            if out and (p.presence_penalty or p.frequency_penalty):
                ids = torch.tensor(out, dtype=torch.long, device=logits.device)
                counts = torch.bincount(ids, minlength=self.vocab_size)[: self.vocab_size].float()
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        return logits

    def _apply_min_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        # NOTE: num_tokens counts a token still pending on the device (async scheduling): the row
        # sampled now comes after it, so it counts toward min_tokens as it will once read back
        rows = [i for i, s in enumerate(seqs) if s.num_tokens - s.num_prompt_tokens < s.params.min_tokens]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            p = seqs[i].params
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
            banned = [t for t in banned if t < self.vocab_size]
            if banned:
                logits[i, banned] = float("-inf")
        return logits

    def _apply_vocabulary_rules(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """``logit_bias``, ``allowed_token_ids`` and ``bad_words``, for the rows that have them."""
        rows = [i for i, s in enumerate(seqs)
                if s.params.logit_bias or s.params.allowed_token_ids is not None or s.params.bad_words]
        if not rows:
            return logits
        logits = logits.clone()
        vocab = self.vocab_size
        for i in rows:  # NOTE: per row, like the penalties: rare, and each row's token set differs
            p, row = seqs[i].params, logits[i]
            if p.allowed_token_ids is not None:
                keep = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
                keep[[t for t in p.allowed_token_ids if t < vocab]] = True
                row.masked_fill_(~keep, float("-inf"))
            for token, bias in p.logit_bias.items():
                if token < vocab:
                    row[token] += bias
            if p.bad_words:
                out = seqs[i].output_token_ids
                for ids in self._bad_word_ids(p.bad_words):
                    prefix = ids[:-1]
                    if ids[-1] < vocab and (not prefix or out[-len(prefix):] == prefix):
                        row[ids[-1]] = float("-inf")
        return logits

    def _bad_word_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as tokens, alone and after a space (how it appears mid-text)."""
        key = tuple(words)
        if key not in self._bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words: this model has no tokenizer to turn words into tokens")
            found = []
            for word in words:
                for form in {word.lstrip(), " " + word.lstrip()}:
                    ids = self.tokenizer(form, add_special_tokens=False)["input_ids"]
                    if ids and ids not in found:
                        found.append(ids)
            self._bad_words[key] = found
        return self._bad_words[key]

    @staticmethod
    def _first_argmax(logits: torch.Tensor, raw: torch.Tensor, raw_best: torch.Tensor) -> torch.Tensor:
        """Each row's greedy token: the raw logits' (already found) unless penalties changed them."""
        return raw_best if logits is raw else logits.argmax(dim=-1)

    def _filters(self, seqs: list[Sequence]) -> bool:
        """Whether any row has a min-p, top-k or top-p filter."""
        return any(0 < s.params.top_k < self.vocab_size or s.params.top_p < 1.0 or s.params.min_p for s in seqs)

    def _row_seeds(self, seqs: list[Sequence]) -> list[int]:
        """One noise seed per row: from (seed, completion index, position) for a seeded request."""
        return [_mix(s.params.seed, s.index, s.num_tokens) if s.params.seed is not None else self._rng.getrandbits(63)
                for s in seqs]

    def _filter(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Drop what each row's min-p, top-k and top-p exclude (some row has a filter), in vLLM's
        order: min-p over the whole vocabulary, then top-k, then top-p over the tokens left."""
        width = logits.shape[1]
        # NOTE: a k past the vocabulary (vLLM takes any k) keeps every token
        top_k = [min(s.params.top_k, width) if s.params.top_k > 0 else width for s in seqs]
        top_p = [s.params.top_p for s in seqs]
        min_p = [s.params.min_p for s in seqs]
        dev = logits.device
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (N, V)
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool)  # (N, V)
        if any(min_p):
            # NOTE: min-p first, on the tempered probabilities of the whole vocabulary (vLLM's order;
            # HF's runs it last): top-p then measures mass among the tokens min-p kept, so it can keep fewer
            probs = torch.softmax(sorted_logits, dim=-1)  # (N, V)
            drop |= probs < probs[:, :1] * torch.tensor(min_p, device=dev).unsqueeze(1)
        # NOTE: top-k keeps every token tied with the k-th largest logit (as vLLM and HF do), not
        # exactly k: which of the tied ones a sort puts first is arbitrary (ties are common in bf16)
        kth = torch.tensor(top_k, device=dev).unsqueeze(1) - 1  # (N, 1)
        drop |= sorted_logits < sorted_logits.gather(1, kth)
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)  # (N, V)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= torch.tensor(top_p, device=dev).unsqueeze(1)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def uses_penalties(params) -> bool:
    """Whether sampling reads every earlier token (penalties, bad words of several tokens)."""
    return params.reads_history


def _mix(*values: int) -> int:
    h = 0
    for v in values:
        h = ((h ^ (v & 0xFFFFFFFFFFFFFFFF)) * _SEED_MIX + 1) & 0x7FFFFFFFFFFFFFFF
    return h
