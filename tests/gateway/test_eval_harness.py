"""What eval harnesses send to /v1/completions (lm-evaluation-harness's ``local-completions``): a
batch of prompts in one request, and ``echo`` with logprobs over the prompt's tokens, through the
official SDK, a real gateway and a real worker; the logprobs against HF transformers' own."""

from __future__ import annotations

import functools
import json
import threading
import time

import httpx
import openai
import pytest
import torch
import transformers

from producers.bulk_openai import OpenAIBulk
from producers.client import Client
from producers.openai_format import MAX_PROMPTS
from tests.gateway.conftest import ALICE, BOB, MODEL
from tests.gateway.test_batches import alike
from tests.gateway.test_openai import sync_client

ATOL = 1e-4
TEXTS = ["The quick brown fox", "Hello, world!", "Queues hold jobs"]


@functools.lru_cache(maxsize=None)
def hf_model(path: str):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logprobs(path, tokens: list[int]) -> torch.Tensor:
    """(L, V): row p is the log-softmax after tokens[: p + 1]."""
    with torch.inference_mode():
        return torch.log_softmax(hf_model(str(path))(torch.tensor([tokens])).logits[0].double(), dim=-1)


def is_greedy(logprobs, ctxlen: int) -> bool:
    """lm-eval's reading: every continuation token (past ctxlen, before the one generated) is its top one."""
    return all(lp == max(top.values()) for lp, top in zip(logprobs.token_logprobs[ctxlen:-1],
                                                           logprobs.top_logprobs[ctxlen:-1]))


def test_a_batch_of_token_prompts_echoes_logprobs_as_hf_computes_them(stack, tiny_model):
    """lm-eval's loglikelihood request: three token-id prompts, echo, logprobs 1, max_tokens 1."""
    first = [int(t) for t in torch.randint(3, 300, (9,), generator=torch.Generator().manual_seed(5))]
    greedy = int(hf_logprobs(tiny_model, first)[-1].argmax())
    prompts = [first, first + [greedy], [7, 42, 99, 11, 250]]  # the second's last token is the greedy one
    done = sync_client(stack).completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=1,
                                                 temperature=0, seed=1234)
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert done.usage.prompt_tokens == sum(map(len, prompts)) and done.usage.completion_tokens == 3
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny_model))
    for prompt, choice in zip(prompts, done.choices):
        lp, ref = choice.logprobs, hf_logprobs(tiny_model, prompt)
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(prompt) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.tokens[:-1] == [tokenizer.decode([t]) for t in prompt]
        for p in range(1, len(prompt)):
            assert abs(lp.token_logprobs[p] - ref[p - 1, prompt[p]].item()) < ATOL, p
            top_id = int(ref[p - 1].argmax())
            assert abs(lp.top_logprobs[p][tokenizer.decode([top_id])] - ref[p - 1, top_id].item()) < ATOL
        assert lp.tokens[-1] == tokenizer.decode([int(ref[-1].argmax())])  # the one generated, greedy
        assert choice.text.startswith(tokenizer.decode(prompt))  # the one generated may be part of a character
        assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    assert is_greedy(done.choices[1].logprobs, len(first)) and not is_greedy(done.choices[0].logprobs, 1)


def test_echo_with_max_tokens_0_answers_the_prompt_alone(stack):
    """As vLLM answers it: the prompt and its logprobs, the one token generated counted but not shown."""
    done = sync_client(stack).completions.create(model=MODEL, prompt=TEXTS[0], echo=True, max_tokens=0, logprobs=0)
    (choice,) = done.choices
    assert choice.text == TEXTS[0] and "".join(choice.logprobs.tokens) == TEXTS[0]
    assert len(choice.logprobs.tokens) == done.usage.prompt_tokens and done.usage.completion_tokens == 1
    assert choice.logprobs.token_logprobs[0] is None and all(len(t) == 1 for t in choice.logprobs.top_logprobs[1:])
    plain = sync_client(stack).completions.create(model=MODEL, prompt=TEXTS[1], echo=True, max_tokens=3,
                                                  temperature=0)
    assert plain.choices[0].text.startswith(TEXTS[1]) and plain.choices[0].logprobs is None


def test_batched_string_prompts_with_n_equal_each_prompt_alone(stack):
    client = sync_client(stack)
    args = dict(model=MODEL, max_tokens=6, temperature=0, n=2, extra_body={"ignore_eos": True})
    batched = client.completions.create(prompt=TEXTS, **args)
    alone = [client.completions.create(prompt=text, **args) for text in TEXTS]
    assert [c.index for c in batched.choices] == list(range(2 * len(TEXTS)))
    assert [c.text for c in batched.choices] == [c.text for one in alone for c in one.choices]
    assert batched.usage.prompt_tokens == sum(one.usage.prompt_tokens for one in alone)
    assert batched.usage.completion_tokens == 2 * 6 * len(TEXTS)


def test_batched_prompts_stream_interleaved_with_their_indexes(stack):
    """Chunks of every prompt by their choice index, an echo's prompt first, one usage chunk at the end."""
    client = sync_client(stack)
    args = dict(model=MODEL, prompt=TEXTS, max_tokens=5, temperature=0, n=2, echo=True, logprobs=1,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    tokens: dict[int, list] = {}
    firsts: dict[int, str] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        firsts.setdefault(choice.index, choice.text)
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens if choice.logprobs else [])
    assert sorted(texts) == list(range(6)) and chunks[-1].choices == []
    assert [texts[i] for i in range(6)] == [c.text for c in whole.choices]
    assert [tokens[i] for i in range(6)] == [c.logprobs.tokens for c in whole.choices]
    assert all(firsts[i].startswith(TEXTS[i // 2]) for i in range(6))  # the prompt came first
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


@pytest.mark.parametrize("prompt, param, message", [
    (["x"] * (MAX_PROMPTS + 1), "prompt", f"{MAX_PROMPTS + 1} prompts is over the limit of {MAX_PROMPTS}"),
    ([], "prompt", f"not empty; at most {MAX_PROMPTS} prompts"),
    (["a", [1, 2]], "prompt.1", "must be a string, as prompt.0 is"),
    ([[1, 2], [3, -4]], "prompt.1", "non-negative integers"),
])
def test_bad_prompt_arrays_are_400s_naming_the_field(stack, prompt, param, message):
    with pytest.raises(openai.BadRequestError) as caught:
        sync_client(stack).completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    error = caught.value.body
    assert error["param"] == param and message in error["message"], error


def test_a_prompt_past_the_context_fails_the_request_and_cancels_the_others(any_stack):
    """As vLLM fails the whole request; the other prompts' jobs end cancelled, not run to their end.
    The failing prompt is the last, and the first runs ~3 s: the wait on it sees the failure at its
    first look at the others (their keys in several slots of the cluster)."""
    stack = any_stack
    before = job_keys(stack)
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as caught:
        sync_client(stack).completions.create(model=MODEL, prompt=[[5] * 8, [6] * 8, [5] * 600], max_tokens=400,
                                              extra_body={"ignore_eos": True})
    assert time.monotonic() - started < 2, "the failure waited for the prompts before it"
    assert caught.value.body["code"] == "context_length_exceeded" and caught.value.body["param"] == "prompt"
    jobs = job_keys(stack) - before
    assert len(jobs) == 3
    ends = wait_ended(stack, jobs)
    assert sorted(ends) == ["cancelled", "cancelled", "failed"], ends


def test_a_whole_answer_of_64_prompts_waits_on_one_blocked_command_not_64(stack):
    """Its jobs are waited on in turn: Redis holds one blocked BLMOVE for the request (it held one per
    prompt, a connection each from the gateway's pool); the 504 cancels them all as before."""

    def blocked() -> int:
        return sum(c["cmd"] == "blmove" and "b" in c["flags"] for c in stack.r.client_list())

    baseline = blocked()
    before = job_keys(stack)
    replies: list[httpx.Response] = []
    body = {"model": "parked", "prompt": [f"prompt {i}" for i in range(64)], "max_tokens": 4}  # nobody reads its queue
    ask = threading.Thread(target=lambda: replies.append(httpx.post(
        stack.gateway.url + "/v1/completions", json=body, timeout=60,
        headers={"Authorization": f"Bearer {BOB}", "X-Sluiceway-Timeout": "0.8"})))
    ask.start()
    counts = []
    while ask.is_alive():  # past a look at the others (every 0.5 s), to the 504
        counts.append(blocked() - baseline)
        time.sleep(0.02)
    ask.join()
    assert replies[0].status_code == 504, replies[0].text
    assert 1 in counts and max(counts) <= 2, f"blocked BLMOVEs while it waited: {sorted(set(counts))}"
    jobs = job_keys(stack) - before
    assert len(jobs) == 64 and wait_ended(stack, jobs) == ["cancelled"] * 64


def test_a_client_that_leaves_a_batched_stream_cancels_every_prompt(stack):
    before = set(stack.r.scan_iter(match=stack.keys.job("*")))
    body = {"model": MODEL, "prompt": TEXTS, "max_tokens": 450, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", stack.gateway.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {ALICE}"}) as reply:
        assert next(reply.iter_lines()).startswith("data: ")
    ends = wait_ended(stack, set(stack.r.scan_iter(match=stack.keys.job("*"))) - before)
    assert ends == ["cancelled"] * 3, ends
    assert "already running" not in stack.gateway.output()  # a stream in the middle of a read closed cleanly


def job_keys(stack) -> set[str]:
    """Every job hash's key, of each shard on the cluster stack (a job's key carries its shard's tag)."""
    return set(stack.r.scan_iter(match=f"{stack.keys.prefix}:*job:*"))


def wait_ended(stack, jobs) -> list[str]:
    from tests.worker.conftest import wait_for

    def ends():
        found = [stack.r.hget(job, "status") for job in jobs]
        return all(s in ("done", "failed", "cancelled", "expired") for s in found) and found

    return wait_for(ends, timeout=30, what="the request's jobs to end")


def test_a_batch_line_echoes_and_one_of_several_prompts_answers_as_the_endpoint_does(stack, tmp_path):
    """``sluiceway bulk --format openai`` (the Batch API's translation too), on the real worker: a
    line of several prompts gets the endpoint's answer; one whose prompt fails, the endpoint's error,
    its other prompt cancelled."""
    several = {"model": MODEL, "prompt": TEXTS, "max_tokens": 3, "temperature": 0, "n": 2, "logprobs": 1}
    fails = {"model": MODEL, "prompt": [[5] * 8, [5] * 600], "max_tokens": 500, "ignore_eos": True}
    lines = [{"custom_id": "echo", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": [3, 4, 5], "echo": True, "logprobs": 1, "max_tokens": 1}},
             {"custom_id": "several", "method": "POST", "url": "/v1/completions", "body": several},
             {"custom_id": "fails", "method": "POST", "url": "/v1/completions", "body": fails}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    with Client(stack.redis_url) as client:
        summary = OpenAIBulk(client, tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl").run()
    assert (summary.done, summary.failed, summary.invalid) == (2, 1, 0)  # was: several an error line
    out = {r["custom_id"]: r["response"]["body"] for r in map(json.loads, (tmp_path / "out.jsonl").open())}
    logprobs = out["echo"]["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"][0] is None and len(logprobs["tokens"]) == 4
    sync = json.loads(sync_client(stack).completions.with_raw_response.create(**several).text)
    # NOTE: logprobs to 1e-3: a row's floats move in their last bits with whatever it was batched with
    assert alike({k: v for k, v in out["several"].items() if k not in ("id", "created")},
                 {k: v for k, v in sync.items() if k not in ("id", "created")})
    (err,) = [json.loads(x) for x in (tmp_path / "err.jsonl").read_text().splitlines()]
    error = err["response"]["body"]["error"]
    assert err["response"]["status_code"] == 400 and error["code"] == "context_length_exceeded"
    assert error["message"].startswith("prompt.1: ")
    assert stack.r.hget(stack.keys.job(err["response"]["request_id"]), "status") == "cancelled"  # as the endpoint's
