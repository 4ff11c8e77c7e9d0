"""Reading a job's token stream exactly: every token once, whatever happened to workers.

Each entry of ``{prefix}:tokens:{id}`` written by a v1.1 worker carries ``offset``, the
number of tokens of its completion before the entry's own. A job's stream is never deleted
and refilled: a run that resumes the job after its worker died continues at the offset
where the stream stands, and a batch of deltas written twice after a lost reply repeats
offsets the reader already has. So the reader keeps, per completion, how many tokens it
has, drops an entry that brings none past that, and stops reading a completion at its first
``finish_reason`` (PROTOCOL.md, "Streaming tokens", says the same for other languages).
"""

from __future__ import annotations

from producers.protocol import TokenDelta
from producers.protocol.statuses import TERMINAL_STATUSES, Status

# finish_reason values that end a job's whole stream: its closing entry names how it ended
CLOSING_REASONS = frozenset(s.value for s in TERMINAL_STATUSES if s is not Status.DONE)


class ExactDeltas:
    """The rule one stream reader applies to each entry, in stream order."""

    def __init__(self) -> None:
        self.tokens: dict[int, int] = {}  # completion -> tokens taken so far
        self.finished: set[int] = set()  # completions whose finish_reason was taken
        self.seen: set[int] = set()  # completions with at least one entry
        self.job_ended = False  # a closing entry named the job's terminal status

    def take(self, delta: TokenDelta) -> TokenDelta | None:
        """``delta`` trimmed to what is new, or None when it brings nothing new."""
        index = delta.index
        if index in self.finished or self.job_ended:
            return None
        self.seen.add(index)
        have = self.tokens.get(index, 0)
        if delta.offset is not None and delta.offset < have:
            new = delta.token_ids[have - delta.offset:]
            if not new and delta.finish_reason is None:
                return None  # a repeat: every token of it is already here
            # NOTE: a worker never writes an entry that overlaps part of another, so an entry
            # that starts before what the reader has is a repeat; its text was taken with it.
            logprobs = delta.logprobs[have - delta.offset:] if delta.logprobs is not None else None
            delta = delta.model_copy(update={"offset": have, "token_ids": new, "text": "", "logprobs": logprobs,
                                             "prompt_text": None, "prompt_first_token": None,
                                             "prompt_logprobs": None})  # the prompt came with the first
        self.tokens[index] = have + len(delta.token_ids)
        if delta.finish_reason is not None:
            self.finished.add(index)
            if delta.finish_reason in CLOSING_REASONS:
                self.job_ended = True  # cancelled, failed, expired: no completion goes on
        return delta

    @property
    def complete(self) -> bool:
        """Whether every completion seen has finished, or the job ended without finishing."""
        return self.job_ended or bool(self.seen) and self.finished >= self.seen
