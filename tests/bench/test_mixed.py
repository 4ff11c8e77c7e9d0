"""`sluiceway bench mixed` on the tiny model: interactive jobs over a bulk backlog, through Redis and a worker."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from bench.cli import bench_command


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from engine.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("bench-mixed-tiny") / "model", arch="llama")


pytestmark = pytest.mark.usefixtures("restore_logging")


def workload(model) -> list[str]:
    """The tiny model on the CPU: 8 bulk jobs of 100 + 40 tokens (four fill the 36 blocks of 16),
    interactive jobs of 8 + 4 tokens at 20/s meanwhile."""
    return ["mixed", "--model", str(model), "--load-format", "auto", "--device", "cpu", "--dtype", "float32",
            "--num-gpu-blocks", "36", "--max-num-seqs", "4", "--max-num-batched-tokens", "256",
            "--bulk-requests", "8", "--bulk-input-len", "100", "--bulk-output-len", "40",
            "--interactive-rate", "20", "--interactive-input-len", "8", "--interactive-output-len", "4",
            "--idle-requests", "2", "--swap-space", "0.002"]


def run_bench(args: list[str], out) -> tuple:
    """``sluiceway bench`` with ``args``: its result (exit code checked) and the report it wrote to ``out``."""
    result = CliRunner().invoke(bench_command, args + ["--json", str(out)])
    assert result.exit_code == 0, result.output
    return result, json.loads(out.read_text())


def test_the_bench_reports_ttft_bulk_throughput_and_the_swap_pool(tiny_model, tmp_path):
    out = tmp_path / "mixed.json"
    args = workload(tiny_model) + ["--modes", "swap,fcfs", "--sample-s", "0.05", "--sample-stacks", "--late-admission"]
    result, report = run_bench(args, out)
    assert report["idle"]["done"] == 2 and report["idle"]["ttft_p50_s"] > 0
    assert set(report["bulk_alone"]) == {"swap"} and set(report["runs"]) == {"swap", "fcfs"}
    for mode, run in report["runs"].items():
        assert run["bulk"]["done"] == 8 and run["bulk"]["output_tokens"] == 8 * 40
        assert run["interactive"]["done"] == run["interactive"]["jobs"] > 0, mode
        assert run["bulk_vs_alone"] > 0 and run["ttft_p99_vs_idle"] > 0
        assert run["swap_pool"]["samples"] and run["swap_pool"]["pool_gib_max"] > 0
        assert run["swap_time"]["resizes"] == 0 and run["swap_time"]["resize_s_max"] == 0  # a fixed pool
        stages = run["interactive"]["stages"]  # where the wait for the first token went
        for name in ("read", "ready", "admitted", "scheduled", "launched", "first_token"):
            assert stages[name]["p50_s"] is not None and stages[name]["p99_s"] >= stages[name]["p50_s"] >= 0
        slowest = dict(stages["slowest"][0])
        assert slowest.pop("at_s") >= 0
        assert sum(slowest.values()) == pytest.approx(run["interactive"]["ttft_max_s"], abs=2e-6)
        first = run["interactive_first_steps"]  # the steps that first scheduled interactive prompts
        assert 0 < first["n"] <= run["interactive"]["jobs"] and first["forward"] == {"eager": first["n"]}
        assert first["prefill_tokens"]["p50"] >= 8  # each carries at least one whole interactive prompt
        steps = run["steps"]  # the step loop's calls while the backlog ran
        assert steps["with_prompt"]["n"] > 0 and steps["decode_only"]["n"] > 0
        assert steps["with_prompt"]["max_s"] >= steps["with_prompt"]["p99_s"] >= steps["with_prompt"]["p50_s"] > 0
        longest = steps["longest"]
        assert len(longest) == 5 and longest[0]["duration_s"] >= longest[-1]["duration_s"]
        assert longest[0]["duration_s"] == pytest.approx(max(steps["with_prompt"]["max_s"],
                                                             steps["decode_only"]["max_s"]), abs=1e-4)
        # --sample-stacks: the slowest jobs' long stages, with where the step loop sat meanwhile
        stalls = run["stalls"]
        assert 0 < len(stalls) <= 3 and stalls[0]["ttft_s"] == pytest.approx(run["interactive"]["ttft_max_s"], abs=1e-4)
        windows = [stage["step_loop"] for job in stalls for stage in job["stages"].values()]
        # every stage of 5 ms or more of the three slowest jobs has its window (on a CPU a run can
        # be quicker than that throughout)
        long_stages = [v for job in run["interactive"]["stages"]["slowest"] for k, v in job.items()
                       if k != "at_s" and v >= 0.005]
        assert len(windows) == len(long_stages)
        assert all(w["thread"] == f"sluiceway-step-loop-{mode}" for w in windows)
        if windows:
            assert any(w["samples"] > 0 and w["stacks"][0]["frames"] for w in windows)  # the loop was seen working
        shares = run["step_loop"]  # where the step loop's time went while the backlog ran
        assert sum(shares.values()) == pytest.approx(1.0, abs=0.01) and "execute" in shares
    assert report["runs"]["fcfs"]["stats"]["num_rank_preemptions"] == 0
    assert "interactive TTFT p50" in result.output and "swap stages p50/p99: read" in result.output
    assert "swap step() calls p50/p99/max: with prompt tokens" in result.output
    assert "swap slow job, TTFT" in result.output and "swap step loop's samples while the backlog ran: " in result.output


def test_the_express_mode_runs_interactive_prompts_in_the_lane_through_the_worker(tiny_model, tmp_path):
    """``--modes swap,express``: the same backlog by swap, then with the express lane (late
    admission implied); the interactive prompts go the lane, every job ends."""
    out = tmp_path / "mixed.json"
    # NOTE: eight seats, as a GPU has more seats than the bulk work its cache holds: at four, bulk
    # held every seat most of the time, the lane (which takes a free seat) ran 2-6 of ~10
    # interactive prompts, and one CI run none; at eight it ran 7-9 of ~10
    args = workload(tiny_model) + ["--modes", "swap,express", "--express-lane-tokens", "16", "--sample-s", "0.05",
                                   "--max-num-seqs", "8"]
    _, report = run_bench(args, out)
    assert set(report["bulk_alone"]) == {"swap"} and set(report["runs"]) == {"swap", "express"}
    for run in report["runs"].values():
        assert run["bulk"]["done"] == 8 and run["interactive"]["done"] == run["interactive"]["jobs"] > 0
    assert report["runs"]["swap"]["stats"]["num_express"] == 0
    express = report["runs"]["express"]
    assert express["stats"]["num_express"] > 0
    assert express["interactive_first_steps"]["forward"].get("express_lane", 0) > 0


def test_without_prefix_caching_a_recomputed_victim_computes_its_prompt_again(tiny_model, tmp_path):
    """``--no-enable-prefix-caching``: recompute's real cost (with caching a victim's freed
    blocks may still be cached when it comes back); the report counts the prompt tokens
    each run computed."""
    out = tmp_path / "mixed.json"
    args = workload(tiny_model) + ["--modes", "recompute,recompute", "--no-enable-prefix-caching"]
    result, report = run_bench(args, out)
    assert list(report["runs"]) == ["recompute", "recompute#2"]  # a mode named twice runs twice
    for run in report["runs"].values():
        prompts = 8 * 100 + run["interactive"]["jobs"] * 8  # every job's prompt, computed once
        assert run["stats"]["num_recomputes"] > 0 and run["stats"]["prefix_cache_hit_tokens"] == 0
        assert run["stats"]["num_prompt_tokens"] > prompts, "the recomputed victims' prompts ran again"
        assert f"{run['stats']['num_prompt_tokens']} prompt tokens computed" in result.output


def test_every_phase_meets_the_same_interactive_arrival_times():
    from itertools import islice

    from bench.mixed import arrival_offsets

    first = list(islice(arrival_offsets(2.0, seed=0), 400))
    assert first == list(islice(arrival_offsets(2.0, seed=0), 400))  # a second phase: the same times
    assert first != list(islice(arrival_offsets(2.0, seed=1), 400))
    assert all(b > a for a, b in zip(first, first[1:]))
    assert 0.4 < first[-1] / len(first) < 0.6  # about 1 / rate apart
