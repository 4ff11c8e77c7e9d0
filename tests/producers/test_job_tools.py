"""Protocol v1.3's tool calling on the wire: a job's ``tools`` and its messages' tool calls."""

from __future__ import annotations

import json

import pytest

from producers.errors import InvalidJob
from producers.jobs import make_job
from producers.protocol import ProtocolError, parse_job

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CHAT = [{"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "20 C"}]


def test_tools_and_tool_calls_cross_the_wire_as_given_and_reach_the_template_without_nulls():
    job = make_job(messages=CHAT, tools=[WEATHER])
    read = parse_job(job.to_json())  # what a worker reads
    assert read == job
    assert read.template_tools() == [WEATHER]
    assert read.template_messages() == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [CALL]},  # arguments stay OpenAI's string; the renderer parses them
        {"role": "tool", "tool_call_id": "call_1", "content": "20 C"}]
    # an assistant message with tool calls may leave its content out, as OpenAI's may
    assert make_job(messages=[CHAT[0], {"role": "assistant", "tool_calls": [CALL]}]).messages[1].content is None


def test_a_job_without_tools_is_written_as_a_1_2_worker_reads_it():
    wire = json.loads(make_job(messages=[CHAT[0]], sampling={"max_tokens": 3}).to_json())
    assert "tools" not in wire and wire["messages"] == [CHAT[0]]
    wire = json.loads(make_job(messages=CHAT, tools=[WEATHER]).to_json())
    assert wire["messages"][0] == CHAT[0] and wire["messages"][2]["tool_call_id"] == "call_1"
    assert wire["tools"][0]["function"]["parameters"] == WEATHER["function"]["parameters"]


@pytest.mark.parametrize("change, message", [
    (dict(tools=[WEATHER, WEATHER]), "tools.1.function.name: 'get_weather' is declared twice (first at tools.0)"),
    (dict(tools=[{"type": "function", "function": {"name": "get weather"}}]),
     "tools.0.function.name: 'get weather' is not a function name: 1 to 64 characters from a-z A-Z 0-9 _ -"),
    (dict(tools=[{"type": "function", "function": {"name": "f" * 65}}]), "tools.0.function.name"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]),
     "tools.0.function.parameters: must be the JSON Schema of an object"),
    (dict(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]),
     "tools: 129 tools is over the limit of 128 (MAX_TOOLS)"),
    (dict(tools=[]), "tools: must hold at least one tool"),
    (dict(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools.0.type"),
    (dict(messages=[{"role": "user", "content": "x", "tool_calls": [CALL]}]),
     "messages.0.tool_calls: only an assistant message makes tool calls"),
    (dict(messages=[{"role": "user", "content": "x", "tool_call_id": "call_1"}]),
     "messages.0.tool_call_id: only a tool message answers a tool call"),
    (dict(messages=[{"role": "assistant", "content": None}]),
     "messages.0.content: missing: a string (null or absent only on an assistant message with tool_calls)"),
    (dict(messages=[{"role": "assistant", "content": None, "tool_calls": [
        {**CALL, "function": {"name": "get_weather", "arguments": "{city: Paris}"}}]}]),
     "messages.0.tool_calls.0.function.arguments: not valid JSON"),
    (dict(messages=[{"role": "assistant", "content": None, "tool_calls": [
        {**CALL, "function": {"name": "get_weather", "arguments": "[1]"}}]}]),
     "messages.0.tool_calls.0.function.arguments: must hold a JSON object"),
])
def test_bad_tools_and_tool_calls_name_the_field(change, message):
    job = {"messages": CHAT, "tools": [WEATHER], **change}
    with pytest.raises(InvalidJob) as caught:
        make_job(**job)
    assert message in str(caught.value)
    raw = json.dumps({"v": 1, "id": "j-1", **job})  # a worker refuses the same entry the same way
    with pytest.raises(ProtocolError) as refused:
        parse_job(raw)
    assert message in str(refused.value) and refused.value.job_id == "j-1"


def test_tools_need_a_chat_job():
    with pytest.raises(InvalidJob, match="tools: only a chat job"):
        make_job("a prompt", tools=[WEATHER])


# the job fields of revision 1.1 (PROTOCOL.md): what a 1.1 worker, which refuses any other, reads
FIELDS_OF_1_1 = {"v", "id", "prompt", "prompt_token_ids", "messages", "sampling", "priority", "deadline", "stream",
                 "metadata"}


# the sampling fields the first 1.1 workers knew (a1bab67): they refused a job naming any other
SAMPLING_OF_1_1 = {"n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens",
                   "logprobs", "skip_special_tokens"}


@pytest.mark.parametrize("given", [dict(prompt="x"), dict(prompt_token_ids=[1, 2]), dict(messages=[CHAT[0]])])
def test_a_job_of_no_later_field_is_written_with_the_fields_of_1_1_alone(given):
    job = make_job(**given, sampling={"max_tokens": 3, "temperature": 0.5, "detokenize": True})
    wire = json.loads(job.to_json())
    assert set(wire) <= FIELDS_OF_1_1, set(wire) - FIELDS_OF_1_1  # was: "score": null in every job
    # was: every sampling field, structured_outputs: null and detokenize: true among them
    assert wire["sampling"] == {"max_tokens": 3, "temperature": 0.5}
    assert parse_job(job.to_json().encode()) == job  # the worker's defaults fill in the rest
    given_later = make_job(**given, sampling={"detokenize": False, "structured_outputs": {"choice": ["a"]}})
    assert set(json.loads(given_later.to_json())["sampling"]) - SAMPLING_OF_1_1 == {"detokenize", "structured_outputs"}
    assert all(set(m) <= {"role", "content"} for m in wire["messages"] or [])
    scoring = json.loads(make_job(prompt="x", score={"continuations": [" a"]}).to_json())
    assert set(scoring) - FIELDS_OF_1_1 == {"score"}
