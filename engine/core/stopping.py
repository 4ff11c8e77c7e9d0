"""When a sequence is done: EOS, stop token ids, stop strings, length limits."""

from __future__ import annotations

from engine.core.sequence import Sequence


def at_length_limit(seq: Sequence, num_tokens: int, max_model_len: int) -> bool:
    """Whether a sequence of ``num_tokens`` tokens has reached ``max_tokens`` or the context."""
    max_tokens = seq.params.max_tokens
    return num_tokens >= max_model_len or (max_tokens is not None and num_tokens - seq.num_prompt_tokens >= max_tokens)


class StopChecker:
    def __init__(self, eos_token_ids: set[int], max_model_len: int) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def check(self, seq: Sequence, new_chars: int) -> bool:
        """Set ``finish_reason`` (and cut a stop string off the text) if ``seq`` is done."""
        p = seq.params
        token = seq.token_ids[-1]
        # NOTE: the tokens read back so far: under async scheduling the next step may
        # already have sampled one more, still pending
        num_tokens = len(seq.token_ids)
        if num_tokens - seq.num_prompt_tokens >= p.min_tokens:
            if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
                seq.finish_reason = "stop"
                if token in p.stop_token_ids:
                    seq.stop_reason = token
                # NOTE: as in vLLM, the stopping token's text is left out unless asked for
                if new_chars and not p.include_stop_str_in_output:
                    seq.text = seq.text[:-new_chars]
                return True
            if p.stop and self._cut_stop_string(seq, new_chars):
                return True
        if at_length_limit(seq, num_tokens, self.max_model_len):
            seq.finish_reason = "length"
            return True
        return False

    @staticmethod
    def _cut_stop_string(seq: Sequence, new_chars: int) -> bool:
        longest = max(len(s) for s in seq.params.stop)
        # only a match that ends in the new text is new: the text before had none
        start = max(0, len(seq.text) - new_chars - longest + 1)
        found = None
        for stop in seq.params.stop:
            at = seq.text.find(stop, start)
            if at != -1 and (found is None or at < found[0]):
                found = (at, stop)
        if found is None:
            return False
        keep = found[0] + (len(found[1]) if seq.params.include_stop_str_in_output else 0)
        seq.text = seq.text[:keep]
        seq.finish_reason, seq.stop_reason = "stop", found[1]
        return True

    @staticmethod
    def holdback(seq: Sequence) -> int:
        """Characters kept from streaming deltas: they may be the start of a stop string."""
        return max((len(s) for s in seq.params.stop), default=1) - 1
