"""``--tool-call-parser`` per model: read from flags and the environment, refused when bad, and
given to the chat route and the Batch API's lines alike (no Redis is reached: the app is built,
not served). The end-to-end check is tests/gateway/test_tools.py."""

from __future__ import annotations

import click
import pytest

from gateway.app import create_app
from gateway.cli import load_settings
from gateway.errors import InvalidRequest
from gateway.model_parsers import ModelParsers
from gateway.settings import GatewaySettings
from gateway.translate import translate_request

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
UNREACHED = "redis://127.0.0.1:1/0"
OPTION = "--tool-call-parser (env SLUICEWAY_TOOL_CALL_PARSER): tool_call_parser: "


def chat(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS}


def parser_of(job) -> str:
    return job.metadata["gateway"]["tools"]["parser"]


@pytest.fixture(autouse=True)
def no_environment(monkeypatch):
    for name in ("SLUICEWAY_TOOL_CALL_PARSER", "SLUICEWAY_ENABLE_AUTO_TOOL_CHOICE"):
        monkeypatch.delenv(name, raising=False)


def test_a_model_named_with_its_parser_gets_it_and_the_others_the_default(monkeypatch):
    flags = load_settings({"redis": UNREACHED, "enable_auto_tool_choice": True,
                           "tool_call_parser": ("qwen=hermes", "llama3_json", "llama3-8b=llama3_json")})
    assert flags.auto_tool_parsers == ModelParsers("llama3_json", {"qwen": "hermes", "llama3-8b": "llama3_json"})
    monkeypatch.setenv("SLUICEWAY_TOOL_CALL_PARSER", "hermes, llama3-8b=llama3_json")
    monkeypatch.setenv("SLUICEWAY_ENABLE_AUTO_TOOL_CHOICE", "true")
    settings = GatewaySettings(redis=UNREACHED)
    assert settings.auto_tool_parsers == ModelParsers("hermes", {"llama3-8b": "llama3_json"})
    rebuilt = GatewaySettings(**{k.removeprefix("SLUICEWAY_").lower(): v for k, v in
                                 settings.to_environment().items()})  # what each of --workers reads
    assert rebuilt.auto_tool_parsers == settings.auto_tool_parsers
    app = create_app(settings)
    parsers = app.state.gateway.tool_parsers  # the chat route's
    for model, parser in (("llama3-8b", "llama3_json"), ("qwen", "hermes")):
        assert parser_of(translate_request("chat", chat(model), tool_parsers=parsers).to_job()) == parser
        # a batch line, translated by the feeder of whichever gateway holds its batch's lease
        [job] = app.state.batches.feeder.lines.translate("/v1/chat/completions", chat(model), "job-1", "alice", None)
        assert parser_of(job) == parser


def test_a_model_with_no_parser_keeps_auto_tool_choice_refused_as_before():
    only = GatewaySettings(redis=UNREACHED, enable_auto_tool_choice=True, tool_call_parser="llama3-8b=llama3_json")
    assert parser_of(translate_request("chat", chat("llama3-8b"), tool_parsers=only.auto_tool_parsers).to_job()) \
        == "llama3_json"
    off = GatewaySettings(redis=UNREACHED, tool_call_parser="llama3-8b=llama3_json")  # no --enable-auto-tool-choice
    for settings, model in ((only, "qwen"), (off, "llama3-8b")):
        with pytest.raises(InvalidRequest, match="--enable-auto-tool-choice and a --tool-call-parser for this model"):
            translate_request("chat", chat(model), tool_parsers=settings.auto_tool_parsers)
    # tool_choice required or named needs no parser, as before
    assert translate_request("chat", {**chat("qwen"), "tool_choice": "required"}, tool_parsers=only.auto_tool_parsers)


@pytest.mark.parametrize("given, message", [
    (("mistral",), "'mistral' is not a tool-call parser (they are: hermes, llama3_json)"),
    (("hermes", "llama3-8b=mistral"), "'llama3-8b=mistral': 'mistral' is not a tool-call parser (they are: hermes,"
                                      " llama3_json)"),
    (("=hermes",), "'=hermes' must be PARSER (every model's) or MODEL=PARSER (one model's); the parsers are hermes,"
                   " llama3_json"),
    (("llama3-8b=",), "'llama3-8b=' must be PARSER"),
    (("hermes", "llama3_json"), "two default parsers, hermes and llama3_json; give one, and MODEL=PARSER"),
    (("qwen=hermes", "qwen=llama3_json"), "model 'qwen' is given two parsers, hermes and llama3_json"),
])
def test_a_bad_parser_choice_is_a_usage_error_naming_the_option_and_the_parsers(given, message):
    with pytest.raises(click.UsageError) as caught:
        load_settings({"enable_auto_tool_choice": True, "tool_call_parser": given})
    assert str(caught.value).startswith(OPTION + message), caught.value


def test_the_same_choice_given_twice_is_harmless():
    settings = GatewaySettings(enable_auto_tool_choice=True,
                               tool_call_parser=("hermes", "hermes", "q=hermes", "q=hermes"))
    assert settings.auto_tool_parsers == ModelParsers("hermes", {"q": "hermes"})


def test_a_parser_for_a_model_no_worker_record_names_is_logged_once(redis_server, caplog):
    """``--tool-call-parser tinny=hermes`` (misspelt) would quietly give ``tiny`` the default: the
    model directory's first read of a fleet names it, once, and names the models the fleet serves."""
    import asyncio
    import logging

    from gateway.state import Gateway
    from tests.gateway.conftest import KEYS, hand_record

    async def reads() -> None:
        gw = Gateway(GatewaySettings(redis=redis_server, models_refresh_seconds=0, enable_auto_tool_choice=True,
                                     tool_call_parser=["tiny=hermes", "tinny=llama3_json"]))
        try:
            await gw.models.models()  # no worker record yet: nothing to tell a misspelling by
            assert "tool_parser_model_unknown" not in caplog.text
            await gw.client.redis.hset(KEYS.workers, "w1", hand_record("w1", "tiny", ["tiny"], alive=True))
            await gw.models.models()
            await gw.models.models()
        finally:
            await gw.close()

    with caplog.at_level(logging.WARNING, logger="gateway"):
        asyncio.run(reads())
    warned = [r.getMessage() for r in caplog.records if "tool_parser_model_unknown" in r.getMessage()]
    assert len(warned) == 1, warned
    assert warned[0].startswith("gateway.tool_parser_model_unknown model=tinny served=tiny "), warned
