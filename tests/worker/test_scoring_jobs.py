"""Protocol 1.2 through a real worker and redis-server: logprobs with text and bytes in results
and token streams, prompt logprobs, and scoring jobs equal to the offline engine's."""

from __future__ import annotations

import json

import pytest

from producers.errors import JobFailed
from producers.protocol import JobResult, Keys, TokenDelta
from tests.worker.conftest import ENGINE_ARGS

KEYS = Keys()
PROMPT = "What is the capital of France?"


@pytest.fixture(scope="module")
def offline(tiny_model):
    from engine import LLM

    llm = LLM(str(tiny_model), **ENGINE_ARGS)
    yield llm
    llm.shutdown()


def test_logprobs_with_text_bytes_and_rank_in_the_result_and_the_stream(start_worker, client, r, offline):
    from engine import SamplingParams

    sampling = {"temperature": 0, "max_tokens": 6, "ignore_eos": True, "logprobs": 3, "prompt_logprobs": 2}
    job_id = client.submit(PROMPT, sampling=sampling, stream=True)
    start_worker()
    result = client.result(job_id, timeout=30)
    want = offline.generate(PROMPT, SamplingParams(**sampling), use_tqdm=False)[0]
    tokenizer = offline.get_tokenizer()

    (out,) = result.outputs
    assert len(out.top_logprobs) == len(out.token_ids) == 6
    for token, step, engine_step in zip(out.token_ids, out.top_logprobs, want.outputs[0].logprobs):
        assert step.token_id == token and step.rank == 1  # greedy: the chosen token is the most likely
        assert step.token == tokenizer.decode([token]) and bytes(step.bytes) == engine_step[token].token_bytes
        assert abs(step.logprob - engine_step[token].logprob) < 1e-5
        assert [t.rank for t in step.top] == [1, 2, 3] and step.top[0].token_id == token
        assert [t.logprob for t in step.top] == sorted((t.logprob for t in step.top), reverse=True)
    # the text's bytes are the tokens' bytes end to end
    joined = b"".join(bytes(s.bytes) for s in out.top_logprobs)
    assert joined.decode("utf-8", errors="replace") == tokenizer.decode(out.token_ids)

    entries = [fields for _, fields in r.xrange(KEYS.tokens(job_id))]
    streamed = [lp for fields in entries for lp in json.loads(fields["logprobs"])]
    assert streamed == [s.model_dump() for s in out.top_logprobs]
    assert all(len(json.loads(f["logprobs"])) == len(json.loads(f["token_ids"])) for f in entries)

    prompt_ids = tokenizer(PROMPT)["input_ids"]
    assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == len(prompt_ids)
    for token, step, engine_step in zip(prompt_ids[1:], result.prompt_logprobs[1:], want.prompt_logprobs[1:]):
        assert step.token_id == token and len(step.top) == 2
        assert abs(step.logprob - engine_step[token].logprob) < 1e-5 and step.rank == engine_step[token].rank

    # v1.4: the prompt's text and its first token (what the null first entry leaves unnamed), in
    # the result and on the stream's first entry; a prompt of token ids is its tokens decoded
    first = result.prompt_first_token
    assert result.prompt_text == PROMPT and first.token_id == prompt_ids[0]
    assert first.token == tokenizer.decode(prompt_ids[:1]) and bytes(first.bytes) == first.token.encode()
    opening = TokenDelta.from_fields(entries[0])
    assert opening.offset == 0 and opening.prompt_text == PROMPT and opening.prompt_first_token == first
    assert opening.prompt_logprobs == result.prompt_logprobs
    assert not any("prompt_text" in f or "prompt_logprobs" in f for f in entries[1:])
    as_ids = client.result(client.submit(prompt_token_ids=prompt_ids[1:], sampling={"max_tokens": 1,
                                                                                    "prompt_logprobs": 0}), timeout=30)
    assert as_ids.prompt_text == tokenizer.decode(prompt_ids[1:]) and as_ids.prompt_first_token.token_id == prompt_ids[1]
    assert client.result(client.submit(PROMPT, sampling={"max_tokens": 1}), timeout=30).prompt_text is None


def test_top_logprobs_keep_a_chosen_token_tied_at_the_kth_place():
    """k = 1, the chosen token tied for the top (both tied are rank 2): ``top`` holds whichever of
    the two the engine's top 1 took, the chosen one included."""
    from engine.outputs import Logprob
    from worker.outputs import top_logprobs

    tied = Logprob(-0.9, 2)
    assert [t.token_id for t in top_logprobs({2: tied}, 1).top] == [2]  # the top 1 is the chosen token
    assert [t.token_id for t in top_logprobs({2: tied, 5: tied}, 1).top] == [5]
    assert top_logprobs({2: tied}, 0).top == [] and top_logprobs({2: tied}, 0).rank == 2


def test_a_scoring_job_equals_offline_scores(start_worker, client, offline):
    continuations = [" Paris.", " Lyon", [17, 42, 99]]
    job_id = client.submit(PROMPT, score={"continuations": continuations}, metadata={"row": 3})
    start_worker()
    result = client.result(job_id, timeout=30)
    want = offline.score_continuations(PROMPT, continuations)
    assert result.outputs == [] and result.metadata == {"row": 3}
    assert [s.index for s in result.scores] == [0, 1, 2]
    tokenizer = offline.get_tokenizer()
    for got, expected in zip(result.scores, want):
        assert abs(got.logprob - expected.logprob) < 1e-5 and got.num_tokens == expected.num_tokens
        assert got.is_greedy == expected.is_greedy and len(got.token_logprobs) == got.num_tokens
        assert got.token_ids == expected.token_ids and len(got.token_ids) == got.num_tokens
    assert result.scores[2].token_ids == [17, 42, 99]
    assert tokenizer.decode(result.scores[0].token_ids) == " Paris."
    # a result from a worker before the field still reads
    old = result.model_dump(exclude={"scores": {"__all__": {"token_ids"}}})
    assert "token_ids" not in old["scores"][0] and JobResult.model_validate(old).scores[0].token_ids is None


@pytest.mark.parametrize("score,named", [
    ({"continuations": []}, "score.continuations"),
    ({"continuations": [" a", ""]}, "continuation 1 is an empty string"),
    ({"continuations": [[1, -2]]}, "continuation 0: -2"),
])
def test_a_bad_scoring_job_is_refused_naming_the_field(client, score, named):
    from producers.errors import InvalidJob

    with pytest.raises(InvalidJob, match=named):
        client.submit(PROMPT, score=score)


def test_a_scoring_job_the_engine_refuses_fails_alone(start_worker, client, r):
    """A token id past the vocabulary: invalid_job naming the continuation; the next job runs."""
    bad = client.submit(PROMPT, score={"continuations": [" fine", [10**6]]})
    good = client.submit(PROMPT, score={"continuations": [" fine"]})
    start_worker()
    with pytest.raises(JobFailed, match="continuations.1"):
        client.result(bad, timeout=30)
    assert r.hget(KEYS.job(bad), "error_code") == "invalid_job"
    assert client.result(good, timeout=30).scores[0].num_tokens >= 1


def test_celery_tasks_get_prompt_logprobs_and_scores(start_worker, redis_server, offline):
    """``send_task`` with ``sampling.prompt_logprobs``, and with ``score``: ``AsyncResult.get()`` holds them."""
    celery = pytest.importorskip("celery")
    from producers.celery_app import CELERY_QUEUE, TASK_NAME

    app = celery.Celery("app", broker=redis_server, backend=redis_server)
    try:
        start_worker()
        logprobs = app.send_task(TASK_NAME, kwargs={"prompt": PROMPT, "sampling": {"max_tokens": 2,
                                                                                   "prompt_logprobs": 1}},
                                 queue=CELERY_QUEUE)
        scored = app.send_task(TASK_NAME, kwargs={"prompt": PROMPT, "score": {"continuations": [" Paris", " Rome"]}},
                               queue=CELERY_QUEUE)
        got, scores = logprobs.get(timeout=30), scored.get(timeout=30)
    finally:
        app.close()
    assert got["prompt_logprobs"][0] is None
    assert len(got["prompt_logprobs"]) == got["usage"]["prompt_tokens"]
    want = offline.score_continuations(PROMPT, [" Paris", " Rome"])
    assert [round(s["logprob"], 4) for s in scores["scores"]] == [round(s.logprob, 4) for s in want]


def test_bulk_rows_score_and_ask_for_prompt_logprobs(start_worker, client, tmp_path):
    from producers.bulk import Bulk

    rows = [{"prompt": PROMPT, "score": {"continuations": [" Paris", " Rome"]}, "metadata": {"row": 0}},
            {"prompt": PROMPT, "sampling": {"max_tokens": 2, "prompt_logprobs": 0}, "metadata": {"row": 1}}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    start_worker()
    Bulk(client, tmp_path / "in.jsonl", tmp_path / "out.jsonl", report=lambda _: None, progress=False).run()
    scored, generated = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert scored["status"] == "done" and [s["index"] for s in scored["result"]["scores"]] == [0, 1]
    prompt_logprobs = generated["result"]["prompt_logprobs"]
    assert prompt_logprobs[0] is None and all(p["top"] == [] for p in prompt_logprobs[1:])
    assert len(prompt_logprobs) == generated["result"]["usage"]["prompt_tokens"]
