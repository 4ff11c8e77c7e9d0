"""Logprobs as the OpenAI API shapes them: ``producers.openai_logprobs``, shared with ``bulk --format openai``."""

from producers.openai_logprobs import chat_logprobs, completion_logprobs, plain

__all__ = ["chat_logprobs", "completion_logprobs", "plain"]
