"""The step log on a CUDA GPU: with async scheduling each call is charged to the step before,
as the engine reports it, and a profile window is timed without the step ranges."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_gpu_call_waits_for_the_step_it_reads_back(tmp_path, async_scheduling):
    from bench.run import STEP_LABEL, make_workload, run_requests
    from engine import LLM
    from engine.models.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "model", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2)
    llm = LLM(str(model), load_format="dummy", device="cuda", dtype="bfloat16", swap_space=0,
              async_scheduling=async_scheduling, max_num_batched_tokens=64, max_num_seqs=4, enforce_eager=True,
              gpu_memory_utilization=0.2)
    engine = llm.llm_engine
    records = []
    engine.add_step_observer(records.append)
    run = run_requests(llm, make_workload(4, 24, 12, engine.vocab_size, seed=1), profile_windows=[(3, 6)])
    llm.shutdown()
    assert run["output_tokens"] == 4 * 12
    if async_scheduling:  # the launch returns at once; the call waits when it reads the step before back
        assert [r.waited_for for r in records] == [None] + [r.step - 1 for r in records[1:]]
        charged = [(n, t) for _, n, t in run["steps"]["trace"]]
        assert charged == [(0, 0)] + [(r.num_seqs, r.num_batched_tokens) for r in records[:-1]]
    else:
        assert [r.waited_for for r in records] == [r.step for r in records]
    (profile,) = run["profiles"]
    assert profile["steps"] == "3:6" and profile["gpu_busy_s"] > 0
    assert profile["top_kernels"] and all(name != STEP_LABEL for name, _ in profile["top_kernels"])
    # the kernels' own shares and the idle gaps cover the window's timeline, no more than its device time
    own = sum(ms for _, ms in profile["top_kernels_own"]) / 1e3
    assert profile["gpu_idle_s"] >= 0 and 0 < own <= profile["gpu_busy_s"] + 1e-6


def test_the_kernel_bench_times_kernels_in_cuda_graphs_over_inputs_that_miss_l2(tmp_path):
    """Graph timing at small decode shapes is below eager timing (launch overhead gone), and
    every kernel row says how it was timed."""
    import json

    from bench import kernels as bench_kernels

    rows = {}
    for timing in ("graph", "eager"):
        out = tmp_path / f"{timing}.json"
        assert bench_kernels.main(["--only", "decode,pointwise", "--timing", timing, "--json", str(out)]) == 0
        rows[timing] = {(r["name"], r["case"]): r for r in json.loads(out.read_text())}
    assert {r["timing"] for r in rows["graph"].values()} == {"graph"}
    assert {r["timing"] for r in rows["eager"].values()} == {"eager"}
    small = ("decode", "B=1 ctx=2048 bs=16")
    assert rows["graph"][small]["kernel_ms"] < rows["eager"][small]["kernel_ms"]
