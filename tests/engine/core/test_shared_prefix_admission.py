"""Sequences that share a prefix and arrive together: the prefix is computed once."""

from engine.core.sequence import Sequence
from engine.sampling_params import SamplingParams
from tests.engine.core.test_scheduler import BS, finish_all, make_requests, make_scheduler, run_step

PREFIX = list(range(500, 500 + 5 * BS))  # five full blocks


def test_a_prefix_being_computed_is_waited_for_and_then_hit():
    sched = make_scheduler(budget=64)
    first, second, third = make_requests([5 * BS + 3] * 3, prefix=PREFIX)
    other = make_requests([9], start=10)[0]
    for seq in (first, second, third, other):
        sched.add(seq)
    out = run_step(sched)
    # the first computes the prefix; the two sharing it wait, the unrelated one runs beside it
    assert [s.seq for s in out.scheduled] == [first, other]
    out = run_step(sched)  # the prefix is published: both find all five blocks
    assert {second, third} <= {s.seq for s in out.scheduled}
    assert second.num_cached_tokens == third.num_cached_tokens == 5 * BS
    assert sched.bm.prefix_stats.hit_tokens == 2 * 5 * BS
    finish_all(sched)
    assert not sched.bm._computing and not sched.bm._computing_of


def test_a_prefix_whose_computer_finished_unpublished_is_no_longer_waited_for():
    sched = make_scheduler(budget=30)
    first, second = make_requests([5 * BS + 3] * 2, prefix=PREFIX)
    sched.add(first)
    sched.add(second)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [first]  # second waits, though 7 tokens of budget are left
    sched.update_from_output(out)
    sched.finish(first)  # aborted before its step was read back: it publishes nothing
    sched.commit_filled_blocks(out)
    out = run_step(sched)
    assert [s.seq for s in out.scheduled] == [second] and second.num_cached_tokens == 0
    finish_all(sched)
    assert not sched.bm._computing


def test_a_sequence_wanting_prompt_logprobs_does_not_wait_for_blocks_it_cannot_use():
    sched = make_scheduler(budget=64)
    first = make_requests([5 * BS + 3], prefix=PREFIX)[0]
    tokens = list(first.token_ids)
    wants = Sequence("lp", 0, tokens, len(tokens), SamplingParams(max_tokens=1, prompt_logprobs=0),
                     arrival_order=5, prompt_logprobs_from=1)
    sched.add(first)
    sched.add(wants)
    out = run_step(sched)
    assert [s.seq for s in out.scheduled] == [first, wants] and wants.num_cached_tokens == 0
    finish_all(sched)


def test_sequences_passed_over_hash_their_blocks_only_as_far_as_the_lookups_go():
    """A queue of jobs waiting for a shared prefix is looked up at every step: each lookup
    hashes a prompt's blocks up to its first miss, not the whole prompt (2,048 grading prompts
    hashed whole held the first step about a second)."""
    sched = make_scheduler(budget=64)
    first, *waiting = make_requests([5 * BS + 3] * 6, prefix=PREFIX)
    for seq in (first, *waiting):
        sched.add(seq)
    run_step(sched)  # the first computes the prefix; the others wait for its first block
    assert [len(s.block_hashes) for s in waiting] == [1] * 5
    out = run_step(sched)  # published: they find the whole prefix, hashed as far as it goes
    assert all(s.seq.num_cached_tokens == 5 * BS and len(s.seq.block_hashes) == 5 for s in out.scheduled
               if s.seq in waiting)
    finish_all(sched)
