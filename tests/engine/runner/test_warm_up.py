"""The start-up steps that compile every kernel variant a mixed step can ask for (engine/runner/warm_up.py)."""

from __future__ import annotations

from engine.runner.attention.triton_backend import FUSED_DECODE_MAX_BATCH
from engine.runner.warm_up import QUERY_LENS, compile_mixed_steps, mixed_step_shapes
from sluiceway_kernels.paged_prefill_attention import prefill_config


def test_the_shapes_reach_every_prefill_tile_size_and_both_decode_kernels():
    shapes = mixed_step_shapes(max_model_len=8192, max_tokens=512, num_blocks=10_000, block_size=16)
    assert {d for d, _, _ in shapes} == {1, FUSED_DECODE_MAX_BATCH + 1}
    assert {c for _, c, _ in shapes} == {16, 4096}
    for group in (1, 2, 4, 8):  # any head group: every tile prefill_config can pick, some shape picks
        every = {prefill_config(group, 128, q) for q in range(1, 4096)}
        assert {prefill_config(group, 128, q) for _, _, q in shapes} == every
    # limits: a short model, a small budget, a small cache
    small = mixed_step_shapes(max_model_len=64, max_tokens=40, num_blocks=3, block_size=16)
    assert small and all(d + q <= 40 and q <= 48 and c <= 47 for d, c, q in small)
    assert max(q for _, _, q in small) == max(q for q in QUERY_LENS if q <= 39)


def test_the_steps_run_through_a_runner(make_cpu_engine):
    engine = make_cpu_engine(max_num_batched_tokens=256)
    runner = engine.executor.runner
    assert compile_mixed_steps(runner) == len(mixed_step_shapes(
        engine.max_model_len, 256, runner.num_gpu_blocks, runner.block_size))
    engine.add_request("after", [5, 6, 7], None)  # the engine serves as before
    while engine.has_unfinished_requests():
        engine.step()
