"""The express lane's bookkeeping on its own (docs/SWAP.md): which prompt it takes, the blocks
it may not take (the quarantine), and the blocks lower-ranked admissions leave free for it."""

import pytest

from engine.config import SchedulerConfig
from engine.core.block_manager import BlockManager
from engine.core.block_pool import BlockPool
from engine.core.scheduler import Scheduler
from engine.core.sequence import SequenceStatus

from tests.engine.core.ranked import seq, step

BS = 4


def make_scheduler(num_gpu_blocks=32, express=8, max_num_seqs=8, budget=64):
    bm = BlockManager(BS, num_gpu_blocks, 0, enable_prefix_caching=False)
    bm.track_frees()
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=1024,
                          express_lane_tokens=express)
    return Scheduler(cfg, bm)


def test_a_pool_allocates_around_the_blocks_it_is_told_to_avoid():
    pool = BlockPool(4, caching=False)
    taken = [pool.allocate() for _ in range(4)]
    for block in taken:
        pool.release(block)  # recycled in this order: 0, 1, 2, 3
    assert pool.num_free_outside({0, 1}) == 2
    assert pool.allocate(avoid={0, 1}) == 2  # the least recently freed outside ``avoid``
    assert pool.allocate() == 0  # without ``avoid``: the least recently freed
    with pytest.raises(RuntimeError):
        pool.allocate(avoid={1, 3})


def test_freed_blocks_stay_quarantined_until_the_epoch_that_freed_them_has_settled():
    bm = BlockManager(BS, 8, 0, enable_prefix_caching=False)
    a, b = seq("a", 8), seq("b", 8, arrival=1)
    bm.allocate(a, 8)
    bm.allocate(b, 8)
    bm.free(a)  # not tracked yet
    assert bm.quarantined == {}
    bm.track_frees()
    first = bm.next_epoch()
    b_blocks = set(b.block_table)
    bm.free(b)
    second = bm.next_epoch()
    c = seq("c", 4, arrival=2)
    bm.allocate(c, 4)
    bm.free(c)
    assert b_blocks < set(bm.quarantined) and len(bm.quarantined) == 3  # b's two and c's one
    bm.settle(first)  # b's blocks were freed in the first epoch: free for anything now
    assert len(bm.quarantined) == 1 and set(bm.quarantined.values()) == {second}
    bm.settle(second)
    assert bm.quarantined == {}


def test_an_outranking_prompt_runs_whole_in_the_lane_on_blocks_outside_the_quarantine():
    sched = make_scheduler(num_gpu_blocks=32)
    bulk, done = seq("bulk", 8), seq("done", 8, arrival=1)
    for s in (bulk, done):
        sched.add(s)
    step(sched)
    step(sched)  # both decode now
    sched.bm.next_epoch()  # the step in flight
    sched.finish(done)  # ended by a token read back while that step runs: its blocks are quarantined
    quarantined = set(sched.bm.quarantined)
    assert len(quarantined) == 3
    urgent = seq("urgent", 7, priority=10, arrival=2)  # a whole prompt of 7 tokens in one step, two blocks
    sched.add(urgent)
    out = sched.schedule_express()
    assert out is not None and [(i.seq.request_id, i.num_new_tokens, i.samples) for i in out.scheduled] == [
        ("urgent", 7, True)]
    assert urgent.status is SequenceStatus.RUNNING and urgent in sched.running and not sched.waiting
    assert len(urgent.block_table) == 2 and not quarantined & set(urgent.block_table)
    assert sched.stats.num_express == 1


@pytest.mark.parametrize("case", ["same rank", "too long", "nothing running", "swapped first", "no room",
                                  "prompt logprobs"])
def test_the_lane_takes_nothing_it_must_not(case):
    sched = make_scheduler(num_gpu_blocks=8 if case == "no room" else 32)
    running = seq("bulk", 8)
    if case != "nothing running":
        sched.add(running)
        step(sched)
    if case == "no room":  # 2 blocks held, the 6 free ones all freed while the step is in flight
        filler = seq("filler", 24, arrival=1)
        sched.bm.allocate(filler, 24)
        sched.bm.next_epoch()
        sched.bm.free(filler)
        assert sched.bm.gpu.num_free == 6 and sched.bm.gpu.num_free_outside(sched.bm.quarantined) == 0
    if case == "swapped first":
        parked = seq("parked", 4, priority=10, arrival=1)
        parked.status = SequenceStatus.SWAPPED
        sched.swapped.append(parked)
    length = 9 if case == "too long" else 6
    candidate = seq("urgent", length, priority=0 if case == "same rank" else 10, arrival=2)
    if case == "prompt logprobs":
        candidate.prompt_logprobs_from = 1
    sched.add(candidate)
    assert sched.schedule_express() is None
    assert candidate.status is SequenceStatus.WAITING and not candidate.block_table


def test_lower_ranked_admissions_leave_two_lane_prompts_of_blocks_free():
    """Bulk prompts are admitted while their whole prompts (not only the first chunk) leave the
    reserve free: 2 x 8 tokens = 4 blocks of 20. An outranking arrival is not held to it."""
    sched = make_scheduler(num_gpu_blocks=20, express=8, budget=16)
    bulks = [seq(f"bulk{i}", 24, arrival=i) for i in range(3)]  # 6 blocks each, prefilled 16 tokens a step
    for s in bulks:
        sched.add(s)
    for _ in range(6):
        step(sched)
    assert [s.status for s in bulks] == [SequenceStatus.RUNNING, SequenceStatus.RUNNING, SequenceStatus.WAITING]
    assert sched.bm.gpu.num_free >= sched.express.reserve == 4
    urgent = seq("urgent", 8, priority=10, arrival=5)
    sched.add(urgent)
    step(sched)
    assert urgent.status is SequenceStatus.RUNNING  # seated by the regular step, from the reserve
