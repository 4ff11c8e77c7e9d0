"""The swap-pool sizing rule and the component that applies it."""

from __future__ import annotations

import pytest

from worker.swap_sizing import SwapSizer, swap_pool_bytes

MIB = 1 << 20
GIB = 1 << 30


def test_a_drained_queue_gets_the_floor():
    assert swap_pool_bytes(0, 50 * MIB, floor=1 * GIB, cap=8 * GIB) == 1 * GIB


def test_demand_grows_with_the_backlog_in_granules():
    # 30 jobs x 50 MiB = 1500 MiB -> rounded up to 1536 MiB (6 x 256 MiB)
    assert swap_pool_bytes(30, 50 * MIB, floor=0, cap=8 * GIB) == 1536 * MIB
    assert swap_pool_bytes(31, 50 * MIB, floor=0, cap=8 * GIB) == 1792 * MIB
    sizes = [swap_pool_bytes(b, 10 * MIB, floor=256 * MIB, cap=64 * GIB) for b in range(0, 5000, 50)]
    assert sizes == sorted(sizes)


def test_the_cap_protects_the_host():
    assert swap_pool_bytes(10_000_000, 50 * MIB, floor=1 * GIB, cap=8 * GIB) == 8 * GIB
    assert swap_pool_bytes(10, 1 * MIB, floor=4 * GIB, cap=2 * GIB) == 2 * GIB  # the cap wins a conflict


def test_small_moves_of_the_backlog_do_not_change_the_size():
    assert len({swap_pool_bytes(b, 1 * MIB, floor=0, cap=GIB, granule=64 * MIB) for b in range(1, 64)}) == 1


def test_only_what_the_gpu_cannot_hold_is_parked():
    # 100 jobs x 320 MiB = 32000 MiB; a 20 GiB GPU cache holds 20480 MiB of it
    assert swap_pool_bytes(100, 320 * MIB, floor=0, cap=64 * GIB, gpu_kv_bytes=20 * GIB) == 11520 * MIB
    assert swap_pool_bytes(60, 320 * MIB, floor=GIB, cap=64 * GIB, gpu_kv_bytes=20 * GIB) == GIB  # fits: the floor


def test_jobs_waiting_in_redis_hold_no_kv():
    deep = swap_pool_bytes(100_000, 320 * MIB, floor=0, cap=1 << 50, gpu_kv_bytes=20 * GIB, max_jobs_in_engine=512)
    assert deep == swap_pool_bytes(512, 320 * MIB, floor=0, cap=1 << 50, gpu_kv_bytes=20 * GIB)
    assert deep == 512 * 320 * MIB - 20 * GIB


def test_the_sizer_passes_the_engine_bounds_on():
    sizer = SwapSizer(floor=0, cap=1 << 50, kv_bytes_per_token=1000, prior_tokens_per_job=100, granule=1,
                      gpu_kv_bytes=500_000, max_jobs_in_engine=8)
    assert sizer.target(5) == 0 and sizer.target(1000) == 8 * 100_000 - 500_000


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="backlog=-1"):
        swap_pool_bytes(-1, 1.0, 0, 1)


class RecordingEngine:
    """Stands in for the engine's resize call: rounds to 4 MiB blocks, as a block pool would."""

    def __init__(self):
        self.calls = []

    def resize_swap_pool(self, num_bytes):
        self.calls.append(num_bytes)
        return num_bytes // (4 * MIB) * (4 * MIB)


def test_the_sizer_grows_at_once_and_shrinks_only_after_a_quiet_spell():
    engine = RecordingEngine()
    sizer = SwapSizer(floor=256 * MIB, cap=8 * GIB, kv_bytes_per_token=1024, prior_tokens_per_job=1024 * 8,
                      every_s=1.0, shrink_after_s=30.0)  # 8 MiB per job
    assert sizer.tick(engine, backlog=0, now=0.0) == 256 * MIB
    assert sizer.tick(engine, backlog=500, now=0.5) is None  # not yet time to look again
    assert sizer.tick(engine, backlog=500, now=1.0) == 4096 * MIB  # 500 x 8 MiB, rounded up
    assert sizer.tick(engine, backlog=500, now=2.0) is None  # unchanged target: no call
    assert sizer.tick(engine, backlog=10, now=3.0) is None  # lower, but only just
    assert sizer.tick(engine, backlog=100, now=20.0) is None
    assert sizer.tick(engine, backlog=10, now=33.5) == 1024 * MIB  # the largest target of the spell
    assert engine.calls == [256 * MIB, 4096 * MIB, 1024 * MIB]
    # what the resizes cost the step loop they run on
    assert sizer.num_resizes == 3 and 0 < sizer.resize_s_max <= sizer.resize_s_total


def test_the_sizer_learns_the_kv_size_of_recent_jobs():
    sizer = SwapSizer(floor=0, cap=64 * GIB, kv_bytes_per_token=1000, prior_tokens_per_job=100, granule=1)
    for _ in range(100):
        sizer.observe_job(2000)
    assert sizer.target(10) == pytest.approx(10 * 2000 * 1000, rel=0.01)


def test_a_failed_resize_keeps_the_old_pool_and_tries_again():
    class Refusing:
        def resize_swap_pool(self, num_bytes):
            raise RuntimeError("cannot pin that much")

    sizer = SwapSizer(floor=GIB, cap=2 * GIB, kv_bytes_per_token=1, prior_tokens_per_job=1)
    assert sizer.tick(Refusing(), backlog=0, now=0.0) is None
    assert sizer.tick(RecordingEngine(), backlog=0, now=1.0) == GIB
