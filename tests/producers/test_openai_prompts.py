"""A completions body's several prompts and ``echo``, translated: one job per prompt, the prompt's
logprobs asked for, and the jobs' results joined into one response. The end-to-end path (a real
worker, HF's logprobs) is tests/gateway/test_eval_harness.py."""

from __future__ import annotations

import json

import pytest

from producers.openai_batch import JobEnd, LineEnd, line_end
from producers.openai_completions import MAX_PROMPTS
from producers.openai_errors import RequestError
from producers.openai_format import batch_jobs, translate_request
from producers.openai_responses import translate_result, translate_results


def completion(**fields):
    return translate_request("completion", {"model": "m", "max_tokens": 2, **fields})


def entry(token_id: int, logprob: float) -> dict:
    token = chr(97 + token_id)
    return {"token_id": token_id, "token": token, "bytes": [97 + token_id], "logprob": logprob, "rank": 1,
            "top": [{"token_id": token_id, "token": token, "bytes": [97 + token_id], "logprob": logprob, "rank": 1}]}


def result_of(job, text: str = "z", n: int = 1, echo: bool = True) -> dict:
    """What a 1.4 worker answers the job: completions of ``text`` (token 25), the prompt's text
    ``a`` + token id, its logprobs (-token id) and first token."""
    ids = job.prompt_token_ids
    out = {"text": text, "token_ids": [25], "finish_reason": "length", "top_logprobs": [entry(25, -0.1)]}
    result = {"id": job.id, "text": text, "usage": {"prompt_tokens": len(ids), "completion_tokens": n},
              "outputs": [out] * n, "metadata": job.metadata}
    if echo:
        result.update(prompt_text="".join(chr(97 + t) for t in ids), prompt_logprobs=[None] + [
            entry(t, -t) for t in ids[1:]], prompt_first_token={"token_id": ids[0], "token": chr(97 + ids[0]),
                                                                 "bytes": [97 + ids[0]]})
    return result


@pytest.mark.parametrize("prompt, jobs", [
    ("one", [{"prompt": "one"}]),
    ([1, 2, 3], [{"prompt_token_ids": [1, 2, 3]}]),  # an array of token ids is one prompt
    (["one"], [{"prompt": "one"}]),
    (["one", "two"], [{"prompt": "one"}, {"prompt": "two"}]),
    ([[1, 2], [3]], [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}]),
])
def test_openais_four_forms_of_prompt_become_one_job_per_prompt(prompt, jobs):
    req = completion(prompt=prompt, temperature=0, seed=3)
    found = req.to_jobs()
    assert [{k: v for k, v in (("prompt", j.prompt), ("prompt_token_ids", j.prompt_token_ids)) if v is not None}
            for j in found] == jobs
    assert all(j.sampling == found[0].sampling and j.metadata == found[0].metadata for j in found)
    assert len({j.id for j in found}) == len(found) and req.to_job() is found[0]


@pytest.mark.parametrize("prompt, param, message", [
    ([], "prompt", f"(not empty; at most {MAX_PROMPTS} prompts)"),
    (["x"] * (MAX_PROMPTS + 1), "prompt", f"{MAX_PROMPTS + 1} prompts is over the limit of {MAX_PROMPTS} per request"),
    (["a", [1]], "prompt.1", "must be a string, as prompt.0 is"),
    ([[1], "a"], "prompt.1", "must be a non-empty array of token ids, as prompt.0 is"),
    ([[1], []], "prompt.1", "must be a non-empty array of token ids"),
    ([1, [2]], "prompt.0", "must be a string or a non-empty array of token ids"),
    ([[1], [2, -3]], "prompt.1", "prompt.1: prompt_token_ids: prompt_token_ids must hold non-negative integers"),
    ({"text": "x"}, "prompt", "must be a string, an array of strings"),
])
def test_bad_prompts_name_the_field_and_the_limit(prompt, param, message):
    with pytest.raises(RequestError) as caught:
        completion(prompt=prompt)
    assert caught.value.param == param and message in caught.value.message, caught.value.message


def test_echo_asks_for_the_prompts_logprobs_and_max_tokens_0_for_one_token_dropped():
    with_logprobs = completion(prompt="x", echo=True, logprobs=2).to_job()
    assert with_logprobs.sampling["prompt_logprobs"] == 2 and with_logprobs.sampling["logprobs"] == 2
    assert with_logprobs.metadata["gateway"]["echo"] == "prompt+completion"
    alone = completion(prompt="x", echo=True, max_tokens=0).to_job()
    assert alone.sampling["prompt_logprobs"] == 0 and alone.sampling["max_tokens"] == 1
    assert alone.metadata["gateway"]["echo"] == "prompt"
    assert "prompt_logprobs" not in completion(prompt="x", echo=False).job["sampling"]
    with pytest.raises(RequestError) as caught:
        completion(prompt="x", max_tokens=0)  # without echo, as vLLM: at least one token
    assert caught.value.param == "max_tokens"


def test_the_results_of_several_prompts_are_one_response_indexed_prompt_by_choice():
    req = completion(prompt=[[1, 2], [3, 4, 5]], n=2, echo=True, logprobs=1)
    body = translate_results([result_of(job, n=2) for job in req.to_jobs()])
    assert body["id"] == f"cmpl-{req.to_jobs()[0].id}" and body["object"] == "text_completion"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == ["bcz", "bcz", "defz", "defz"]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    logprobs = body["choices"][2]["logprobs"]
    assert logprobs["tokens"] == ["d", "e", "f", "z"] and logprobs["token_logprobs"] == [None, -4, -5, -0.1]
    assert logprobs["top_logprobs"] == [None, {"e": -4}, {"f": -5}, {"z": -0.1}]
    assert logprobs["text_offset"] == [0, 1, 2, 3]


def test_an_echo_alone_and_an_echo_without_logprobs():
    (job,) = completion(prompt=[[1, 2, 3]], echo=True, max_tokens=0, logprobs=0).to_jobs()
    choice = translate_result(result_of(job))["choices"][0]
    assert choice["text"] == "bcd" and choice["logprobs"]["tokens"] == ["b", "c", "d"]
    assert choice["finish_reason"] == "length"  # the one token generated, as vLLM reports it
    (job,) = completion(prompt=[1, 2], echo=True).to_jobs()
    assert translate_result(result_of(job))["choices"][0] == {"index": 0, "text": "bcz", "logprobs": None,
                                                              "finish_reason": "length"}
    with pytest.raises(ValueError, match="protocol 1.4"):  # a worker that does not return the prompt
        translate_result(result_of(job, echo=False))


def test_a_batch_line_of_several_prompts_is_a_job_each_and_one_answer():
    line = {"model": "m", "prompt": [1, 2], "echo": True, "logprobs": 1}
    [job] = batch_jobs("/v1/completions", line, "b-1")
    assert job.id == "b-1" and job.sampling["prompt_logprobs"] == 1
    jobs = batch_jobs("/v1/completions", {**line, "prompt": [[1, 2], [3, 4, 5], [6]]}, "b-2")
    # was an error line: a batch line holds one prompt
    assert [j.id for j in jobs] == ["b-2", "b-2-1", "b-2-2"] and jobs[2].prompt_token_ids == [6]
    with pytest.raises(RequestError, match="prompt.1: must be a string"):
        batch_jobs("/v1/completions", {"model": "m", "prompt": ["a", [1]]}, "b-3")
    done = [JobEnd("done", json.dumps(result_of(j))) for j in jobs]
    end = line_end(done)
    assert end.status == "done" and translate_results(end.results) == translate_results(
        [result_of(j) for j in jobs])
    # one prompt fails: the line is its failure, named, whatever the others' (cancelled) ends
    failed = line_end([done[0], JobEnd("cancelled", error="cancelled"),
                       JobEnd("failed", error="prompt is 900 tokens", code="context_length_exceeded")])
    assert (failed.status, failed.code, failed.results) == ("failed", "context_length_exceeded", None)
    assert failed.error == "prompt.2: prompt is 900 tokens"
    assert line_end([done[0], JobEnd("done", "{}")]).error == "prompt.1: the job is done but its result is not valid"
    assert line_end([JobEnd("cancelled")]) == LineEnd("cancelled")  # one prompt: its end as it is
