"""The official OpenAI SDK (sync, async, streaming) and raw HTTP against a real gateway and worker."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from engine import SamplingParams
from tests.gateway.conftest import ALICE, MODEL

PROMPT = "The quick brown fox"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
TOKENS = 12


def sync_client(stack, key=ALICE) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.gateway.url + "/v1", api_key=key, max_retries=0, timeout=60)


def greedy(max_tokens: int = TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def test_models_lists_what_live_workers_serve(stack):
    listed = sync_client(stack).models.list()
    assert [m.id for m in listed.data] == [MODEL, "parked"]  # "gone" has no live worker
    assert sync_client(stack).models.retrieve(MODEL).owned_by == "sluiceway"
    assert httpx.get(stack.gateway.url + "/health").json() == {"status": "ok"}


def test_completion_and_chat_equal_offline_greedy(any_stack, offline):
    client = sync_client(any_stack)
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True})
    expected = offline.generate([PROMPT], greedy(), use_tqdm=False)[0]
    assert done.choices[0].text == expected.outputs[0].text
    assert done.object == "text_completion" and done.model == MODEL and done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == TOKENS
    assert done.usage.prompt_tokens == len(expected.prompt_token_ids)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True})
    expected_chat = offline.chat(CHAT, greedy(), use_tqdm=False)[0]
    assert chat.choices[0].message.content == expected_chat.outputs[0].text
    assert chat.choices[0].message.role == "assistant" and chat.object == "chat.completion"
    assert chat.usage.prompt_tokens == len(expected_chat.prompt_token_ids)


def test_completions_max_tokens_null_is_the_default_16_as_omitted(stack):
    """The SDK sends a None as null, which OpenAI reads as not given; it ran to the end of the context."""
    client = sync_client(stack)
    for given in ({}, {"max_tokens": None}):
        done = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True},
                                         **given)
        assert done.usage.completion_tokens == 16 and done.choices[0].finish_reason == "length"


def test_streamed_chunks_join_to_the_unstreamed_text(any_stack):
    client = sync_client(any_stack)
    args = dict(model=MODEL, messages=CHAT, max_tokens=TOKENS, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**args).choices[0].message.content
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == TOKENS
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    unstreamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == unstreamed.choices[0].text


def test_async_client_with_n_seed_and_sampling_fields(stack):
    async def run():
        async with openai.AsyncOpenAI(base_url=stack.gateway.url + "/v1", api_key=ALICE, max_retries=0) as client:
            args = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.9, top_p=0.9, seed=7, n=2,
                        presence_penalty=0.5, frequency_penalty=0.5, stop=["\n\n"],
                        extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1})
            first, second = await asyncio.gather(client.completions.create(**args), client.completions.create(**args))
            stream = await client.completions.create(**args, stream=True)
            texts = {0: "", 1: ""}
            async for chunk in stream:
                for choice in chunk.choices:
                    texts[choice.index] += choice.text
            return first, second, texts

    first, second, texts = asyncio.run(run())
    assert len(first.choices) == 2 and [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]  # seeded: the same samples
    assert [texts[0], texts[1]] == [c.text for c in first.choices]


def test_sse_framing_over_raw_http(stack):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", stack.gateway.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {ALICE}"}) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        raw = reply.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} and chunks[0]["id"].startswith("cmpl-")
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["usage"]["completion_tokens"] == 5
    assert chunks[-1]["usage"]["total_tokens"] == chunks[-1]["usage"]["prompt_tokens"] + 5


def test_response_format_gives_valid_json(stack):
    import engine

    if not hasattr(engine, "StructuredOutputsParams"):
        pytest.skip("structured outputs (engine.StructuredOutputsParams) are not merged into this tree yet")
    import jsonschema

    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    client = sync_client(stack)
    reply = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=100, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert reply.choices[0].finish_reason == "stop"  # the constraint completed
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    loose = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=300, temperature=0,
                                           response_format={"type": "json_object"})
    assert loose.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(loose.choices[0].message.content), dict)


def test_metrics_count_requests(stack):
    sync_client(stack).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    text = httpx.get(stack.gateway.url + "/metrics").text
    assert 'sluiceway_gateway_requests_total{endpoint="completion",status="200"}' in text
    assert "sluiceway_gateway_request_seconds_bucket" in text


def test_logprobs_whole_and_streamed(stack):
    from producers.protocol import Completion

    if "top_logprobs" not in Completion.model_fields:
        pytest.skip("logprobs with text (protocol 1.2, Completion.top_logprobs) are not merged into this tree yet")
    client = sync_client(stack)
    args = dict(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**args).choices[0]
    content = whole.logprobs.content
    assert len(content) == 6 and all(len(e.top_logprobs) == 2 for e in content)
    assert all(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in content)
    # the tokens' exact bytes make the text (a partial character at the end is held back from the text)
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace").startswith(whole.message.content)
    streamed = [e for c in client.chat.completions.create(**args, stream=True) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    legacy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logprobs=2, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].logprobs
    assert len(legacy.tokens) == len(legacy.token_logprobs) == len(legacy.top_logprobs) == 4
    assert legacy.text_offset[0] == 0 and all(len(top) <= 2 for top in legacy.top_logprobs)


def test_legacy_top_logprobs_count_the_sampled_token(stack):
    from producers.protocol import Completion

    if "top_logprobs" not in Completion.model_fields:
        pytest.skip("logprobs with text (protocol 1.2, Completion.top_logprobs) are not merged into this tree yet")
    client = sync_client(stack)
    # sampled at temperature 1 from the tiny model, most tokens are not its single most likely one
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1, seed=0, logprobs=1,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**args).choices[0].logprobs
    streamed = [c.choices[0].logprobs for c in client.completions.create(**args, stream=True)
                if c.choices and c.choices[0].logprobs]
    for logprobs in (whole, *streamed):
        # was: the top one alone, so the sampled token's rivals could not be read against it
        assert all(token in top and len(top) <= 2 for token, top in zip(logprobs.tokens, logprobs.top_logprobs))
    assert any(len(top) == 2 for top in whole.top_logprobs)  # some sampled token was not the most likely
    assert [t for s in streamed for t in s.top_logprobs] == whole.top_logprobs


def test_streamed_legacy_logprobs_have_the_whole_responses_text_offsets(stack):
    from producers.protocol import Completion

    if "top_logprobs" not in Completion.model_fields:
        pytest.skip("logprobs with text (protocol 1.2, Completion.top_logprobs) are not merged into this tree yet")
    client = sync_client(stack)
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, logprobs=1,
                extra_body={"ignore_eos": True})
    tokens = client.completions.create(**args).choices[0].logprobs.tokens
    # a chunk's text lags its tokens: a partial character waits for its next bytes, and the
    # first token of a two-token stop string for the second (was it the stop string?)
    k = next(i for i in range(2, len(tokens) - 1) if "\ufffd" not in tokens[i] + tokens[i + 1])
    whole = client.completions.create(**args, stop=tokens[k] + tokens[k + 1]).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**args, stop=tokens[k] + tokens[k + 1], stream=True)]
    assert "".join(c.text for c in chunks) == whole.text and whole.finish_reason == "stop"
    # was: each chunk's offsets began at the text sent before it, short by the text held back
    assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == whole.logprobs.text_offset
    assert [t for c in chunks if c.logprobs for t in c.logprobs.tokens] == whole.logprobs.tokens
