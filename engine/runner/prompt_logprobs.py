"""Prompt logprobs: the logprob of each prompt token under the model, from the prompt's own logits.

The logits at prompt position ``p`` predict token ``p + 1``. A step that computes prompt
positions of a sequence that wants prompt logprobs (``Sequence.prompt_logprobs_from``)
sends those rows to the LM head too: the model runner appends them to the step's sampled
rows (``prompt_logit_positions`` says which, for the runner and the engine alike), and
``PromptLogprobs.launch`` reduces them on the device to each target token's logprob, rank
(``engine/runner/ranks.py``) and whether greedy decoding picks it, plus the top k, whose
read-back starts at once and is waited on in ``result()``.

NOTE: the cost. Each such row adds ``vocab`` float32 logits to the step (a 2,048-token
chunk of a 128k-vocabulary model: 1 GiB), which the KV-cache sizing does not reserve; the
reduction works through them in slices of ``_ROWS_PER_SLICE`` rows, so its temporaries stay
small. And a sequence never takes prefix-cache hits over the positions whose logprobs it
still wants (``Sequence.num_cacheable_tokens``): asking for a prompt's logprobs recomputes
the whole prompt, which a continuation only recomputes from the block holding its start.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.scheduler_output import ScheduledSeq, SchedulerOutput
from engine.core.sequence import Sequence
from engine.outputs import Logprob
from engine.runner.ranks import token_ranks, top_ranks

_ROWS_PER_SLICE = 512  # rows of logits reduced at once: bounds the log-softmax temporaries


def prompt_logit_positions(item: ScheduledSeq) -> range:
    """The prompt positions of this step of ``item.seq`` whose logits give a prompt logprob
    still wanted (each position ``p`` gives token ``p + 1``'s)."""
    seq = item.seq
    if seq.prompt_logprobs_from is None:
        return range(0)
    missing = seq.prompt_logprobs_from + len(seq.prompt_logprobs)
    low = max(item.num_computed_tokens, missing - 1)
    high = min(item.num_computed_tokens + item.num_new_tokens, seq.num_prompt_tokens - 1)
    return range(low, max(low, high))


def collect(seq: Sequence, first_token: int, entries: list[dict[int, Logprob]], greedy: list[bool]) -> None:
    """Append the entries of tokens ``first_token ..`` to ``seq.prompt_logprobs`` (and whether
    greedy decoding picks each to ``seq.prompt_greedy``), skipping any it already has (a prompt
    recomputed after a preemption)."""
    have = seq.prompt_logprobs_from + len(seq.prompt_logprobs)
    skip = have - first_token
    if 0 <= skip < len(entries):
        seq.prompt_logprobs.extend(entries[skip:])
        seq.prompt_greedy.extend(greedy[skip:])


@dataclass
class _Span:
    seq: Sequence
    first_token: int  # the prompt position of the span's first target token
    num_rows: int
    k: int  # top logprobs wanted beside the token's own


class PromptLogprobs:
    """One step's prompt logprobs, reduced on the device; ``result()`` waits for the read-back."""

    def __init__(self, spans: list[_Span], host: torch.Tensor, top: torch.Tensor | None,
                 event: "torch.cuda.Event | None") -> None:
        self._spans, self._host, self._top, self._event = spans, host, top, event

    @classmethod
    def launch(cls, scheduled: SchedulerOutput, logits: torch.Tensor) -> "PromptLogprobs | None":
        """Reduce ``logits`` (M, V) float32: the prompt rows of ``scheduled``, in
        ``prompt_logit_positions`` order; None when the step has none."""
        spans, targets = [], []
        for item in scheduled.scheduled:
            positions = prompt_logit_positions(item)
            if not positions:
                continue
            seq = item.seq
            spans.append(_Span(seq, positions.start + 1, len(positions), seq.params.prompt_logprobs or 0))
            targets += seq.token_ids[positions.start + 1 : positions.stop + 1]
        if not spans:
            return None
        if len(targets) != logits.shape[0]:
            raise RuntimeError(f"the step returned {logits.shape[0]} prompt rows for {len(targets)} prompt tokens")
        k = max(s.k for s in spans)
        target = torch.tensor(targets, dtype=torch.long).to(logits.device, non_blocking=True)  # (M,)
        host_rows, top_rows = [], []
        for lo in range(0, len(targets), _ROWS_PER_SLICE):
            rows = logits[lo : lo + _ROWS_PER_SLICE].float()  # (S, V)
            want = target[lo : lo + _ROWS_PER_SLICE].unsqueeze(1)  # (S, 1)
            lse = torch.logsumexp(rows, dim=-1, keepdim=True)  # (S, 1)
            picked = rows.gather(1, want)  # (S, 1)
            greedy = rows.argmax(dim=-1, keepdim=True) == want  # (S, 1): the first argmax, as greedy decoding picks
            host_rows.append(torch.cat([t.double() for t in (picked - lse, token_ranks(rows, picked), greedy)],
                                       dim=1))  # (S, 3)
            if k:
                values, ids = rows.topk(k, dim=-1)  # (S, k)
                top_rows.append(torch.cat([t.double() for t in (values - lse, ids, top_ranks(rows, values))],
                                          dim=1))  # (S, 3k)
        host = torch.cat(host_rows)  # (M, 3): logprob, rank, greedy
        top = torch.cat(top_rows) if k else None  # (M, 3k): logprobs, ids, ranks
        event = None
        if host.is_cuda:  # NOTE: pinned, non-blocking: the step goes on while these come back
            host, top = (_pinned_copy(t) if t is not None else None for t in (host, top))
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(logits.device))
        return cls(spans, host, top, event)

    def result(self) -> list[tuple[Sequence, int, list[dict[int, Logprob]], list[bool]]]:
        """Per span: the sequence, the position of its first token, one entry per token
        (``{token_id: Logprob}``: the prompt's token first, then the top k, most likely first)
        and whether greedy decoding picks each token."""
        if self._event is not None:
            self._event.synchronize()
        rows = self._host.tolist()
        top = self._top.tolist() if self._top is not None else None
        width = (len(top[0]) // 3) if top else 0
        found, at = [], 0
        for span in self._spans:
            entries, greedy = [], []
            for r in range(at, at + span.num_rows):
                logprob, rank, picked = rows[r]
                token = int(span.seq.token_ids[span.first_token + r - at])
                entry = {token: Logprob(logprob, int(rank))}
                for j in range(span.k):
                    entry.setdefault(int(top[r][width + j]), Logprob(top[r][j], int(top[r][2 * width + j])))
                entries.append(entry)
                greedy.append(bool(picked))
            found.append((span.seq, span.first_token, entries, greedy))
            at += span.num_rows
        return found

    def collect(self, detokenizer) -> None:
        """Wait for the read-back and append each span to its sequence's prompt logprobs, each
        token named by ``detokenizer`` (``engine.models.tokenizer.Detokenizer``)."""
        for seq, first_token, entries, greedy in self.result():
            if seq.params.prompt_logprobs is not None:  # NOTE: a scoring request's need no text
                for entry in entries:
                    detokenizer.name_tokens(entry)
            collect(seq, first_token, entries, greedy)


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    pinned.copy_(t, non_blocking=True)
    return pinned
