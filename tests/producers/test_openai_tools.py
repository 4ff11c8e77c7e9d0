"""OpenAI tool calling's translation: tools / tool_choice / parallel_tool_calls as a job, and
answers (whole and streamed) as tool calls. The end-to-end path is tests/gateway/test_tools.py."""

from __future__ import annotations

import json

import jsonschema
import pytest

from producers.openai_errors import RequestError
from producers.openai_format import batch_jobs, translate_request
from producers.openai_responses import translate_result
from producers.openai_tools import ToolDeltas, finish_reason, required_schema

CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": CITY}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}}, "$defs": {"zone": {"enum": ["CET", "UTC"]}}}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def chat(parser: str | None = None, **fields):
    return translate_request("chat", {"model": "m", "messages": USER, "tools": [WEATHER, TIME], **fields},
                             tool_parser=parser)


def result_of(req, text: str, reason: str = "stop") -> dict:
    return {"id": "j1", "text": text, "outputs": [{"text": text, "token_ids": [1], "finish_reason": reason}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1}, "metadata": req.job["metadata"]}


def test_the_job_carries_the_tools_and_a_required_choice_its_schema():
    req = chat(tool_choice="required", parallel_tool_calls=False)
    job = req.to_job()
    assert [t.function.name for t in job.tools] == ["get_weather", "get_time"]
    schema = job.sampling["structured_outputs"]["json"]
    assert schema["maxItems"] == 1 and schema["minItems"] == 1 and schema["$defs"] == {"zone": {"enum": ["CET", "UTC"]}}
    jsonschema.validate([{"name": "get_time", "parameters": {"zone": "UTC"}}], schema)
    with pytest.raises(jsonschema.ValidationError):  # a name of no tool
        jsonschema.validate([{"name": "get_date", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):  # another tool's arguments
        jsonschema.validate([{"name": "get_weather", "parameters": {"zone": "UTC"}}], schema)
    assert "maxItems" not in required_schema([WEATHER, TIME], parallel=True)
    named = chat(tool_choice={"type": "function", "function": {"name": "get_weather"}}).to_job()
    assert named.sampling["structured_outputs"]["json"] == CITY  # the function's arguments, no more


def test_auto_needs_the_flag_and_none_shows_the_tools_alone():
    with pytest.raises(RequestError) as caught:
        chat()  # tools without tool_choice: auto, as vLLM reads it
    assert caught.value.param == "tool_choice" and "--enable-auto-tool-choice" in caught.value.message
    auto = chat("hermes", tool_choice="auto")
    assert auto.job["sampling"]["skip_special_tokens"] is False  # as vLLM's hermes parser asks
    assert auto.job["metadata"]["gateway"]["tools"] == {"mode": "auto", "parallel": True, "parser": "hermes"}
    none = chat(tool_choice="none")
    assert none.job["tools"] and "tools" not in none.job["metadata"]["gateway"]
    assert "structured_outputs" not in none.job["sampling"]


@pytest.mark.parametrize("fields, param, message", [
    (dict(tools=[WEATHER, WEATHER]), "tools.1.function.name", "'get_weather' is declared twice (first at tools.0)"),
    (dict(tools=[WEATHER, {"type": "function", "function": {"name": "x" * 65}}]), "tools.1.function.name",
     "1 to 64 characters"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]),
     "tools.0.function.parameters", "must be the JSON Schema of an object"),
    (dict(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]), "tools",
     "129 tools is over the limit of 128 (MAX_TOOLS)"),
    (dict(tools=[{"type": "custom", "custom": {"name": "f"}}]), "tools.0.type", 'must be "function"'),
    (dict(tool_choice={"type": "function", "function": {"name": "get_date"}}), "tool_choice.function.name",
     "'get_date' is not one of the tools (get_weather, get_time)"),
    (dict(tool_choice="any"), "tool_choice", 'must be "none", "auto", "required"'),
    (dict(tools=None, tool_choice="required"), "tool_choice", "needs tools"),
    (dict(parallel_tool_calls="no"), "parallel_tool_calls", "must be a boolean"),
    (dict(tool_choice="required", response_format={"type": "json_object"}), "response_format", "not both"),
    (dict(tool_choice="required", tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "not": {}}}}]), "tools.0.function.parameters.not", "not supported in structured outputs"),
    (dict(messages=[*USER, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": "{city"}}]}], tool_choice="none"),
     "messages.1.tool_calls.0.function.arguments", "not valid JSON"),
    (dict(messages=[{"role": "user", "content": "x", "tool_calls": [{"id": "c"}]}], tool_choice="none"),
     "messages.0.tool_calls", "only an assistant message makes tool calls"),
    (dict(function_call="auto"), "function_call", "send tool_choice"),
])
def test_bad_tool_fields_are_400s_naming_the_field_and_the_limit(fields, param, message):
    with pytest.raises(RequestError) as caught:
        chat(**fields)
    assert caught.value.param == param and message in caught.value.message, caught.value.message


def test_tool_turns_pass_to_the_job_unchanged_in_structure():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "20 C"}]}]
    job = chat(messages=messages, tool_choice="none").to_job()
    assert job.template_messages()[1:] == [{"role": "assistant", "tool_calls": [call]},
                                           {"role": "tool", "tool_call_id": "call_1", "content": "20 C"}]


def test_answers_become_tool_calls_with_ids_and_arguments_as_json_strings():
    required = translate_result(result_of(chat(tool_choice="required"),
                                          '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, '
                                          '{"name": "get_time", "parameters": {"zone": "CET"}}]'))
    choice = required["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "get_weather", {"city": "Oslo"}), ("function", "get_time", {"zone": "CET"})]
    assert all(c["id"].startswith("call_") and len(c["id"]) == 29 for c in calls) and calls[0]["id"] != calls[1]["id"]
    named = translate_result(result_of(chat(tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                                       '{"city": "Paris"}'))["choices"][0]
    assert named["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert named["finish_reason"] == "stop"  # OpenAI's and vLLM's for a named function
    cut = translate_result(result_of(chat(tool_choice="required"), '[{"name": "get_wea', "length"))["choices"][0]
    assert cut == {**cut, "finish_reason": "length", "message": {"role": "assistant", "content": '[{"name": "get_wea'}}
    auto = chat("hermes", parallel_tool_calls=False)
    text = 'Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' \
           '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    message = translate_result(result_of(auto, text))["choices"][0]["message"]
    assert message["content"] == "Checking. " and len(message["tool_calls"]) == 1  # no parallel calls: the first
    plain = translate_result(result_of(auto, "No tool needed."))["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": "No tool needed."} and plain["finish_reason"] == "stop"


def test_streamed_deltas_send_content_then_each_call_with_index_id_and_name():
    deltas = ToolDeltas({"mode": "auto", "parser": "hermes", "parallel": True})
    sent = [deltas.feed(t) for t in ("Let me", " check. <tool_", 'call>{"name": "get_weather", "arguments": ',
                                     '{"city": "Paris"}}</tool_call>\n<tool_call>{"name": "get_time"}</tool_call>')]
    sent.append(deltas.finish())
    # the space before the call is the text's (held back until the call showed it was no call's)
    assert [d.get("content") for d in sent] == ["Let me", " check.", " ", None, None]
    # each call opens once its name is known, with its index, id, type and name; then its arguments
    assert [[{**c, "id": c.get("id", "")[:5]} for c in d.get("tool_calls", [])] for d in sent] == [[], [], [
        {"index": 0, "id": "call_", "type": "function", "function": {"name": "get_weather", "arguments": ""}}], [
        {"index": 0, "id": "", "function": {"arguments": '{"city": "Paris"}'}},
        {"index": 1, "id": "call_", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}], []]
    assert deltas.called
    named = ToolDeltas({"mode": "named", "name": "get_weather"})
    first, second = named.feed('{"city": '), named.feed('"Oslo"}')
    assert first["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": '}
    assert second == {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]} and named.finish() == {}


def test_a_streamed_required_answer_sends_a_call_once_its_name_is_known_then_its_arguments_as_they_come():
    required = ToolDeltas({"mode": "required", "parallel": True})
    assert required.feed('[{"name": "get_wea') == {} and not required.called  # no name yet: nothing to send
    [opening] = required.feed('ther", "parameters": {"ci')["tool_calls"]
    assert opening["id"].startswith("call_") and required.called
    assert opening == {"index": 0, "id": opening["id"], "type": "function",
                       "function": {"name": "get_weather", "arguments": '{"ci'}}
    rest, second = required.feed('ty":  "Oslo"}}, {"name": "get_time", "parameters": {}}]')["tool_calls"]
    assert rest == {"index": 0, "function": {"arguments": 'ty":  "Oslo"}'}}  # no id, no name: a fragment
    assert (second["index"], second["function"]) == (1, {"name": "get_time", "arguments": "{}"})
    assert required.finish() == {}
    text = '[{"name": "get_weather", "parameters": {"city":  "Oslo"}}, {"name": "get_time", "parameters": {}}]'
    whole = translate_result(result_of(chat(tool_choice="required"), text))["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["arguments"] for c in whole] == ['{"city":  "Oslo"}', "{}"]  # as written, as streamed
    single = ToolDeltas({"mode": "required", "parallel": False})
    assert [e["index"] for e in single.feed(text)["tool_calls"]] == [0]  # no parallel calls: the first
    cut = ToolDeltas({"mode": "required", "parallel": True})
    assert cut.feed('[{"name": "get_time", "parameters": {"zo')["tool_calls"][0]["function"]["arguments"] == '{"zo'
    assert cut.finish() == {}  # max_tokens cut it: what came went out, and no content follows


def test_a_batch_line_with_a_named_tool_choice_is_the_same_job():
    body = {"model": "m", "messages": USER, "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    [job] = batch_jobs("/v1/chat/completions", body, "batch_1-3")
    assert job.id == "batch_1-3" and job.sampling["structured_outputs"]["json"] == CITY
    assert job.metadata["gateway"]["tools"] == {"mode": "named", "parallel": True, "name": "get_weather"}
    with pytest.raises(RequestError, match="--enable-auto-tool-choice"):
        batch_jobs("/v1/chat/completions", {**body, "tool_choice": "auto"}, "batch_1-4")
    assert batch_jobs("/v1/chat/completions", {**body, "tool_choice": "auto"}, "batch_1-4",
                      tool_parser="llama3_json")[0].metadata["gateway"]["tools"]["parser"] == "llama3_json"


# one generation per way of reading calls (its tool_choice, its parser), cut by max_tokens at each character
CUT = {"required": ("required", None, '[{"name": "get_weather", "parameters": {"city":  "Oslo"}},'
                                      ' {"name": "get_time", "parameters": {"zone": "CET"}}]'),
       "named": ({"type": "function", "function": {"name": "get_weather"}}, None, '{"city":  "Oslo"}'),
       "hermes": ("auto", "hermes", 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city":  "Oslo"}}'
                                    '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}'
                                    '</tool_call>'),
       "llama3_json": ("auto", "llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city":  "Oslo"}};'
                                              ' {"name": "get_time", "parameters": {}}')}


def streamed_answer(deltas: ToolDeltas, pieces: list[str], reason: str) -> tuple:
    """What an SDK client joins of a stream of ``pieces``: its finish_reason, content (None if none
    came) and each call's name and arguments, the streaming gateway's finish_reason as it reads it."""
    sent = [deltas.feed(p) for p in pieces] + [deltas.finish()]
    content = "".join(d.get("content", "") for d in sent) or None
    calls: dict[int, list[str]] = {}
    for entry in (e for d in sent for e in d.get("tool_calls", [])):
        call = calls.setdefault(entry["index"], [entry["function"].get("name"), ""])
        call[1] += entry["function"]["arguments"]
    return finish_reason(reason, deltas.called, deltas.mode), content, [tuple(calls[i]) for i in sorted(calls)]


def whole_answer(choice: dict) -> tuple:
    calls = choice["message"].get("tool_calls", [])
    return (choice["finish_reason"], choice["message"]["content"],
            [(c["function"]["name"], c["function"]["arguments"]) for c in calls])


@pytest.mark.parametrize("mode", CUT)
def test_a_generation_cut_by_max_tokens_anywhere_streams_what_its_whole_answer_holds(mode):
    tool_choice, parser, text = CUT[mode]
    for parallel in (True, False):
        req = chat(parser, tool_choice=tool_choice, parallel_tool_calls=parallel)
        meta = req.job["metadata"]["gateway"]["tools"]
        for cut in range(1, len(text) + 1):
            reason = "length" if cut < len(text) else "stop"
            whole = whole_answer(translate_result(result_of(req, text[:cut], reason))["choices"][0])
            for pieces in ([text[:cut]], list(text[:cut])):  # in one piece, and a character at a time
                assert streamed_answer(ToolDeltas(meta), pieces, reason) == whole, (parallel, text[:cut])
    # cut in a call's arguments: finish_reason length and the call as far as it got, as OpenAI answers
    cut = text[:text.index("Os") + 2]
    assert whole_answer(translate_result(result_of(req, cut, "length"))["choices"][0]) == (
        "length", "Checking.\n" if mode == "hermes" else None, [("get_weather", '{"city":  "Os')])
