"""The gateway without a server: bodies -> jobs, results -> responses, settings, no torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.errors import InvalidRequest
from gateway.settings import GatewaySettings, tenant_of_key
from gateway.translate import translate_request, translate_result

ROOT = Path(__file__).resolve().parents[2]


def test_a_chat_body_becomes_a_protocol_job_with_its_tenant():
    req = translate_request("chat", {
        "model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "Be "},
                                                                    {"type": "text", "text": "brief"}]},
                                   {"role": "user", "content": "Hi"}],
        "max_completion_tokens": 7, "temperature": 0, "stop": "\n", "seed": 3, "top_k": 5, "service_tier": "flex",
        "logprobs": True, "top_logprobs": 2, "response_format": {"type": "text"}, "user": "u1",
        "safety_identifier": "s1", "prompt_cache_key": "k1", "verbosity": "low", "modalities": ["text"]},
        tenant="alice")
    assert req.tier == "bulk" and req.model == "m" and not req.stream
    assert req.job["messages"] == [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"}]
    assert req.job["sampling"] == {"max_tokens": 7, "temperature": 0, "stop": "\n", "seed": 3, "top_k": 5,
                                   "logprobs": 2}
    assert req.job["metadata"]["tenant"] == "alice"


def test_response_format_becomes_structured_outputs_or_a_400_without_them():
    import engine

    schema = {"type": "object"}
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}
    if hasattr(engine, "StructuredOutputsParams"):
        assert translate_request("chat", body).job["sampling"]["structured_outputs"] == {"json": schema}
    else:  # an engine from before structured outputs: refused up front, never a job that fails
        with pytest.raises(InvalidRequest) as caught:
            translate_request("chat", body)
        assert caught.value.param == "response_format"


def test_a_completion_body_takes_token_ids_and_one_prompt_in_a_list():
    assert translate_request("completion", {"model": "m", "prompt": [1, 2, 3]}).job["prompt_token_ids"] == [1, 2, 3]
    req = translate_request("completion", {"model": "m", "prompt": ["Hello"], "stream": True,
                                           "stream_options": {"include_usage": True}}, priority=5)
    assert req.job["prompt"] == "Hello" and req.job["sampling"]["max_tokens"] == 16  # OpenAI's default
    assert req.include_usage and req.job["priority"] == 5 and req.job["stream"]
    assert req.to_job().id == req.to_job().id  # the checked job, built once


def test_a_null_field_counts_as_not_given():
    # was: a null max_completion_tokens hid the max_tokens beside it, and the answer ran to the
    # end of the context; a null n made best_of 1 a 400
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert translate_request("chat", {**chat, "max_completion_tokens": None, "max_tokens": 3}).job[
        "sampling"]["max_tokens"] == 3
    assert translate_request("chat", {**chat, "max_completion_tokens": 2, "max_tokens": 3}).job[
        "sampling"]["max_tokens"] == 2
    assert translate_request("completion", {"model": "m", "prompt": "x", "n": None, "best_of": 1}).job[
        "sampling"].get("n", 1) == 1
    # was: a null max_tokens on completions ran to the end of the context; chat's default is that end
    assert translate_request("completion", {"model": "m", "prompt": "x", "max_tokens": None}).job[
        "sampling"]["max_tokens"] == 16
    assert translate_request("chat", {**chat, "max_tokens": None}).job["sampling"]["max_tokens"] is None


def test_a_seed_of_minus_one_is_no_seed_and_other_negatives_are_a_400_naming_seed():
    """vLLM's server takes seed -1 as no seed; it was a 400 here."""
    assert translate_request("completion", {"model": "m", "prompt": "x", "seed": -1}).to_job().sampling[
        "seed"] is None
    with pytest.raises(InvalidRequest) as caught:
        translate_request("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], "seed": -2})
    assert caught.value.param == "seed" and caught.value.message == (
        "sampling.seed: seed must be -1 (no seed) or an integer >= 0, got -2")


@pytest.mark.parametrize("endpoint, body, param", [
    ("completion", {"prompt": "x"}, "model"),
    ("completion", {"model": "m", "prompt": ["a", [1]]}, "prompt.1"),  # several prompts are all of a kind
    ("completion", {"model": "m", "prompt": "x", "echo": "yes"}, "echo"),
    ("completion", {"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completion", {"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("completion", {"model": "m", "prompt": "x", "stream": True,  # was: taken, and no chunk but the last had usage
                    "stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats"),
    ("chat", {"model": "m", "messages": []}, "messages"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content.0"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "tools.0.function"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]},
     "functions"),  # the deprecated form of tools stays refused, naming what replaces it
    ("completion", {"model": "m", "prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools"),
    ("completion", {"model": "m", "prompt": "x", "parallel_tool_calls": "no"}, "parallel_tool_calls"),  # else ignored
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}],
              "response_format": {"type": "yaml"}}, "response_format.type"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], "priority": "high"}, "priority"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "42"}]},
     "messages.1.tool_call_id"),  # was run, as OpenAI never would
    # ignored fields keep their types, as OpenAI checks them (was: any JSON value taken)
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], "user": 5}, "user"),
    ("completion", {"model": "m", "prompt": "x", "metadata": ["a"]}, "metadata"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], "store": "yes"}, "store"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], "verbosity": 1}, "verbosity"),
    # output kinds: text alone (was: a 400 unknown_parameter for the SDK's modalities=["text"] too)
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"]},
     "modalities"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], "modalities": "text"}, "modalities"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], "modalities": ["text"],
              "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
])
def test_bad_bodies_name_their_field(endpoint, body, param):
    with pytest.raises(InvalidRequest) as caught:
        translate_request(endpoint, body)
    assert caught.value.status == 400 and caught.value.param == param, caught.value.message
    assert caught.value.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("role", [["user"], {"role": "user"}])
def test_a_role_that_is_not_a_string_is_a_400_and_a_batch_line_error_naming_it(role):
    """It was a TypeError (unhashable): a 500 at the endpoint, and out of a batch line's
    ``parse_request``, which never raises for what a line holds, so its batch's feeder failed the
    same pass again and again."""
    from producers.openai_batch import parse_request

    body = {"model": "m", "messages": [{"role": "user", "content": "x"}, {"role": role, "content": "y"}]}
    with pytest.raises(InvalidRequest) as caught:
        translate_request("chat", body)
    assert caught.value.param == "messages.1.role" and "must be one of system" in caught.value.message
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}
    request = parse_request(1, json.dumps(line).encode(), "job-1")
    assert not request.jobs and request.error.startswith("line 1: body.messages.1.role: must be one of"), request.error


def test_a_result_becomes_the_response_of_its_endpoint():
    req = translate_request("chat", {"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                                     "logprobs": True, "top_logprobs": 1})
    entry = {"token_id": 5, "token": "Hel", "bytes": [72, 101, 108], "logprob": -0.5, "rank": 1,
             "top": [{"token_id": 5, "token": "Hel", "bytes": [72, 101, 108], "logprob": -0.5, "rank": 1}]}
    result = {"id": "abc", "text": "Hel", "usage": {"prompt_tokens": 4, "completion_tokens": 1},
              "outputs": [{"text": "Hel", "token_ids": [5], "finish_reason": "length", "top_logprobs": [entry]}],
              "metadata": req.job["metadata"]}
    response = translate_result(result)
    assert response["id"] == "chatcmpl-abc" and response["object"] == "chat.completion" and response["model"] == "m"
    choice = response["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hel"} and choice["finish_reason"] == "length"
    assert choice["logprobs"]["content"][0]["top_logprobs"] == [{"token": "Hel", "logprob": -0.5,
                                                                 "bytes": [72, 101, 108]}]
    assert response["usage"] == {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}
    result["metadata"] = translate_request("completion", {"model": "m", "prompt": "x", "logprobs": 1}).job["metadata"]
    legacy = translate_result(result)["choices"][0]
    assert legacy["text"] == "Hel" and legacy["logprobs"]["top_logprobs"] == [{"Hel": -0.5}]
    # a sampled token outside the k most likely is counted among them too, as the legacy API does
    entry.update(token_id=6, token="lo", bytes=[108, 111], logprob=-2.5, rank=3)
    assert translate_result(result)["choices"][0]["logprobs"]["top_logprobs"] == [{"Hel": -0.5, "lo": -2.5}]


def test_settings_read_keys_and_limits_from_the_environment(monkeypatch):
    monkeypatch.setenv("SLUICEWAY_API_KEY", "alice=k1, k2")
    monkeypatch.setenv("SLUICEWAY_TENANT_MAX_OUTSTANDING", "alice=3")
    settings = GatewaySettings(max_outstanding=10)
    bare_tenant = tenant_of_key("k2")[1]
    assert settings.tenants == {"k1": "alice", "k2": bare_tenant} and "k2" not in bare_tenant
    assert settings.outstanding_limit("alice") == 3 and settings.outstanding_limit(bare_tenant) == 10
    assert GatewaySettings(**{k.removeprefix("SLUICEWAY_").lower(): v for k, v in
                              settings.to_environment().items()}).tenants == settings.tenants
    with pytest.raises(ValueError, match="tenant_max_outstanding"):
        GatewaySettings(tenant_max_outstanding=("alice=0",))


def test_workers_advertise_their_served_model_name():
    from worker.heartbeat import Heartbeat
    from worker.settings import WorkerSettings

    assert WorkerSettings(model="/models/llama").model_name == "/models/llama"
    assert WorkerSettings(model="/models/llama", served_model_name="llama").model_name == "llama"
    info = Heartbeat.worker_info("w", ("interactive",), "/models/llama", 30, served_model_name="llama")
    assert '"served_model_name":"llama"' in info.model_dump_json()


def test_the_gateway_and_serve_never_import_torch_or_the_worker():
    code = (
        "import sys; import gateway, gateway.app, gateway.cli, gateway.translate, gateway.errors\n"
        "from click.testing import CliRunner\n"
        "from sluiceway.cli import cli\n"
        "result = CliRunner().invoke(cli, ['serve', '--help'])\n"
        "assert result.exit_code == 0 and '--api-key' in result.output, result.output\n"
        "gateway.app.create_app(gateway.settings.GatewaySettings(redis='redis://127.0.0.1:1/0'))\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'worker'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_compose_file_runs_a_gateway_from_its_own_torch_free_image():
    import yaml

    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    gateway = services["gateway"]
    assert gateway["build"]["dockerfile"] == "Dockerfile.gateway" and "8000:8000" in gateway["ports"]
    for name in gateway["environment"]:
        assert name.removeprefix("SLUICEWAY_").lower() in GatewaySettings.model_fields, name
    dockerfile = (ROOT / "Dockerfile.gateway").read_text()
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            *sources, _ = line.split()[1:]
            assert all((ROOT / s).exists() for s in sources), line
    assert 'ENTRYPOINT ["sluiceway", "serve"]' in dockerfile and '".[gateway]"' in dockerfile


def test_models_come_from_live_heartbeats_and_a_shared_queue_is_refused(redis_server):
    import asyncio
    import time

    import redis
    import redis.asyncio as aioredis

    from gateway.batch_service import BatchService
    from gateway.batch_settings import BatchSettings
    from gateway.errors import APIError
    from gateway.models import ModelDirectory
    from producers.protocol import Keys, WorkerInfo

    now, keys = time.time(), Keys()

    def record(name, model, queues, seen=now, state="running"):
        return WorkerInfo(name=name, host="h", pid=1, queues=queues, model=f"/models/{model}", state=state,
                          served_model_name=model, started_at=seen, last_seen=seen, stale_after_s=30).model_dump_json()

    with redis.Redis.from_url(redis_server) as r:
        r.hset(keys.workers, mapping={
            "a": record("a", "x", ["interactive", "bulk"]), "b": record("b", "y", ["bulk"]),
            "c": record("c", "z", ["z-interactive", "z-bulk"]), "d": record("d", "dead", ["dq"], seen=now - 60),
            "e": record("e", "leaving", ["lq"], state="draining")})

    async def run():
        async with aioredis.Redis.from_url(redis_server, decode_responses=True) as client:
            directory = ModelDirectory(client, keys, refresh_s=0)
            z = await directory.serving("z")
            assert (z.queue("interactive"), z.queue("bulk")) == ("z-interactive", "z-bulk")
            outcomes = {}
            for name in ("x", "dead", "leaving", "nope"):
                try:
                    await directory.serving(name)
                except APIError as exc:
                    outcomes[name] = (exc.status, exc.code)
            # a batch line's queue: its model's bulk queue, live or not (never another model's);
            # none for a name no worker advertised; the configured one while no worker advertised any
            routes = {}
            for prefix in (keys.prefix, "nobody-here"):
                service = BatchService(redis_server, prefix, ModelDirectory(client, Keys(prefix), refresh_s=0),
                                       BatchSettings(queue="fallback"))
                try:
                    routes[prefix] = [await service.queue_of(m) for m in ("z", "dead", "leaving", "nope")]
                finally:
                    await service.redis.aclose()
                    await service.raw.aclose()
            return outcomes, routes

    outcomes, routes = asyncio.run(run())
    assert outcomes == {"x": (503, "model_misconfigured"), "dead": (503, "model_unavailable"),
                        "leaving": (503, "model_unavailable"), "nope": (404, "model_not_found")}
    assert routes == {keys.prefix: ["z-bulk", "dq", "lq", None], "nobody-here": ["fallback"] * 4}


def test_one_translation_serves_the_gateway_and_bulk_format_openai():
    """``producers.openai_format`` and ``openai_responses`` are the translation; the gateway's
    raises its error as a 400, and a batch line becomes the same job on the command line as over
    HTTP."""
    from gateway.translate import translate_line
    from producers import openai_format, openai_responses
    from producers.openai_batch import default_translate
    from producers.openai_errors import RequestError

    bad = {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": -1}
    with pytest.raises(RequestError) as shared:
        openai_format.translate_request("chat", bad)
    with pytest.raises(InvalidRequest) as gateway:
        translate_request("chat", bad)
    assert (gateway.value.param, gateway.value.message) == (shared.value.param, shared.value.message) == (
        "temperature", shared.value.message) and "sampling.temperature" in shared.value.message
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 3,
            "priority": 4, "max_tokens": 5}
    [cli] = default_translate("/v1/chat/completions", body, "job-1")
    [api] = translate_line("/v1/chat/completions", body, "job-1", tenant="alice")
    assert cli.sampling == api.sampling and cli.sampling["logprobs"] == 3 and cli.priority == api.priority == 4
    result = {"id": "job-1", "outputs": [{"text": "hi", "token_ids": [1], "finish_reason": "length", "top_logprobs": [
        {"token_id": 1, "token": "hi", "bytes": [104, 105], "logprob": -0.5, "rank": 1,
         "top": [{"token_id": 1, "token": "hi", "bytes": [104, 105], "logprob": -0.5, "rank": 1}]}]}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1}, "metadata": cli.metadata}
    body = openai_responses.translate_result(result)
    assert body == translate_result(result) and body["object"] == "chat.completion"
    assert body["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == [
        {"token": "hi", "logprob": -0.5, "bytes": [104, 105]}]


def test_the_shared_translation_imports_neither_fastapi_nor_torch_nor_the_gateway():
    code = ("import sys; import producers.openai_format, producers.openai_responses, producers.openai_batch,"
            " producers.bulk_openai\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'fastapi', 'starlette', 'gateway'))\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
