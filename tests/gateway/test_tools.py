"""Tool calling through the official SDK, the gateway and a real worker on the tiny model.

The tiny model is random: what it calls is noise, but a required or named tool choice is
constrained decoding, so its calls always parse and validate against the tool's parameters.
An auto tool choice is the model's own text, read by the hermes parser, the gateway's for tiny
(``--tool-call-parser tiny=hermes`` over a default of llama3_json); here the text is forced
(vLLM's ``structured_outputs`` choice) to hold a ``<tool_call>`` block."""

from __future__ import annotations

import io
import json
import select
import socket

import jsonschema
import openai

from engine import SamplingParams
from producers.bulk_openai import OpenAIBulk
from producers.client import Client
from tests.gateway.conftest import BOB, MODEL, wait_for

CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}
DAYS = {"type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7},
                                         "note": {"type": "string", "maxLength": 12},
                                         "hourly": {"type": "boolean"}},
        "required": ["days", "hourly"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather now",
                                           "parameters": CITY}},
         {"type": "function", "function": {"name": "get_forecast", "parameters": DAYS}}]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_forecast"}}
WRITTEN = '{"city": "Paris",  "unit": "celsius"}'  # as a model writes them: json.dumps would give one space
FORCED = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": ' + WRITTEN + '}\n</tool_call>'
LLAMA_FORCED = '{"name": "get_weather", "parameters": ' + WRITTEN + '}'  # the same call as llama3_json writes it


def client_of(stack) -> openai.OpenAI:
    return stack.gateway.client(BOB)  # NOTE: bob has no limit on unanswered requests (alice's is 2)


def check_call(call, name: str | None = None) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert name is None or call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_required_and_named_tool_choice_answer_calls_valid_against_the_parameters(stack):
    client = client_of(stack)
    for seed in range(3):  # sampled: different calls, each valid
        reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, max_tokens=120, temperature=1, seed=seed)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        check_call(choice.message.tool_calls[0])
    named = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                           max_tokens=120, temperature=1, seed=5).choices[0]
    assert named.finish_reason == "stop" and named.message.content is None  # OpenAI's and vLLM's for a named one
    check_call(named.message.tool_calls[0], "get_forecast")


def test_a_streamed_named_call_sends_its_arguments_as_they_come(stack):
    chunks = list(client_of(stack).chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                                           max_tokens=120, temperature=0, stream=True))
    entries = [e for c in chunks if c.choices for e in (c.choices[0].delta.tool_calls or [])]
    assert entries[0].index == 0 and entries[0].id.startswith("call_") and entries[0].function.name == "get_forecast"
    assert len(entries) > 1 and all(e.index == 0 and e.id is None for e in entries[1:])  # the arguments, piece by piece
    arguments = "".join(e.function.arguments for e in entries)
    jsonschema.validate(json.loads(arguments), DAYS)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_streamed_named_and_required_calls_send_their_arguments_as_they_come_as_the_whole_answer_has_them(stack):
    client = client_of(stack)
    for choice in (NAMED, "required"):
        args = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                    max_tokens=120, temperature=0)
        [whole] = client.chat.completions.create(**args).choices[0].message.tool_calls
        chunks = [c for c in client.chat.completions.create(**args, stream=True) if c.choices]
        at = [(i, e) for i, c in enumerate(chunks) for e in c.choices[0].delta.tool_calls or []]
        (opened, first), fragments = at[0], [e for _, e in at[1:]]
        assert (first.index, first.type, first.function.name) == (0, "function", whole.function.name)
        assert len(first.id) == 29 and first.id.startswith("call_") and first.id != whole.id
        assert fragments and all((e.index, e.id, e.type, e.function.name) == (0, None, None, None) for e in fragments)
        # the first piece came in an earlier chunk than the last one (NOTE: under load the worker's
        # stream writes coalesce, and the last piece may share the chunk that ends the answer)
        assert opened < at[-1][0]
        assert not any(c.choices[0].delta.content for c in chunks)  # the answer is the call: no text around it
        arguments = "".join(e.function.arguments for _, e in at)
        assert arguments == whole.function.arguments, choice  # as the whole answer has them, character for character
        jsonschema.validate(json.loads(arguments), PARAMETERS[first.function.name])
        reason = chunks[-1].choices[0].finish_reason
        assert reason == ("stop" if choice == NAMED else "tool_calls")


def test_auto_tool_choice_streams_the_text_then_the_calls_arguments_as_the_model_writes_them(stack):
    client = client_of(stack)
    args = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200, temperature=0,
                extra_body={"structured_outputs": {"choice": [FORCED]}})  # the answer a tool model would give
    whole = client.chat.completions.create(**args).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Let me check.\n"
    [call] = whole.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", WRITTEN)  # as written, not re-serialized
    chunks = [c for c in client.chat.completions.create(**args, stream=True) if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    at = [(i, e) for i, d in enumerate(deltas) for e in d.tool_calls or []]
    (opened, first), fragments = at[0], [e for _, e in at[1:]]
    assert "".join(d.content or "" for d in deltas[:opened]) == "Let me check.\n"  # the text first, as content
    assert len([d for d in deltas[:opened] if d.content]) > 1  # streamed, not held to the end
    assert not any(d.content for d in deltas[opened:])  # the template's newlines around the block are no content
    assert (first.index, first.type, first.function.name) == (0, "function", "get_weather")
    assert len(first.id) == 29 and first.id.startswith("call_") and first.id != call.id
    assert len(fragments) > 1 and all((e.index, e.id, e.type, e.function.name) == (0, None, None, None)
                                      for e in fragments)  # the arguments, piece by piece
    assert opened < at[-1][0] < len(chunks) - 1  # the first piece came well before the answer's last token
    assert "".join(e.function.arguments for _, e in at) == call.function.arguments  # character for character
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    plain = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=4, temperature=0,
                                           extra_body={"ignore_eos": True}).choices[0]
    assert plain.message.tool_calls is None and plain.finish_reason == "length"  # no call written: content


def test_a_call_cut_by_max_tokens_streams_what_the_whole_answer_holds(stack):
    """One generation cut in its call's arguments, whole and streamed: finish_reason length, the
    call as far as it got, the same content (OpenAI's answer to a call max_tokens cut)."""
    client = client_of(stack)
    for choice in ({"tool_choice": "required", "parallel_tool_calls": False},
                   {"extra_body": {"structured_outputs": {"choice": [FORCED]}}}):  # auto: read by hermes
        args = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, **choice)
        full = client.chat.completions.create(**args, max_tokens=200, logprobs=True).choices[0]
        [written] = full.message.tool_calls
        tokens = [t.token for t in full.logprobs.content]
        text, arguments = "".join(tokens), written.function.arguments
        middle = text.index(arguments) + len(arguments) // 2
        args["max_tokens"] = next(k for k in range(len(tokens)) if len("".join(tokens[:k])) > middle)
        whole = client.chat.completions.create(**args).choices[0]
        [call] = whole.message.tool_calls  # the call as far as it got, not the answer's text as content
        assert whole.finish_reason == "length" and call.function.name == written.function.name
        assert 0 < len(call.function.arguments) < len(arguments) and arguments.startswith(call.function.arguments)
        assert whole.message.content == full.message.content  # None, or the text before the call
        chunks = [c for c in client.chat.completions.create(**args, stream=True) if c.choices]
        deltas = [c.choices[0].delta for c in chunks]
        entries = [e for d in deltas for e in d.tool_calls or []]
        assert [e.function.name for e in entries if e.function.name] == [call.function.name] and len(entries) > 2
        assert "".join(e.function.arguments or "" for e in entries) == call.function.arguments, choice
        assert ("".join(d.content or "" for d in deltas) or None) == whole.message.content, choice
        assert chunks[-1].choices[0].finish_reason == "length"


def test_each_model_reads_its_auto_calls_with_its_own_parser(stack):
    """The stack's gateway has ``--tool-call-parser llama3_json --tool-call-parser tiny=hermes``:
    tiny's calls are read by hermes, its own (the tests above, whole and streamed), and an answer
    of llama3_json's form is its content, whole and streamed; parked, with no parser of its own,
    gets the default, llama3_json."""
    client = client_of(stack)
    args = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200, temperature=0,
                extra_body={"structured_outputs": {"choice": [LLAMA_FORCED]}})
    whole = client.chat.completions.create(**args).choices[0]
    assert (whole.finish_reason, whole.message.content, whole.message.tool_calls) == ("stop", LLAMA_FORCED, None)
    chunks = [c for c in client.chat.completions.create(**args, stream=True) if c.choices]
    assert not any(c.choices[0].delta.tool_calls for c in chunks) and chunks[-1].choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == LLAMA_FORCED
    assert parked_parser(stack) == "llama3_json"


def parked_parser(stack) -> str:
    """The parser the job of an auto tool choice for ``parked`` (whose queue nobody reads) carries,
    read off its queue while its request waits; the request then leaves and its job is cancelled."""
    body = json.dumps({"model": "parked", "messages": ASK, "tools": TOOLS, "max_tokens": 4}).encode()
    with socket.create_connection(("127.0.0.1", stack.gateway.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {BOB}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        [(_, entry)] = wait_for(lambda: not answered(sock) and stack.r.xrange(stack.keys.queue("parked")),
                                timeout=20, what="parked's job")
    wait_for(lambda: stack.r.xlen(stack.keys.queue("parked")) == 0, timeout=20, what="parked's job cancelled")
    return json.loads(entry["job"])["metadata"]["gateway"]["tools"]["parser"]


def answered(sock: socket.socket) -> bool:
    """False while a request waits; an ``AssertionError`` holding its answer once one came."""
    if select.select([sock], [], [], 0)[0]:
        raise AssertionError(f"the request was answered: {sock.recv(4096).decode(errors='replace')}")
    return False


def test_tools_and_tool_turns_reach_the_chat_template_as_offline(stack, offline):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    turns = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_1", "content": "20 degrees"}]
    reply = client_of(stack).chat.completions.create(model=MODEL, messages=turns, tools=TOOLS, tool_choice="none",
                                                     max_tokens=3, temperature=0)
    expected = offline.chat(turns, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False, tools=TOOLS)[0]
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert reply.choices[0].message.content == expected.outputs[0].text and reply.choices[0].message.tool_calls is None
    bare = offline.chat(turns, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    assert len(bare.prompt_token_ids) < reply.usage.prompt_tokens  # the tools are in the prompt


def test_a_batch_line_with_a_named_tool_choice_answers_a_valid_call(stack, tmp_path):
    """The Batch API and ``sluiceway bulk --format openai`` share the translation: one line of each."""
    line = {"custom_id": "tool-1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 120}}
    client = client_of(stack)
    upload = client.files.create(file=("in.jsonl", io.BytesIO(json.dumps(line).encode() + b"\n")), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_for(lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b, timeout=60,
                    what="the batch to complete")
    in_path, out_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    in_path.write_text(json.dumps(line) + "\n")
    with Client(stack.redis_url) as producer:
        assert OpenAIBulk(producer, in_path, out_path, timeout=60).run().complete
    for answered in (client.files.content(done.output_file_id).text, out_path.read_text()):
        [choice] = json.loads(answered)["response"]["body"]["choices"]
        assert choice["finish_reason"] == "stop" and choice["message"]["content"] is None
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_forecast" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), DAYS)
