"""`sluiceway bench throughput` end to end on the CPU with a tiny model: the JSON it writes."""

from __future__ import annotations

import json

import pytest

from click.testing import CliRunner

from bench.cli import bench_command
from engine.models.tiny import build_tiny_model


def test_throughput_json_counts_every_token_and_names_the_slowest_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))  # absent: the compile count is unknown
    model = build_tiny_model(tmp_path / "model", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1)
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(bench_command, [
        "throughput", "--model", str(model), "-n", "6", "--input-len", "12", "--output-len", "5",
        "--max-num-seqs", "4", "--json", str(out),
    ])
    assert result.exit_code == 0, result.output
    run = json.loads(out.read_text())["engine"]
    assert run["output_tokens"] == 6 * 5 and run["input_tokens"] == 6 * 12
    slowest = run["steps"]["slowest_steps"]
    assert 1 <= len(slowest) <= 5
    assert [s[0] for s in slowest] == sorted((s[0] for s in slowest), reverse=True)
    assert all(1 <= seqs <= 4 and tokens >= seqs for _, seqs, tokens in slowest)
    assert run["kernels_compiled_in_run"] is None

    (tmp_path / "triton").mkdir()  # readable (and unchanged by a CPU run): nothing compiled inside the timing
    result = CliRunner().invoke(bench_command, [
        "throughput", "--model", str(model), "-n", "2", "--input-len", "4", "--output-len", "2", "--json", str(out),
    ])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["engine"]["kernels_compiled_in_run"] == 0


def test_latency_profiles_only_after_its_timed_runs(tmp_path):
    """torch.profiler leaves CUPTI attached once it has traced CUDA, slowing every later eager
    launch: the latency bench must time nothing after a profiled run (it once counted launches
    in its warm-up, and its TTFT rose by the prefill's launches times that overhead)."""
    model = build_tiny_model(tmp_path / "model", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1)
    out, profiles = tmp_path / "latency.json", tmp_path / "profiles"
    result = CliRunner().invoke(bench_command, [
        "latency", "--model", str(model), "--input-len", "8", "--output-len", "112", "--num-iters", "2",
        "--profile-dir", str(profiles), "--json", str(out),
    ])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["timed_after_profiler"] is False
    assert report["profiles"] and any(profiles.iterdir())  # the profile was still taken
    assert report["engine"]["ttft_ms_p50"] > 0


def test_latency_counts_a_token_when_the_step_that_returns_it_ends(tmp_path):
    """With async scheduling the first step only launches the prefill; TTFT must still end at
    the first token, and every later token gives exactly one inter-token gap, in both modes."""
    from engine import LLM
    from bench.latency import token_intervals
    from bench.run import make_workload, run_requests

    model = build_tiny_model(tmp_path / "model", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1)
    first_step_tokens = {}
    for mode in (False, True):
        llm = LLM(str(model), load_format="dummy", device="cpu", swap_space=0, async_scheduling=mode)
        run = run_requests(llm, make_workload(1, 9, 7, llm.llm_engine.vocab_size, seed=3))
        llm.shutdown()
        assert sum(run["step_tokens"]) == 7
        ttft, gaps = token_intervals(run["step_times"], run["step_tokens"])
        assert len(gaps) == 6 and ttft > 0 and all(g > 0 for g in gaps)
        assert run["step_tokens"][-1] == 1  # the run ends with a step that hands back a token
        assert ttft + sum(gaps) == pytest.approx(sum(run["step_times"]))
        first_step_tokens[mode] = run["step_tokens"][0]
    assert first_step_tokens == {False: 1, True: 0}


def test_token_intervals_fold_steps_without_tokens_into_the_next_gap():
    from bench.latency import token_intervals

    assert token_intervals([0.5, 0.25, 1.0, 0.125, 0.125], [0, 1, 1, 0, 1]) == (0.75, [1.0, 0.25])


def test_tp_bench_runs_each_size_in_its_own_process_with_the_engine_flags(tmp_path):
    """`sluiceway bench tp` on CPU (gloo): one run per size, the scaling ratio, and the
    scheduling flag passed on to each run."""
    from bench.tp import tp_command

    model = build_tiny_model(tmp_path / "model", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=2)
    out = tmp_path / "tp.json"
    result = CliRunner().invoke(tp_command, [
        "--model", str(model), "--tp", "1,2", "--big-model", "none", "-n", "4", "--input-len", "8",
        "--output-len", "3", "--max-num-seqs", "4", "--no-async-scheduling", "--timeout", "300", "--json", str(out),
    ])
    assert result.exit_code == 0, result.output
    runs = json.loads(out.read_text())["runs"]
    assert [r["tp"] for r in runs] == [1, 2]
    for run in runs:
        assert "--no-async-scheduling" in run["command"] and "--roofline" not in run["command"]  # no CUDA here
        assert run["engine_args"]["async_scheduling"] is False and run["engine_args"]["tensor_parallel_size"] == run["tp"]
        assert run["engine"]["output_tokens"] == 4 * 3
    assert runs[0]["scaling_ratio"] == 1.0 and runs[1]["scaling_ratio"] > 0


def test_step_log_charges_each_call_to_the_step_the_engine_says_it_waited_for(tmp_path):
    """On the CPU the forward runs inside the launch: the engine reports each call waiting for
    its own step, while with async scheduling it reads back the step the call before launched;
    the log charges each call to the step the engine names, and takes its time from the engine."""
    from bench.run import StepLog, make_workload
    from engine import LLM, SamplingParams

    model = build_tiny_model(tmp_path / "model", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1)
    llm = LLM(str(model), load_format="dummy", device="cpu", swap_space=0, async_scheduling=True,
              max_num_batched_tokens=16, max_num_seqs=3)
    engine = llm.llm_engine
    log = StepLog()
    engine.add_step_observer(log)
    workload = make_workload(3, 10, 4, engine.vocab_size, seed=5)
    for i, prompt in enumerate(workload.prompts):
        engine.add_request(f"r{i}", None, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                           prompt_token_ids=prompt)
    while engine.has_unfinished_requests():
        engine.step()
    llm.shutdown()
    records = log.records
    assert [r.step for r in records] == list(range(len(records)))
    assert [r.waited_for for r in records] == [r.step for r in records]  # the CPU: each call's own step
    assert [r.resolved for r in records] == [()] + [(r.step - 1,) for r in records[1:]]  # async: the one before
    assert (records[0].num_seqs, records[0].num_batched_tokens) == (2, 16)  # a chunked prefill: 10 + 6 tokens
    charged = [(n, t) for _, n, t, _ in log.steps]
    assert charged == [(r.num_seqs, r.num_batched_tokens) for r in records]
    assert [s for s, *_ in log.steps] == [r.duration_s for r in records]
    assert log.sampled == [r.num_generated_tokens for r in records] and sum(log.sampled) == 3 * 4


def test_step_log_charges_a_call_to_the_step_before_when_the_engine_waited_for_that_one():
    """On a GPU with async scheduling the engine reports each call waiting for the step the
    call before launched (the one it resolved): that step's shape is charged, one call later."""
    from bench.run import StepLog
    from engine.observer import StepRecord

    shapes = [(2, 16, 0), (3, 8, 2), (3, 0, 3), (1, 0, 1), (0, 0, 0)]  # (seqs, prefill, decode) launched
    log = StepLog()
    for step, (seqs, prefill, decode) in enumerate(shapes):
        log(StepRecord(step=step, num_seqs=seqs, num_prefill_tokens=prefill, num_decode_tokens=decode,
                       resolved=(step - 1,) if step else (), num_generated_tokens=0,
                       waited_for=step - 1 if step else None, duration_s=0.001 * (step + 1)))
    assert [(n, t, only) for _, n, t, only in log.steps] == [
        (0, 0, True), (2, 16, False), (3, 10, False), (3, 3, True), (1, 1, True)]
    summary = log.summary()
    assert summary["decode_steps"] == 2 and summary["mixed_steps"] == 2 and summary["mixed_tokens"] == 26
    assert summary["trace"] == [(1.0, 0, 0), (2.0, 2, 16), (3.0, 3, 10), (4.0, 3, 3), (5.0, 1, 1)]


def test_hf_peer_runs_one_batch_per_size_and_keeps_the_fastest(tmp_path):
    """`--peer hf` on CPU: each batch size runs that many of the workload's requests in one
    batch with their real lengths; the fastest run is the peer's number and the ratio uses it."""
    model = build_tiny_model(tmp_path / "model", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1)
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(bench_command, [
        "throughput", "--model", str(model), "-n", "6", "--input-len", "5", "--output-len", "3", "--max-num-seqs",
        "4", "--peer", "hf", "--hf-modes", "generate", "--hf-batch-sizes", "4,2,100", "--json", str(out),
    ])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    peer = report["peer"]
    runs = peer["batch_runs"]
    assert [r["batch_size"] for r in runs] == [2, 4, 6]  # sorted; 100 is capped at the 6 requests
    assert [r["output_tokens"] for r in runs] == [2 * 3, 4 * 3, 6 * 3]
    fastest = max(runs, key=lambda r: r["output_tok_s"])
    assert peer["batch_size"] == fastest["batch_size"] and peer["output_tok_s"] == fastest["output_tok_s"]
    assert report["ratio_vs_peer"] == pytest.approx(report["engine"]["output_tok_s"] / fastest["output_tok_s"])
    assert f"best {fastest['output_tok_s']:.0f} at batch {fastest['batch_size']}" in result.output


@pytest.mark.parametrize("sizes", ["0", "256,x", ""])
def test_hf_batch_sizes_must_be_positive_integers(tmp_path, sizes):
    result = CliRunner().invoke(bench_command, ["throughput", "--peer", "hf", "--hf-batch-sizes", sizes])
    assert result.exit_code == 2
    assert "--hf-batch-sizes takes positive integers" in result.output


def test_a_model_that_is_neither_a_preset_nor_a_folder_is_one_line(tmp_path):
    import subprocess
    import sys

    missing = tmp_path / "no-such-model"
    run = subprocess.run([sys.executable, "-m", "bench", "throughput", "--model", str(missing)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr
    assert f"Error: model: model folder '{missing}' does not exist" in run.stderr
    assert "Traceback" not in run.stderr


def test_own_times_split_a_timeline_with_early_launched_kernels():
    """A kernel that starts inside the one before it (launched early by PDL) is charged only its
    part past that one's end; gaps are idle; shares and idle add up to the timeline."""
    from bench.run import own_times

    spans = [(0.0, 10.0, "attention"), (1.0, 12.0, "quant"),  # quant waited 9 of its 11 inside attention
             (12.0, 20.0, "gemm"), (22.0, 25.0, "norm"),  # 2 idle before norm
             (23.0, 24.0, "inner"), (24.5, 27.0, "norm")]  # inner lies wholly inside norm
    own, idle = own_times(list(reversed(spans)))  # any order
    assert own == {"attention": 10.0, "quant": 2.0, "gemm": 8.0, "norm": 5.0, "inner": 0.0}
    assert idle == 2.0
    assert sum(own.values()) + idle == 27.0
    assert own_times([]) == ({}, 0.0)
