"""``LLMEngine.step(before_schedule=...)``: late admission. The hook runs once the step in
flight is done on the device and before the next is scheduled; what it adds joins the step
launched by that call; outputs are those of a run without it, token for token."""

from __future__ import annotations

import pytest

from engine import LLMEngine, SamplingParams
from engine.runner.sampler import DeviceSample

PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture
def make_engine(make_cpu_engine):
    return lambda **overrides: make_cpu_engine(**{"max_num_seqs": 4, **overrides})


def prompt(i: int, vocab: int) -> list[int]:
    return [(11 * i + j) % vocab for j in range(6 + i)]


def run(engine: LLMEngine, late: bool) -> dict[str, list[int]]:
    """Requests arriving over the run: r0 first, then one more at each of the next three calls,
    added between calls, or by the hook inside them (``late``)."""
    arrivals = {1: "r1", 2: "r2", 3: "r3"}
    engine.add_request("r0", prompt(0, engine.vocab_size), PARAMS)
    tokens: dict[str, list[int]] = {}
    call = 0
    while engine.has_unfinished_requests() or call <= max(arrivals):
        call += 1
        new = arrivals.get(call)

        def admit(new=new):
            if new is not None:
                engine.add_request(new, prompt(int(new[1]), engine.vocab_size), PARAMS)

        if late:
            outputs = engine.step(before_schedule=admit)
        else:
            admit()
            outputs = engine.step()
        for out in outputs:
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    return tokens


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_late_admission_changes_no_token(make_engine, async_scheduling):
    engine = make_engine(async_scheduling=async_scheduling)
    assert run(engine, late=True) == run(engine, late=False)


def test_the_hook_runs_after_the_device_wait_and_before_the_schedule(make_engine, monkeypatch):
    engine = make_engine(async_scheduling=True)
    order: list[str] = []
    real_wait, real_schedule = DeviceSample.wait, engine.scheduler.schedule

    def wait(self):
        order.append("wait")
        return real_wait(self)

    def schedule():
        order.append("schedule")
        return real_schedule()

    monkeypatch.setattr(DeviceSample, "wait", wait)
    monkeypatch.setattr(engine.scheduler, "schedule", schedule)
    engine.add_request("first", prompt(0, engine.vocab_size), PARAMS)
    engine.step()  # launches the first step; nothing in flight before it
    order.clear()

    def admit():
        order.append("hook")
        engine.add_request("late", prompt(1, engine.vocab_size), PARAMS)

    engine.step(before_schedule=admit)
    # (the step in flight made a first token, so reading it back early waits on it once more)
    assert order.count("hook") == 1 and "wait" in order[:order.index("hook")]
    assert order.index("schedule") > order.index("hook")
    # the request the hook added was scheduled (and launched) by that same call
    assert engine.requests["late"].metrics.first_scheduled_time is not None


def test_a_finished_step_with_first_tokens_is_read_back_before_the_next_launch(make_engine):
    """Late admission waits for the step in flight anyway: when it made first tokens they are
    stamped (and returned) before the next step is scheduled and launched, not after."""
    engine = make_engine(async_scheduling=True)
    engine.add_request("first", prompt(0, engine.vocab_size), PARAMS)
    assert engine.step() == []  # launches the prompt step; nothing to read back yet
    added = []

    def admit():
        added.append(engine.requests["first"].metrics.first_token_time)
        engine.add_request("late", prompt(1, engine.vocab_size), PARAMS)

    outputs = engine.step(before_schedule=admit)
    assert [o.request_id for o in outputs] == ["first"] and len(outputs[0].outputs[0].token_ids) == 1
    first_token = engine.requests["first"].metrics.first_token_time
    assert added == [first_token] and first_token <= engine.requests["late"].metrics.first_scheduled_time
    # a step of decodes alone is read back after the next launch, as without the hook
    engine.step(before_schedule=lambda: None)
    assert engine._inflight is not None


def test_a_thread_holding_the_launch_lock_holds_back_the_next_schedule_and_launch(make_engine):
    """``LLMEngine.launch_lock`` (engine/launched.py: under_launch_lock): the worker's reader
    holds it around each job's parse; meanwhile a step neither schedules nor launches, and once
    it is released the step runs, its tokens those of a run without the lock."""
    import threading

    engine = make_engine()
    engine.add_request("r0", prompt(0, engine.vocab_size), PARAMS)
    engine.step()  # the prompt step
    decoded = threading.Event()
    outputs = []

    def step():
        outputs.extend(engine.step())
        decoded.set()

    with engine.launch_lock:
        stepper = threading.Thread(target=step, daemon=True)
        stepper.start()
        assert not decoded.wait(0.3), "a step ran while another thread held the launch lock"
        assert engine.get_stats().num_generation_tokens <= 1
    assert decoded.wait(30)
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    alone = make_engine()
    alone.add_request("r0", prompt(0, alone.vocab_size), PARAMS)
    expected = []
    while alone.has_unfinished_requests():
        expected.extend(alone.step())
    assert [o.outputs[0].token_ids for o in outputs if o.finished] == \
        [o.outputs[0].token_ids for o in expected if o.finished]
