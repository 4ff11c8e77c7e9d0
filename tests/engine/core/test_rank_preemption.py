"""Rank preemption in the scheduler on its own: order, victims, aging, no thrash (docs/SWAP.md)."""

import pytest

from engine.config import SchedulerConfig
from engine.core.block_manager import BlockManager
from engine.core.scheduler import Scheduler
from engine.core.sequence import SequenceStatus

from tests.engine.core.ranked import seq, step

BS = 4


def make_scheduler(num_gpu_blocks=8, num_cpu_blocks=32, mode="swap", policy="priority", max_num_seqs=8,
                   aging_steps=128, min_resident_steps=4):
    bm = BlockManager(BS, num_gpu_blocks, num_cpu_blocks, enable_prefix_caching=False)
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=1024,
                          preemption_mode=mode, scheduling_policy=policy, aging_steps=aging_steps,
                          min_resident_steps=min_resident_steps)
    return Scheduler(cfg, bm)


def fill(sched, *seqs):
    """Admit ``seqs`` and run until they hold every GPU block."""
    for s in seqs:
        sched.add(s)
    step(sched)
    assert all(s.status is SequenceStatus.RUNNING for s in seqs) and sched.bm.gpu.num_free == 0


def names(out):
    return [item.seq.request_id for item in out.scheduled]


@pytest.mark.parametrize("mode, pool, parked", [("swap", 32, SequenceStatus.SWAPPED),
                                                ("recompute", 32, SequenceStatus.WAITING),
                                                ("swap", 0, SequenceStatus.WAITING)])
def test_a_higher_rank_takes_the_seat_of_the_lowest_ranked_latest_arrival(mode, pool, parked):
    sched = make_scheduler(num_cpu_blocks=pool, mode=mode)
    old_bulk, low, new_bulk = seq("old", 15, 0, 0), seq("low", 7, -1, 1), seq("new", 7, 0, 2)
    fill(sched, old_bulk, low, new_bulk)  # 4 + 2 + 2 blocks: the cache is full
    urgent = seq("urgent", 6, priority=10, arrival=3)  # needs 2 blocks
    sched.add(urgent)
    out = step(sched)
    assert urgent.status is SequenceStatus.RUNNING and "urgent" in names(out)
    # the lowest priority goes first (2 blocks suffice), not the latest arrival
    assert out.preempted == [low] and low.status is parked
    assert old_bulk.status is new_bulk.status is SequenceStatus.RUNNING
    assert sched.stats.num_rank_preemptions == 1


def test_among_equal_ranks_the_latest_arrival_goes_first():
    sched = make_scheduler()
    a, b, c = seq("a", 7, 0, 0), seq("b", 7, 0, 1), seq("c", 15, 0, 2)
    fill(sched, a, b, c)
    sched.add(seq("urgent", 3, priority=1, arrival=3))
    out = step(sched)
    assert out.preempted == [c] and out.blocks_to_swap_out


def test_higher_rank_waiting_work_is_seated_before_lower_rank_swapped_work():
    sched = make_scheduler()
    a, b = seq("a", 7, 0, 0), seq("b", 22, 0, 1)  # 2 + 6 blocks
    fill(sched, a, b)
    sched.add(seq("i1", 6, priority=5, arrival=2))
    step(sched)
    assert b.status is SequenceStatus.SWAPPED
    sched.add(seq("i2", 6, priority=5, arrival=3))
    sched.finish(a)  # room for one of them
    out = step(sched)
    assert "i2" in names(out) and b.status is SequenceStatus.SWAPPED


def test_nobody_is_preempted_in_vain():
    sched = make_scheduler()
    high, low = seq("high", 13, 5, 0), seq("low", 5, 0, 1)  # room to decode three steps without growing
    fill(sched, high, low, seq("mid", 5, 6, 2))
    big = seq("big", 14, priority=4, arrival=3)  # 4 blocks; the outranked hold only 2 of them
    sched.add(big)
    out = step(sched)
    assert not out.preempted and low.status is SequenceStatus.RUNNING
    sched.finish(big)
    sched.add(seq("small", 6, priority=4, arrival=4))  # 2 blocks: the outranked hold enough
    out = step(sched)
    assert out.preempted == [low]


def test_fcfs_orders_by_arrival_and_never_preempts_for_rank():
    sched = make_scheduler(policy="fcfs", max_num_seqs=2)
    first, second = seq("first", 7, 0, 0), seq("second", 7, 9, 1)
    sched.add(second)
    sched.add(first)
    sched.add(seq("third", 7, 0, 2))
    assert names(step(sched)) == ["first", "second"]
    sched = make_scheduler(policy="fcfs")
    fill(sched, seq("a", 15, 0, 0), seq("b", 15, 0, 1))
    urgent = seq("urgent", 3, priority=10, arrival=2)
    sched.add(urgent)
    for _ in range(3):
        step(sched)
    assert urgent.status is SequenceStatus.WAITING and sched.stats.num_rank_preemptions == 0


def test_no_thrash_a_sequence_swapped_back_in_is_safe_for_min_resident_steps():
    sched = make_scheduler(min_resident_steps=5, max_num_seqs=2, num_gpu_blocks=64)
    a, b = seq("a", 7, 0, 0), seq("b", 7, 0, 1)
    fill_seats = [a, b]
    for s in fill_seats:
        sched.add(s)
    step(sched)
    i1 = seq("i1", 3, priority=5, arrival=2)
    sched.add(i1)
    step(sched)
    assert b.status is SequenceStatus.SWAPPED  # the latest arrival gave its seat
    sched.finish(i1)
    sched.finish(a)
    step(sched)
    assert b.status is SequenceStatus.RUNNING
    back_at = sched.num_steps
    filler = seq("filler", 7, 0, 0)  # arrived before b: without the bound, b would be the victim
    sched.add(filler)
    step(sched)
    sched.add(seq("i2", 3, priority=5, arrival=4))
    out = step(sched)
    assert out.preempted == [filler] and b.status is SequenceStatus.RUNNING
    sched.add(seq("i3", 3, priority=5, arrival=5))
    while b.status is SequenceStatus.RUNNING:
        step(sched)
        assert sched.num_steps - back_at <= 5
    assert sched.num_steps - back_at == 5  # the first step its protection allows


def test_aging_puts_a_passed_over_sequence_ahead_of_higher_ranks():
    sched = make_scheduler(aging_steps=3, min_resident_steps=1, max_num_seqs=1, num_gpu_blocks=64)
    running = seq("running", 3, 9, 0)
    sched.add(running)
    step(sched)
    bulk = seq("bulk", 3, 0, 1)
    sched.add(bulk)
    arrivals = iter(range(2, 100))
    # one seat: each step a new urgent request takes it, ahead of the bulk one
    for _ in range(3):
        urgent = seq(f"u{next(arrivals)}", 3, 9, 0)
        urgent.arrival_order = next(arrivals)
        sched.add(urgent)
        sched.finish(sched.running[-1])
        step(sched)
        assert bulk.status is SequenceStatus.WAITING
    assert bulk.passed_over == 3
    late = seq("late", 3, 9, next(arrivals))
    sched.add(late)
    sched.finish(sched.running[-1])
    out = step(sched)
    assert "bulk" in names(out) and late.status is SequenceStatus.WAITING
    assert bulk.passed_over == 0


def test_outranked_work_waits_in_the_step_that_seats_higher_rank_work():
    sched = make_scheduler(num_gpu_blocks=64)
    bulk, decoding = seq("bulk", 100, 0, 0), seq("decoding", 3, 0, 1)
    sched.add(decoding)
    step(sched)
    sched.add(bulk)
    step(sched)  # bulk's first chunk of its prompt
    assert 0 < bulk.num_computed_tokens < 100
    decoded = decoding.num_tokens
    sched.add(seq("urgent", 6, priority=5, arrival=2))
    out = step(sched)
    assert names(out) == ["urgent"]  # bulk's next chunk and the outranked decode wait a step
    assert decoding.num_tokens == decoded and decoding.status is SequenceStatus.RUNNING
    assert sorted(names(step(sched))) == ["bulk", "decoding", "urgent"]  # all of it the step after
    fcfs = make_scheduler(num_gpu_blocks=64, policy="fcfs")
    bulk = seq("bulk", 100, 0, 0)
    fcfs.add(bulk)
    step(fcfs)
    fcfs.add(seq("urgent", 6, priority=5, arrival=2))
    assert "bulk" in names(step(fcfs))


def test_outranked_decodes_never_wait_two_steps_running():
    """Arrivals one step after another hold bulk prefill chunks back each time, but the bulk
    decodes only every other step: they always progress."""
    sched = make_scheduler(num_gpu_blocks=64)
    bulk, decoding = seq("bulk", 100, 0, 0), seq("decoding", 3, 0, 1)
    sched.add(decoding)
    step(sched)
    sched.add(bulk)
    step(sched)
    seated = []
    for i in range(4):
        sched.add(seq(f"urgent{i}", 6, priority=5, arrival=2 + i))
        out = step(sched)
        assert f"urgent{i}" in names(out) and "bulk" not in names(out)
        seated.append("decoding" in names(out))
    assert seated == [False, True, False, True]


def test_a_bulk_prefill_that_takes_the_whole_budget_does_not_keep_urgent_work_out():
    sched = make_scheduler(num_gpu_blocks=128)
    bulk = seq("bulk", 300, 0, 0)
    sched.add(bulk)
    step(sched)
    assert bulk.num_computed_tokens == 64  # the whole budget, step after step
    sched.add(seq("urgent", 6, priority=5, arrival=1))
    assert names(step(sched)) == ["urgent"]
    assert bulk.num_computed_tokens == 64 and not sched.stats.num_rank_preemptions
    assert names(step(sched)) == ["urgent", "bulk"]


def test_bulk_prefill_goes_on_while_urgent_work_cannot_be_seated():
    sched = make_scheduler(num_gpu_blocks=128, max_num_seqs=2)
    top, bulk = seq("top", 3, 9, 0), seq("bulk", 300, 0, 1)
    sched.add(top)
    sched.add(bulk)
    step(sched)
    bulk.safe_until_step = 10**9  # no victim to be had: the urgent one waits
    urgent = seq("urgent", 6, priority=5, arrival=2)
    sched.add(urgent)
    for _ in range(3):
        assert "bulk" in names(step(sched))  # its prefill does not wait for a seat that cannot come
    assert urgent.status is SequenceStatus.WAITING and sched.stats.num_rank_preemptions == 0


def test_config_errors():
    for bad in (dict(scheduling_policy="lifo"), dict(aging_steps=0), dict(min_resident_steps=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SchedulerConfig(**bad)


def test_an_aged_sequence_without_room_does_not_keep_higher_ranks_from_preempting_their_way_in():
    sched = make_scheduler(aging_steps=1, min_resident_steps=4)
    a, b, c = seq("a", 13, 0, 0), seq("b", 5, 0, 1), seq("c", 5, 0, 2)
    fill(sched, a, b, c)  # 4 + 2 + 2 blocks: the cache is full
    waiting = seq("waiting", 15, 0, 3)
    sched.add(waiting)
    sched.add(seq("u1", 6, priority=5, arrival=4))
    step(sched)  # u1 takes c's seat and blocks; waiting is passed over: aged
    assert c.status is SequenceStatus.SWAPPED and sched.ranking.is_aged(waiting)
    u2 = seq("u2", 6, priority=5, arrival=5)
    sched.add(u2)
    out = step(sched)
    # the aged ones (waiting, and c, swapped) cannot run and preempt no one of their rank, but
    # u2 outranks the running bulk work: it takes b's seat and blocks, not the aged ones' turn
    assert "u2" in names(out) and out.preempted == [b]
    assert waiting.status is SequenceStatus.WAITING and c.status is SequenceStatus.SWAPPED
    sched.finish(a)  # blocks free up: they go to the aged ones first
    out = step(sched)
    assert "c" in names(out) and out.preempted == []


def test_blocks_free_while_an_aged_sequence_waits_stay_free_for_it():
    sched = make_scheduler(aging_steps=1, min_resident_steps=4, num_gpu_blocks=9)
    a, b, c = seq("a", 13, 0, 0), seq("b", 5, 0, 1), seq("c", 5, 0, 2)
    for s in (a, b, c):
        sched.add(s)
    step(sched)
    assert sched.bm.gpu.num_free == 1
    big = seq("big", 15, 0, 3)  # needs 4 blocks
    sched.add(big)
    sched.add(seq("u1", 6, priority=5, arrival=4))
    step(sched)  # u1 takes c's seat and both its blocks; big is passed over: aged
    assert sched.ranking.is_aged(big) and sched.bm.gpu.num_free == 1
    u2 = seq("u2", 3, priority=5, arrival=5)  # one block: the free one would do, but it is big's
    sched.add(u2)
    out = step(sched)
    assert "u2" in names(out) and out.preempted == [b] and sched.bm.gpu.num_free >= 1


def test_an_aged_sequence_out_of_budget_does_not_keep_higher_ranks_out_of_the_step():
    sched = make_scheduler(aging_steps=1, num_gpu_blocks=128)
    bulk = seq("bulk", 300, 0, 0)
    sched.add(bulk)
    step(sched)  # its prefill takes the whole budget, step after step
    waiting = seq("waiting", 40, 0, 1)
    sched.add(waiting)
    sched.add(seq("u1", 64, priority=5, arrival=2))
    step(sched)  # u1 takes the whole budget (bulk's chunk waits a step); waiting is passed over: aged
    assert sched.ranking.is_aged(waiting)
    step(sched)  # u1 decodes, bulk's chunk takes the rest of the budget; waiting gets none
    assert waiting.status is SequenceStatus.WAITING and bulk.num_computed_tokens < 300
    u2 = seq("u2", 6, priority=5, arrival=3)
    sched.add(u2)
    assert "u2" in names(step(sched))


def test_with_no_one_to_preempt_higher_ranks_take_the_blocks_kept_for_an_aged_sequence():
    sched = make_scheduler(aging_steps=1, min_resident_steps=1000, num_gpu_blocks=9)
    a, b, c = seq("a", 13, 0, 0), seq("b", 5, 0, 1), seq("c", 5, 0, 2)
    for s in (a, b, c):
        sched.add(s)
    step(sched)
    big = seq("big", 15, 0, 3)  # needs 4 blocks
    sched.add(big)
    sched.add(seq("u1", 6, priority=5, arrival=4))
    step(sched)  # u1 takes c's seat and blocks; big is passed over: aged
    assert sched.ranking.is_aged(big) and sched.bm.gpu.num_free == 1
    for s in (a, b):  # running work that may not be preempted for rank now (the no-thrash bound)
        s.safe_until_step = sched.num_steps + 1000
    u2 = seq("u2", 3, priority=5, arrival=5)  # one block: the free one, kept for big
    sched.add(u2)
    out = step(sched)
    assert "u2" in names(out) and out.preempted == [] and big.status is SequenceStatus.WAITING


def test_no_outranked_prompt_is_seated_beside_work_that_held_bulk_back():
    """The step that seats an urgent prompt over running bulk work seats no new bulk prompt
    either (it would make that step as long as both prompts); the bulk prompt goes next step."""
    sched = make_scheduler(num_gpu_blocks=128)
    running = seq("running", 100, 0, 0)
    sched.add(running)
    step(sched)
    assert 0 < running.num_computed_tokens < 100
    sched.add(seq("new-bulk", 20, 0, 1))
    sched.add(seq("urgent", 6, priority=5, arrival=2))
    assert names(step(sched)) == ["urgent"]
    assert sorted(names(step(sched))) == ["new-bulk", "running", "urgent"]
    # an idle engine holds nothing back: both tiers are seated at once
    idle = make_scheduler(num_gpu_blocks=128)
    idle.add(seq("bulk", 20, 0, 0))
    idle.add(seq("urgent", 6, priority=5, arrival=1))
    assert names(step(idle)) == ["urgent", "bulk"]


def test_peer_decodes_wait_a_step_when_that_lets_an_urgent_prompt_fit_whole():
    """A budget too small for an urgent prompt beside the decodes of its own rank: those decodes
    wait a step too, so its whole prompt (and its first token) is this step's; they run the
    step after, and never wait two steps running."""
    sched = make_scheduler(num_gpu_blocks=128)
    bulk = seq("bulk", 200, 0, 0)
    peers = [seq(f"peer{i}", 3, 5, 1 + i) for i in range(3)]
    for s in peers:
        sched.add(s)
    step(sched)  # the peers' prompts
    sched.add(bulk)
    step(sched)  # the peers decode, bulk's first chunk
    assert bulk.num_computed_tokens == 64 - 3
    urgent = seq("urgent", 63, priority=5, arrival=9)  # 63 + 3 peer decodes > the budget of 64
    sched.add(urgent)
    out = step(sched)
    assert names(out)[-1] == "urgent" and urgent.num_computed_tokens == 63  # its whole prompt
    assert sum(item.num_new_tokens for item in out.scheduled) <= 64
    assert sorted(names(step(sched))) == ["bulk", "peer0", "peer1", "peer2", "urgent"]
