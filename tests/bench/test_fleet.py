"""`sluiceway bench fleet`: real worker processes on the instant engine against a real Redis."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from bench.fleet import fleet_command
from bench.instant_engine import InstantEngine
from engine.sampling_params import SamplingParams
from tests.redis_server import redis7_executable

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
    args = ["--workers", "2", "--producers", "1", "--jobs", "200", "--window", "50", "--idle-seconds", "1.5",
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
    # an idle worker waits; it does not poll (polling was ~24/s). NOTE: 1.5 s, not less: a worker's
    # last start-up commands can land in a short window and count several per second each
    assert 0 <= report["idle_commands_per_s_per_worker"] < 12


def run_fleet_cli(tmp_path, name: str, *extra: str) -> dict:
    out = tmp_path / f"{name}.json"
    args = ["--workers", "2", "--producers", "1", "--jobs", "200", "--window", "50", "--idle-seconds", "1",
            "--output-len", "4", "--json", str(out), "--redis-server", redis7_executable(), *extra]
    result = CliRunner().invoke(fleet_command, args)
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def test_on_a_cluster_the_fleet_bench_sums_every_master_and_shows_each(tmp_path):
    single = run_fleet_cli(tmp_path, "single")
    cluster = run_fleet_cli(tmp_path, "cluster", "--cluster-masters", "3", "--queue-shards", "3")
    assert cluster["workload"]["masters"] == 3 and cluster["workload"]["queue_shards"] == 3
    assert single["workload"]["masters"] == 1 and len(single["by_master"]) == 1
    assert set(single) <= set(cluster)  # every field of the single server's report
    masters = cluster["by_master"]
    assert len(masters) == 3 and all(m["commands_per_job"] > 0 and m["redis_cpu_s_per_1000_jobs"] > 0 for m in masters)
    assert sum(m["commands_per_job"] for m in masters) == pytest.approx(cluster["commands_per_job"], abs=0.05)
    # the same protocol, summed over the masters: about what one server counts, not a third of it
    assert 0.7 * single["commands_per_job"] <= cluster["commands_per_job"] <= 1.5 * single["commands_per_job"]
    assert cluster["commands_per_job_by_name"]["evalsha"] == pytest.approx(3, abs=0.2)
    assert "command|getkeys" not in cluster["commands_per_job_by_name"]  # keys read locally, not asked for
    assert cluster["busiest_master_cpu_over_mean"] >= 1
    # an idle worker of 3 shards: one wait per shard, not a sweep of every stream every 100 ms
    # (before: ~70 a second; a 1 s phase still holds each worker's start-up reads of its 6 streams)
    assert cluster["idle_commands_per_s_per_worker_by_name"].get("xreadgroup", 0) < 20


def test_a_cluster_run_needs_the_cluster_layout():
    result = CliRunner().invoke(fleet_command, ["--cluster-masters", "3"])
    assert result.exit_code != 0 and "--queue-shards" in result.output and "N >= 1" in result.output


def test_at_a_gpu_cadence_the_instant_engine_hands_out_tokens_step_by_step():
    engine = InstantEngine(tokens_per_step=2)
    engine.add_request("a", [1], SamplingParams(max_tokens=5))
    steps = [engine.step()[0].outputs[0]]
    assert engine.output_token_ids("a") == [[10, 11]]  # the progress a worker checkpoints
    steps += [engine.step()[0].outputs[0] for _ in range(2)]
    assert [c.delta_token_ids for c in steps] == [[10, 11], [12, 13], [14]]
    assert [c.finish_reason for c in steps] == [None, None, "length"] and engine.num_unfinished_seqs() == 0
    assert engine.output_token_ids("a") is None  # ended: nothing to checkpoint
