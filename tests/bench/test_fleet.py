"""`sluiceway bench fleet`: real worker processes on the instant engine against a real Redis."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from bench.fleet import fleet_command
from bench.instant_engine import InstantEngine
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("restore_logging")


def test_the_instant_engine_ends_each_request_at_the_next_step():
    engine = InstantEngine(max_num_seqs=4)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=5))
    engine.add_request("b", "two words", SamplingParams(max_tokens=2), resume_token_ids=[7])
    assert engine.num_unfinished_seqs() == 2
    out = {o.request_id: o for o in engine.step()}
    assert len(out["a"].outputs[0].token_ids) == 5 and out["a"].finished
    assert len(out["b"].outputs[0].token_ids) == 1 and out["b"].prompt_token_ids == [1, 1]
    assert engine.num_unfinished_seqs() == 0 and engine.get_stats().num_generation_tokens == 6


def test_the_fleet_bench_reports_costs_per_job(tmp_path):
    out = tmp_path / "fleet.json"
    args = ["--workers", "2", "--producers", "1", "--jobs", "200", "--window", "50", "--idle-seconds", "0.5",
            "--output-len", "4", "--json", str(out), "--stream"]
    result = CliRunner().invoke(fleet_command, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["workload"]["jobs"] == 200 and report["jobs_per_s"] > 0
    by_name = report["commands_per_job_by_name"]
    assert by_name["evalsha"] >= 3  # submit, start, write: the scripts every job runs
    assert by_name["xadd"] >= 2  # the entry, and its tokens
    assert report["bytes_in_per_job"] > 0 and report["redis_cpu_s_per_1000_jobs"] > 0
    assert 0 < report["latency_s"]["p50"] <= report["latency_s"]["p99"]
    assert 0 <= report["idle_commands_per_s_per_worker"] < 12  # an idle worker waits; it does not poll


def test_at_a_gpu_cadence_the_instant_engine_hands_out_tokens_step_by_step():
    engine = InstantEngine(tokens_per_step=2)
    engine.add_request("a", [1], SamplingParams(max_tokens=5))
    steps = [engine.step()[0].outputs[0]]
    assert engine.output_token_ids("a") == [[10, 11]]  # the progress a worker checkpoints
    steps += [engine.step()[0].outputs[0] for _ in range(2)]
    assert [c.delta_token_ids for c in steps] == [[10, 11], [12, 13], [14]]
    assert [c.finish_reason for c in steps] == [None, None, "length"] and engine.num_unfinished_seqs() == 0
    assert engine.output_token_ids("a") is None  # ended: nothing to checkpoint
