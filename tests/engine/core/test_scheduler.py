"""Scheduler and block manager on their own: plain Python, no torch, no model."""

import sys

import pytest

from engine.core.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.config import SchedulerConfig
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence, SequenceStatus

BS = 4


def make_scheduler(num_gpu_blocks=64, num_cpu_blocks=0, budget=64, max_num_seqs=8, mode="auto", caching=True):
    bm = BlockManager(BS, num_gpu_blocks, num_cpu_blocks, enable_prefix_caching=caching)
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          max_model_len=1024, preemption_mode=mode)
    return Scheduler(cfg, bm)


def make_requests(lengths, start=0, priority=0, prefix=()):
    seqs = []
    for i, n in enumerate(lengths):
        tokens = list(prefix) + [1000 + 97 * (start + i) + j for j in range(n - len(prefix))]
        seqs.append(Sequence(f"r{start + i}", 0, tokens, len(tokens), SamplingParams(max_tokens=8),
                             priority=priority, arrival_order=start + i))
    return seqs


def run_step(sched, next_token=7):
    """One synchronous step: the scheduler's books, and the engine's part (a token appended
    to every sequence that samples)."""
    out = sched.schedule()
    sched.update_from_output(out)
    for s in out.scheduled:
        if s.samples:
            s.seq.token_ids.append(next_token)
    sched.commit_filled_blocks(out)
    return out


def finish_all(sched):
    for seq in list(sched.running) + list(sched.waiting) + list(sched.swapped):
        sched.finish(seq)


def test_no_torch_imported():
    import subprocess
    code = "import sys, engine.core.scheduler, engine.core.block_manager; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_token_budget_mixes_chunked_prefill_and_decode():
    sched = make_scheduler(budget=10)
    a, b = make_requests([6, 12])
    sched.add(a)
    sched.add(b)
    out = run_step(sched)
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("r0", 6), ("r1", 4)]
    assert a.num_tokens == 7 and b.num_tokens == 12  # a sampled, b is mid-prefill
    out = run_step(sched)
    # a decodes one token, b continues its prefill with the rest of the budget
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("r0", 1), ("r1", 8)]
    assert b.num_computed_tokens == 12 and b.num_tokens == 13


def test_priority_first_then_fcfs():
    sched = make_scheduler(max_num_seqs=2)
    low = make_requests([4], start=0, priority=0)[0]
    high = make_requests([4], start=1, priority=5)[0]
    also_low = make_requests([4], start=2, priority=0)[0]
    for s in (low, high, also_low):
        sched.add(s)
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["r1", "r0"]
    assert sched.waiting == [also_low]


def test_prefix_cache_reuse_counts_as_computed_tokens():
    sched = make_scheduler()
    shared = list(range(1, 13))  # three full blocks
    first = make_requests([14], start=0, prefix=shared)[0]
    sched.add(first)
    run_step(sched)
    second = make_requests([15], start=1, prefix=shared)[0]
    sched.add(second)
    out = run_step(sched)
    new = {s.seq.request_id: s.num_new_tokens for s in out.scheduled}
    assert second.num_cached_tokens == 12
    assert new["r1"] == 15 - 12
    assert second.block_table[:3] == first.block_table[:3]
    assert sched.bm.gpu.ref_counts[first.block_table[0]] == 2
    assert sched.bm.prefix_stats.hit_tokens == 12


def test_whole_prompt_cached_still_computes_last_token():
    sched = make_scheduler()
    a = make_requests([8], start=0)[0]
    sched.add(a)
    run_step(sched)
    b = Sequence("b", 0, a.token_ids[:8], 8, SamplingParams(), arrival_order=5)
    sched.add(b)
    out = run_step(sched)
    assert b.num_cached_tokens == 4  # one block; the second must be recomputed for logits
    assert [s.num_new_tokens for s in out.scheduled if s.seq is b] == [4]


def test_preemption_by_recompute_frees_latest_and_resumes():
    sched = make_scheduler(num_gpu_blocks=6, mode="recompute", caching=False)
    a, b = make_requests([8, 8])
    sched.add(a)
    sched.add(b)
    run_step(sched)  # each holds 2 blocks + 1 token in a third
    outs = [run_step(sched) for _ in range(6)]
    preempted = [p for o in outs for p in o.preempted]
    assert preempted and preempted[0] is b  # the later arrival goes first
    assert sched.stats.num_recomputes >= 1
    while sched.has_unfinished():
        run_step(sched)
        for seq in list(sched.running):
            if seq.num_output_tokens >= 6:
                sched.finish(seq)
    assert sched.bm.gpu.num_free == 6
    assert all(r == 0 for r in sched.bm.gpu.ref_counts)


def test_swap_out_and_back_in_before_new_work():
    sched = make_scheduler(num_gpu_blocks=6, num_cpu_blocks=16, mode="swap", caching=False)
    a, b = make_requests([8, 8])
    sched.add(a)
    sched.add(b)
    run_step(sched)
    out = None
    for _ in range(6):
        out = run_step(sched)
        if out.blocks_to_swap_out:
            break
    assert out.blocks_to_swap_out and b.status is SequenceStatus.SWAPPED
    late = make_requests([4], start=9)[0]
    sched.add(late)
    sched.finish(a)  # room comes back
    out = run_step(sched)
    assert out.blocks_to_swap_in and b.status is SequenceStatus.RUNNING
    # the swapped sequence comes back first; the pool is then empty, so new work joins the same step
    assert [s.seq.request_id for s in out.scheduled] == ["r1", "r9"]
    assert sched.bm.cpu.num_free == 16
    finish_all(sched)
    assert sched.bm.gpu.num_free == 6 and all(r == 0 for r in sched.bm.gpu.ref_counts)


def test_full_swap_pool_falls_back_to_recompute():
    sched = make_scheduler(num_gpu_blocks=6, num_cpu_blocks=1, mode="swap", caching=False)
    a, b = make_requests([8, 8])
    sched.add(a)
    sched.add(b)
    for _ in range(7):
        run_step(sched)
    assert sched.stats.num_recomputes >= 1 and sched.stats.num_swap_outs == 0


def test_shared_block_swapped_once():
    bm = BlockManager(BS, 16, 16, enable_prefix_caching=True)
    shared = list(range(1, 9))
    a = Sequence("a", 0, shared + [50], 9, SamplingParams())
    bm.allocate(a, 9)
    a.num_computed_tokens = 9
    bm.commit(a)
    b = Sequence("b", 0, shared + [60], 9, SamplingParams())
    cached = bm.find_cached_prefix(b)
    assert len(cached) == 2
    bm.allocate(b, 1, cached)
    b.num_computed_tokens = 9
    bm.commit(b)
    copies_a = bm.swap_out(a)
    a.status = SequenceStatus.SWAPPED
    copies_b = bm.swap_out(b)
    b.status = SequenceStatus.SWAPPED
    assert len(copies_a) == 3 and len(copies_b) == 1  # b's two shared blocks are not copied again
    assert a.block_table[:2] == b.block_table[:2]
    bm.free(a)
    assert bm.cpu.ref_counts[b.block_table[0]] == 1  # not freed early
    bm.free(b)
    assert bm.cpu.num_free == 16 and bm.gpu.num_free == 16


def test_refcounts_zero_and_no_leak_after_everything_finishes():
    sched = make_scheduler(num_gpu_blocks=20, num_cpu_blocks=8, budget=16, max_num_seqs=4)
    shared = list(range(1, 9))
    seqs = make_requests([9, 13, 5, 17, 11, 9], prefix=shared[:4]) + make_requests([12, 10], start=6, prefix=shared)
    for s in seqs:
        sched.add(s)
    for _ in range(200):
        if not sched.has_unfinished():
            break
        run_step(sched)
        for seq in list(sched.running):
            if seq.num_output_tokens >= 5:
                sched.finish(seq)
    assert not sched.has_unfinished()
    assert sched.bm.gpu.num_free == 20 and sched.bm.cpu.num_free == 8
    assert all(r == 0 for r in sched.bm.gpu.ref_counts + sched.bm.cpu.ref_counts)


def test_abort_waiting_and_running():
    sched = make_scheduler()
    a, b = make_requests([5, 5])
    sched.add(a)
    run_step(sched)
    sched.add(b)
    sched.finish(a)
    sched.finish(b)
    assert not sched.has_unfinished() and sched.bm.gpu.num_free == 64


def test_the_scheduler_keeps_its_own_books():
    """A step's tokens count as computed once it ran (``update_from_output``); a full block is
    published to the prefix cache once the step's tokens are read back (``commit_filled_blocks``)."""
    sched = make_scheduler(budget=8, max_num_seqs=4)
    (a,) = make_requests([6])
    sched.add(a)
    out = sched.schedule()
    assert a.num_computed_tokens == 0 and out.scheduled[0].num_computed_tokens == 0
    sched.update_from_output(out)
    assert a.num_computed_tokens == 6 and out.scheduled[0].samples
    assert sched.bm.gpu.cached == {}  # block 0 is computed, but unpublished until read back
    a.token_ids.append(7)
    sched.commit_filled_blocks(out)
    assert list(sched.bm.gpu.cached.values()) == [a.block_table[0]]


def test_a_step_that_never_ran_is_scheduled_again():
    sched = make_scheduler(budget=8, max_num_seqs=4)
    (a,) = make_requests([6])
    sched.add(a)
    first = sched.schedule()  # its execution raised: no update_from_output
    sched.update_from_output(again := sched.schedule())
    assert [(s.num_computed_tokens, s.num_new_tokens) for s in again.scheduled] == [(0, 6)]
    assert [(s.seq, s.num_new_tokens) for s in first.scheduled] == [(a, 6)] and a.num_computed_tokens == 6


@pytest.mark.parametrize("bad", [dict(max_num_batched_tokens=0), dict(preemption_mode="never")])
def test_config_errors(bad):
    with pytest.raises(ValueError):
        SchedulerConfig(**bad)
