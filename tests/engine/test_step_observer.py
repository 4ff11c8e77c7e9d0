"""``LLMEngine.add_step_observer``: a ``StepRecord`` per ``step()`` call, on a tiny model on the CPU."""

from __future__ import annotations

import logging
import time

import pytest

from engine import LLMEngine, SamplingParams
from engine.observer import StepRecord

PROMPT_LEN, MAX_TOKENS, NUM_REQUESTS = 10, 4, 3


@pytest.fixture
def make_engine(make_cpu_engine):
    return lambda **overrides: make_cpu_engine(**{"max_num_batched_tokens": 16, "max_num_seqs": 3, **overrides})


def add_requests(engine: LLMEngine, n: int = NUM_REQUESTS, **params) -> None:
    for i in range(n):
        prompt = [(7 * i + j) % engine.vocab_size for j in range(PROMPT_LEN)]
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                           **params))


def run_observed(engine: LLMEngine) -> tuple[list[StepRecord], list[tuple[float, int]]]:
    """Step to the end; the records, and each call's wall time and tokens as seen from outside."""
    records: list[StepRecord] = []
    engine.add_step_observer(records.append)
    outside = []
    while engine.has_unfinished_requests():
        before = engine.get_stats().num_generation_tokens
        t0 = time.perf_counter()
        engine.step()
        outside.append((time.perf_counter() - t0, engine.get_stats().num_generation_tokens - before))
    return records, outside


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_each_call_reports_what_it_scheduled_resolved_and_generated(make_engine, async_scheduling):
    engine = make_engine(async_scheduling=async_scheduling)
    add_requests(engine)
    records, outside = run_observed(engine)
    assert len(records) == len(outside) and [r.step for r in records] == list(range(len(records)))
    for record, (wall_s, generated) in zip(records, outside):
        assert 0 < record.duration_s <= wall_s
        assert record.num_generated_tokens == generated
        assert record.waited_for == record.step  # the CPU runs the forward inside the launch
        assert record.num_batched_tokens == record.num_prefill_tokens + record.num_decode_tokens
        assert record.num_decode_tokens <= record.num_seqs <= 3 and record.num_batched_tokens <= 16
    assert sum(r.num_generated_tokens for r in records) == NUM_REQUESTS * MAX_TOKENS
    # a chunked prefill first: 10 tokens of the first prompt and 6 of the second
    assert (records[0].num_seqs, records[0].num_prefill_tokens, records[0].num_decode_tokens) == (2, 16, 0)
    # each request's prompt begins in exactly one step: the one that first scheduled it
    assert [r.first_scheduled for r in records[:3]] == [("r0", "r1"), ("r2",), ()]
    assert {r.forward for r in records if r.num_seqs} == {"eager"}  # no graphs on a CPU
    if async_scheduling:  # each call reads back the step the call before launched
        assert [r.resolved for r in records] == [()] + [(r.step - 1,) for r in records[1:]]
        assert records[0].num_generated_tokens == 0
    else:
        assert [r.resolved for r in records] == [(r.step,) for r in records]
        # every prompt token once, then one decode per later token (the first comes from the prefill)
        assert sum(r.num_prefill_tokens for r in records) == NUM_REQUESTS * PROMPT_LEN
        assert sum(r.num_decode_tokens for r in records) == NUM_REQUESTS * (MAX_TOKENS - 1)


def test_a_step_that_falls_back_to_synchronous_resolves_the_step_in_flight_and_its_own(make_engine):
    """Penalties need every token on the host: the call reads back the step still in flight, then its own."""
    engine = make_engine(async_scheduling=True)
    records: list[StepRecord] = []
    engine.add_step_observer(records.append)
    add_requests(engine, n=1)
    engine.step()  # launched, in flight
    engine.add_request("penalised", [5] * PROMPT_LEN, SamplingParams(max_tokens=2, repetition_penalty=1.3))
    engine.step()
    assert [r.resolved for r in records] == [(), (0, 1)]
    assert records[1].num_generated_tokens == 1 + 2  # r0's first token (step 0), then one each (step 1)


def test_observers_can_be_removed_and_one_that_raises_is_dropped(make_engine, caplog):
    engine = make_engine()
    add_requests(engine, n=1)
    seen: list[int] = []

    def broken(record: StepRecord) -> None:
        raise RuntimeError("observer bug")

    engine.add_step_observer(broken)
    engine.add_step_observer(lambda record: seen.append(record.step))
    with caplog.at_level(logging.ERROR, logger="engine.observer"):
        engine.step()  # async: launches the prefill, hands back nothing yet
        outputs = engine.step()
    assert [o.request_id for o in outputs] == ["r0"]  # the step's outputs still come back
    assert seen == [0, 1]
    assert [r.message for r in caplog.records].count(f"step observer {broken!r} raised; it is removed") == 1
    engine.remove_step_observer(engine)  # not observing: nothing happens
    with pytest.raises(ValueError, match="a step observer must be callable, got 3"):
        engine.add_step_observer(3)


def test_the_last_prompt_token_after_a_cache_hit_counts_as_prompt(make_engine):
    """A prompt whose first two blocks are cached computes one token: a prompt token, not a
    decode (the grading bench splits its time by this)."""
    engine = make_engine(block_size=8, max_num_batched_tokens=32)
    prompt = [(3 * j) % engine.vocab_size for j in range(17)]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request("first", prompt, params)
    run_observed(engine)
    engine.add_request("again", prompt, params)
    records, _ = run_observed(engine)
    assert (records[0].num_seqs, records[0].num_prefill_tokens, records[0].num_decode_tokens) == (1, 1, 0)
    assert sum(r.num_decode_tokens for r in records) == 1  # the one token after the first sampled


def test_a_first_token_is_timed_when_it_is_read_back_not_before(make_engine, monkeypatch):
    """The device may still be computing a graph-replayed step when its read-back is asked for:
    the first token's time (TTFT) is taken after the wait, never at the launch's end."""
    from engine.runner.sampler import DeviceSample

    device_s = 0.2
    real = DeviceSample.result

    def still_computing(self):  # a GPU step that finishes device_s after its (instant) launch
        time.sleep(device_s)
        return real(self)

    monkeypatch.setattr(DeviceSample, "result", still_computing)
    engine = make_engine(async_scheduling=False)
    add_requests(engine, n=1)
    metrics = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            metrics = out.metrics
    assert metrics.first_token_time - metrics.first_launched_time >= device_s
