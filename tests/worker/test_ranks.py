"""Queue rank inside the engine through a real worker: interactive work overtakes bulk work
that fills the KV cache (worker/ranks.py, engine/core/ranking.py)."""

from __future__ import annotations

from producers.protocol import Keys
from tests.worker.conftest import wait_for
from worker.admission import Work
from worker.intake_reads import LATER_QUEUE_BATCH
from worker.ranks import BAND, Ranks

KEYS = Keys()


def test_an_interactive_job_overtakes_a_cache_full_of_bulk_ones(start_worker, client, r, make_engine):
    # four seats and 20 blocks of 16 tokens: four bulk jobs of 70 tokens at full length fill them
    engine = make_engine(max_num_seqs=4, block_size=16, num_gpu_blocks_override=20, swap_space=0.01,
                         preemption_mode="swap")
    long = {"temperature": 0, "max_tokens": 60, "ignore_eos": True}
    bulk = [client.submit(prompt_token_ids=[5 + i] * 10, sampling=long, queue="bulk") for i in range(4)]
    start_worker(engine, swap_space="0.01")  # a fixed pool, so the victim is swapped out
    wait_for(lambda: engine.get_stats().num_running == 4 and engine.get_stats().num_generation_tokens >= 8,
             what="four bulk jobs generating")
    urgent = client.submit(prompt_token_ids=[9, 8, 7, 6], sampling={"temperature": 0, "max_tokens": 4},
                           queue="interactive")
    result = client.result(urgent, timeout=60)
    assert len(result.outputs[0].token_ids) == 4
    still_running = [b for b in bulk if r.hget(KEYS.job(b), "status") == "running"]
    assert still_running == bulk, "the interactive job waited for bulk work to finish"
    for job_id in bulk:
        client.result(job_id, timeout=60)
    stats = engine.get_stats()
    assert stats.num_rank_preemptions >= 1 and stats.num_swap_outs >= 1


def test_ranks_put_every_job_of_an_earlier_queue_above_every_job_of_a_later_one():
    ranks = Ranks(("interactive", "bulk"))

    def work(queue, priority):
        from producers.protocol import Job
        return Work(job=Job(id="x", prompt="p", priority=priority), sink=None, queue=queue)

    top_bulk = ranks.engine_priority(work("bulk", 10**64 - 1))
    low_interactive = ranks.engine_priority(work("interactive", -(10**64 - 1)))
    assert low_interactive > top_bulk
    assert ranks.engine_priority(work("bulk", 3)) > ranks.engine_priority(work("bulk", 2))
    assert ranks.engine_priority(work("celery:sluiceway", 0)) == ranks.engine_priority(work("bulk", 0)) < BAND


def test_a_bulk_backlog_is_read_in_batches_short_enough_for_the_first_queue_to_come_in(
        client, make_engine, tiny_model, redis_server):
    from tests.worker.conftest import worker_settings
    from worker.loop import Worker

    engine = make_engine(max_num_seqs=64)  # room for all of the backlog in one read
    sampling = {"temperature": 0, "max_tokens": 2}
    client.submit_many(({"prompt_token_ids": [5 + i] * 8, "sampling": sampling} for i in range(100)), queue="bulk")
    worker = Worker(worker_settings(tiny_model, redis_server), engine=engine)
    try:
        worker.admission.set_capacity(worker.engine.capacity())
        for _ in range(5):  # the reader's own pending entries, the claim round, then new entries
            worker.intake.tick()
            if len(worker.held):
                break
        read_first = len(worker.held)
        urgent = client.submit(prompt_token_ids=[9, 8, 7], sampling=sampling, queue="interactive")
        worker.intake.tick()
        assert urgent in worker.held  # the next round reads it, ahead of the rest of the backlog
        # not the whole backlog in one round: at most LATER_QUEUE_BATCH a round
        assert 0 < read_first <= LATER_QUEUE_BATCH, f"{read_first} bulk jobs read in the round before the interactive one"
    finally:
        worker.admission.close()
        worker.intake._waiter.close()
        worker.redis.close()


def test_a_wait_on_the_first_queue_alone_is_short_while_later_queues_hold_work(
        client, make_engine, tiny_model, redis_server):
    """With the room left at the first queue's reserve, a round reads only the first queue; its
    wait must end soon, so that bulk work is read again once finished jobs free room (a full
    blocking wait left a draining engine idle for up to the block time)."""
    import time

    from tests.worker.conftest import worker_settings
    from worker.loop import Worker

    engine = make_engine(max_num_seqs=2)
    client.submit_many(({"prompt_token_ids": [5 + i] * 8, "sampling": {"max_tokens": 2}} for i in range(8)),
                       queue="bulk")
    worker = Worker(worker_settings(tiny_model, redis_server), engine=engine)
    worker.intake.block_ms = 10_000
    try:
        reserve = worker.engine.top_queue_reserve
        worker.admission.set_capacity(reserve)
        worker.intake.tick()  # the reader's own pending entries
        worker.intake.tick()  # the claim round
        started = time.monotonic()
        for _ in range(3):  # new entries: the first queue read, then waited on
            worker.intake.tick()
        assert time.monotonic() - started < 2.0, "waited on the first queue as if every queue were empty"
        assert len(worker.held) == 0  # no bulk job took the reserve
        worker.admission.set_capacity(reserve + 3)
        for _ in range(3):
            worker.intake.tick()
        assert len(worker.held) == 3, "the bulk backlog is read once there is room"
    finally:
        worker.admission.close()
        worker.intake._waiter.close()
        worker.redis.close()
