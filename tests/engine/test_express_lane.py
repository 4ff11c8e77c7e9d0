"""The express lane in the engine (``express_lane_tokens``, docs/SWAP.md): a prompt that
outranks running work runs beside the step in flight during late admission's wait; its first
token can go out before that step ends; outputs are those of a run without the lane, token
for token. On a CPU a step has ended when its launch returns, so the tests that need a step
still in flight hold the device's answer back (``Pending``); the GPU test runs it for real
(tests/engine/test_gpu.py)."""

from __future__ import annotations

import pytest

from engine import LLMEngine, SamplingParams

BULK = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
URGENT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture
def make_engine(make_cpu_engine):
    return lambda express, **overrides: make_cpu_engine(
        **{"max_num_seqs": 8, "block_size": 4, "express_lane_tokens": 16 if express else 0, **overrides})


def prompt(i: int, n: int, vocab: int) -> list[int]:
    return [(13 * i + 7 * j) % vocab for j in range(n)]


class Pending:
    """A step marker that says the device is still busy until ``done`` is set."""

    done = False

    def query(self) -> bool:
        return Pending.done


def run(engine: LLMEngine, arrivals: dict[int, str]) -> dict[str, list[int]]:
    """Three bulk requests, then urgent ones (priority 10) arriving by late admission at the given calls."""
    for i in range(3):
        engine.add_request(f"bulk{i}", prompt(i, 10 + i, engine.vocab_size), BULK)
    tokens: dict[str, list[int]] = {}
    call = 0
    while engine.has_unfinished_requests() or call <= max(arrivals):
        call += 1
        new = arrivals.get(call)

        def admit(new=new):
            if new is not None and new not in engine.requests and new not in tokens:
                engine.add_request(new, prompt(int(new[-1]) + 5, 9, engine.vocab_size), URGENT, priority=10)

        for out in engine.step(before_schedule=admit):
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    return tokens


def finish_all(engine: LLMEngine, tokens: dict[str, list[int]]) -> dict[str, list[int]]:
    """Step ``engine`` (late admission, nothing admitted) to the end; ``tokens`` gains each finished request's."""
    while engine.has_unfinished_requests():
        for out in engine.step(before_schedule=lambda: None):
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    return tokens


def assert_urgent_as_alone(engine: LLMEngine, make_engine) -> None:
    """Run ``engine`` to the end; its ``urgent`` request's tokens equal a run of it alone without the lane."""
    tokens = finish_all(engine, {})
    alone = make_engine(express=False)
    alone.add_request("urgent", prompt(9, 9, alone.vocab_size), URGENT, priority=10)
    while alone.has_unfinished_requests():
        for out in alone.step():
            if out.finished:
                assert tokens["urgent"] == list(out.outputs[0].token_ids)


def test_the_lane_changes_no_token(make_engine):
    arrivals = {3: "urgent0", 5: "urgent1", 9: "urgent2"}
    lane = make_engine(express=True)
    with_lane = run(lane, arrivals)
    assert lane.scheduler.stats.num_express == 3  # every urgent prompt ran in the lane
    assert with_lane == run(make_engine(express=False), arrivals)
    assert len(with_lane) == 6


def test_a_first_token_goes_out_while_the_step_in_flight_still_runs(make_engine, monkeypatch):
    engine = make_engine(express=True)
    monkeypatch.setattr(Pending, "done", False)
    monkeypatch.setattr(engine.executor, "marker", lambda: Pending())
    records = []
    engine.add_step_observer(records.append)
    engine.add_request("bulk", prompt(0, 10, engine.vocab_size), BULK)
    engine.step()  # launches the bulk prompt: "in flight" from here on
    in_flight = engine._inflight

    def admit():
        if "urgent" not in engine.requests:
            engine.add_request("urgent", prompt(1, 9, engine.vocab_size), URGENT, priority=10)

    outputs = engine.step(before_schedule=admit)
    # the urgent job's first token came back; the bulk step is still the one in flight
    assert [(o.request_id, len(o.outputs[0].token_ids)) for o in outputs] == [("urgent", 1)]
    assert engine._inflight is in_flight and engine.scheduler.stats.num_express == 1
    assert records[-1].first_scheduled == ("urgent",) and records[-1].num_prefill_tokens == 9
    Pending.done = True
    outputs = engine.step(before_schedule=admit)  # the bulk step has ended: read back, the next launched
    assert {o.request_id for o in outputs} == {"bulk"} and engine._inflight is not in_flight


def test_blocks_freed_while_a_step_runs_are_quarantined_until_it_ends(make_engine, monkeypatch):
    engine = make_engine(express=True)
    monkeypatch.setattr(Pending, "done", False)
    monkeypatch.setattr(engine.executor, "marker", lambda: Pending())
    engine.add_request("short", prompt(0, 8, engine.vocab_size), SamplingParams(temperature=0.0, max_tokens=1))
    engine.add_request("bulk", prompt(1, 10, engine.vocab_size), BULK)
    engine.step()  # launches both prompts
    blocks = list(engine.requests["short"].seqs[0].block_table)
    Pending.done = True  # that step ends; the next is launched, then "short" is read back finished
    engine.step()
    assert "short" not in engine.requests
    assert set(blocks) <= set(engine.block_manager.quarantined)  # the step now in flight may still write them
    outputs = engine.step(before_schedule=lambda: None)  # its wait sees that step end: settled
    assert not set(blocks) & set(engine.block_manager.quarantined)
    assert outputs == [] or all(o.request_id == "bulk" for o in outputs)


@pytest.mark.parametrize("overrides, message", [
    (dict(express_lane_tokens=-1), "express_lane_tokens must be an integer from 0 \\(off\\) to 8192, got -1"),
    (dict(express_lane_tokens=16, async_scheduling=False), "express_lane_tokens needs async_scheduling"),
    (dict(express_lane_tokens=16, scheduling_policy="fcfs"), "scheduling_policy='priority'"),
])
def test_bad_settings_name_the_field(make_cpu_engine, overrides, message):
    with pytest.raises(ValueError, match=message):
        make_cpu_engine(**overrides)


@pytest.mark.parametrize("next_call", ["late", "plain"])
def test_a_prompt_arriving_during_a_long_launch_runs_beside_it_and_is_read_back_next_call(make_engine, monkeypatch,
                                                                                         next_call):
    """On a GPU a launch of graph pieces calls back between layers (``PrefillGraphs.run``'s
    ``between``); here the executor calls it once after its launch, as that launch would. A
    prompt admitted there runs in the lane beside the step being launched; the next call reads
    it back before scheduling anything else."""
    engine = make_engine(express=True)
    launch = engine.executor.execute

    def launch_calling_back(out, fed_tokens=None, between=None):
        logits = launch(out, fed_tokens)
        if between is not None:
            between()
        return logits

    monkeypatch.setattr(engine.executor, "execute", launch_calling_back)
    for i in range(2):
        engine.add_request(f"bulk{i}", prompt(i, 10 + i, engine.vocab_size), BULK)
    engine.step()
    hooks = []

    def admit():
        hooks.append(1)
        if len(hooks) == 3:  # NOTE: the wait's look and the one before scheduling came first
            engine.add_request("urgent", prompt(9, 9, engine.vocab_size), URGENT, priority=10)

    engine.step(before_schedule=admit)
    assert len(hooks) == 3 and engine.lane.in_flight is not None and engine.scheduler.stats.num_express == 1
    records = []
    engine.add_step_observer(records.append)
    # a call that does not wait beside the step in flight (no late admission) reads it back first
    outputs = engine.step(before_schedule=lambda: None) if next_call == "late" else engine.step()
    assert "urgent" in {o.request_id for o in outputs} and engine.lane.in_flight is None
    assert records[-1].express == (("urgent",) if next_call == "late" else ())
    assert_urgent_as_alone(engine, make_engine)


def test_a_lane_step_ready_within_a_long_launch_is_delivered_before_the_launch_ends(make_engine, monkeypatch):
    """With ``on_lane_outputs``, a later look of the same launch reads the lane step back and
    hands its outputs over at once (a worker stamps and streams the first token then), not
    after the launch; ``step`` does not return them again, and the tokens are unchanged."""
    engine = make_engine(express=True)
    launch = engine.executor.execute
    delivered: list[tuple[str, int]] = []  # (request, looks of the launch so far) per delivered output
    looks = []

    def launch_calling_back(out, fed_tokens=None, between=None):
        logits = launch(out, fed_tokens)
        for _ in range(3):  # a launch of graph pieces looks every few layers
            if between is not None:
                looks.append(1)
                between()
        return logits

    monkeypatch.setattr(engine.executor, "execute", launch_calling_back)
    engine.on_lane_outputs(lambda outs: delivered.extend((o.request_id, len(looks)) for o in outs))
    for i in range(2):
        engine.add_request(f"bulk{i}", prompt(i, 10 + i, engine.vocab_size), BULK)
    engine.step()
    records = []
    engine.add_step_observer(records.append)
    added = []

    def admit():
        if not added and looks:  # arrives during the launch: the lane step starts at its first look
            added.append(1)
            engine.add_request("urgent", prompt(9, 9, engine.vocab_size), URGENT, priority=10)

    outputs = engine.step(before_schedule=admit)
    assert delivered == [("urgent", 2)], "read back at the launch's next look"
    assert "urgent" not in {o.request_id for o in outputs} and engine.lane.in_flight is None
    assert records[-1].express == ("urgent",)
    assert_urgent_as_alone(engine, make_engine)


class HeldSample:
    """A lane step's device sample that is not ready while ``held()`` says so."""

    def __init__(self, sample, held) -> None:
        self._sample, self._held, self._looks = sample, held, 0

    def ready(self) -> bool:
        self._looks += 1  # NOTE: ready after 200 looks whatever ``held`` says, so a wait without the rule ends
        return (not self._held() or self._looks > 200) and self._sample.ready()

    def __getattr__(self, name):
        return getattr(self._sample, name)


def alone(make_engine, name: str) -> list[int]:
    engine = make_engine(express=False)
    engine.add_request(name, prompt(int(name[-1]) + 5, 9, engine.vocab_size), URGENT, priority=10)
    return finish_all(engine, {})[name]


@pytest.mark.parametrize("bulk_ends", [False, True])
def test_a_prompt_arriving_while_a_lane_step_runs_goes_behind_it_at_once(make_engine, monkeypatch, bulk_ends):
    """Two urgent arrivals a few ms apart: the second's lane step is launched while the first's
    still runs, not after its read-back. With the bulk step still in flight the first's token
    goes out and the second stays in flight for the next call; once the bulk step has ended,
    both are read back before anything is scheduled. Tokens as without the lane."""
    engine = make_engine(express=True)
    monkeypatch.setattr(Pending, "done", False)
    monkeypatch.setattr(engine.executor, "marker", lambda: Pending())
    launches = []
    launch = engine.lane.launch

    def launch_holding_the_first():
        step = launch()
        if step is not None:
            launches.append(step)
            if len(launches) == 1:  # its first token is not ready until a second lane step is launched
                step.sample = HeldSample(step.sample, lambda: len(launches) < 2 or bulk_ends)
            elif bulk_ends:
                Pending.done = True
        return step

    monkeypatch.setattr(engine.lane, "launch", launch_holding_the_first)
    records = []
    engine.add_step_observer(records.append)
    engine.add_request("bulk", prompt(0, 10, engine.vocab_size), BULK)
    engine.step()  # the bulk prompt: in flight from here on
    looks = []

    def admit():
        looks.append(1)
        if len(looks) <= 2:  # the wait's first look, then its second (the first lane step runs)
            name = f"urgent{len(looks)}"
            engine.add_request(name, prompt(int(name[-1]) + 5, 9, engine.vocab_size), URGENT, priority=10)

    outputs = engine.step(before_schedule=admit)
    assert len(launches) == 2 and engine.scheduler.stats.num_express == 2
    first = [(o.request_id, len(o.outputs[0].token_ids)) for o in outputs if o.request_id.startswith("urgent")]
    if bulk_ends:  # both read back before the next step was scheduled
        assert first == [("urgent1", 1), ("urgent2", 1)] and engine.lane.in_flight is None
        assert records[-1].express == ("urgent1", "urgent2")
    else:
        assert first == [("urgent1", 1)] and engine.lane.in_flight is launches[1]
        assert records[-1].express == ("urgent1",)
        outputs = engine.step(before_schedule=admit)  # the bulk step still runs: the second's token now
        assert [(o.request_id, len(o.outputs[0].token_ids)) for o in outputs] == [("urgent2", 1)]
        assert records[-1].express == ("urgent2",) and engine.lane.in_flight is None
    Pending.done = True
    tokens = finish_all(engine, {})
    assert tokens["urgent1"] == alone(make_engine, "urgent1")
    assert tokens["urgent2"] == alone(make_engine, "urgent2")
    assert len(tokens["bulk"]) == BULK.max_tokens
