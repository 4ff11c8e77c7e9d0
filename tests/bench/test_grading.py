"""`sluiceway bench grading` on the CPU with a tiny model: jobs through Redis and a real worker,
the rubric found in the prefix cache, the HF peer on the same jobs; and its roofline."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from bench.cli import bench_command
from bench.roofline import DeviceCeilings, ModelCounts, generation_bound, shared_prefix_bound
from engine.models.tiny import build_tiny_model


def test_grading_jobs_share_the_rubric_through_the_worker(tmp_path):
    model = build_tiny_model(tmp_path / "model", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1)
    out = tmp_path / "grading.json"
    result = CliRunner().invoke(bench_command, [
        "grading", "--model", str(model), "--dtype", "float32", "-n", "40", "--rubric-len", "96",
        "--answer-len", "8", "--instruction-len", "4", "--verdict-tokens", "3", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "128", "--no-appendonly", "--peer", "hf", "--hf-modes", "generate",
        "--hf-batch-sizes", "8", "--offline", "--json", str(out),
    ])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    run = report["engine"]
    assert run["jobs"] == 40 and run["output_tokens"] == 40 * 3 and run["prompt_tokens"] == 40 * 108
    # each job after the first few finds the rubric's 6 full blocks (96 tokens) cached
    assert run["prefix_cache_hit_tokens"] >= 30 * 96 and run["prefix_cache_hit_rate"] > 0.6
    assert report["peer"]["num_requests"] == 8 and report["peer"]["jobs_per_s"] > 0
    assert report["ratio_vs_peer"] == pytest.approx(run["jobs_per_s"] / report["peer"]["jobs_per_s"])
    assert "prefix-cache hit rate" in result.output
    assert "verdicts" not in run  # counted for --verdict choice only

    # where the worker's time went: its steps saw every prompt token the cache did not hold
    split = run["time_split"]
    assert split["prefill_tokens"] == run["prompt_tokens"] - run["prefix_cache_hit_tokens"]
    assert split["mixed_steps"] > 0 and split["decode_steps"] > 0
    per_step = split["prefill_tokens"] / split["mixed_steps"]
    assert split["prefill_tokens_per_mixed_step"] == pytest.approx(per_step, abs=0.1)
    assert split["wall_s"] == pytest.approx(run["seconds"], abs=1e-3)
    assert 0 < split["step_s"] < split["wall_s"]
    assert split["outside_steps_s"] == pytest.approx(split["wall_s"] - split["step_s"], abs=1e-3)
    assert split["to_first_step_s"] > 0 and split["after_last_step_s"] > 0  # a result is stored after its step
    assert split["between_steps_s"] == pytest.approx(
        split["outside_steps_s"] - split["to_first_step_s"] - split["after_last_step_s"], abs=1e-3)
    assert "worker outside steps" in result.output

    # the same kind of jobs through the engine alone, on a rubric of their own
    offline = report["offline"]
    assert offline["jobs"] == 40 and offline["output_tokens"] == 40 * 3 and offline["prompt_tokens"] == 40 * 108
    assert 30 * 96 <= offline["prefix_cache_hit_tokens"] <= 39 * 96  # the first job computed the rubric
    assert offline["time_split"]["prefill_tokens"] == offline["prompt_tokens"] - offline["prefix_cache_hit_tokens"]
    assert report["gap"]["worker_past_offline_s"] == pytest.approx(run["seconds"] - offline["seconds"], abs=1e-3)
    assert "offline (the engine alone" in result.output


def _preset_like(path):
    """A model as a preset is one: a config and no tokenizer (the bench runs dummy weights)."""
    import transformers

    transformers.LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                             eos_token_id=1023, bos_token_id=None, tie_word_embeddings=False,
                             architectures=["LlamaForCausalLM"]).save_pretrained(path)
    return path


def test_a_choice_verdict_on_a_model_without_a_tokenizer(tmp_path, monkeypatch):
    """--verdict choice on a model that ships no tokenizer (a preset's case: every job used to
    fail for want of a grammar vocabulary) gets the bench's BPE of its vocabulary, and every
    verdict is one of the choices."""
    monkeypatch.setenv("SLUICEWAY_BENCH_CACHE", str(tmp_path / "cache"))
    model = _preset_like(tmp_path / "model")
    out = tmp_path / "grading.json"
    result = CliRunner().invoke(bench_command, [
        "grading", "--model", str(model), "--dtype", "float32", "-n", "16", "--rubric-len", "48",
        "--answer-len", "8", "--instruction-len", "4", "--verdict-tokens", "8", "--max-num-seqs", "8",
        "--verdict", "choice", "--choices", "pass,fail", "--no-appendonly", "--json", str(out),
    ])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    run = report["engine"]
    assert report["tokenizer"].startswith(str(tmp_path / "cache")) and report["sampling"]["structured_outputs"]
    assert run["jobs"] == 16 and sum(run["verdicts"].values()) == 16
    assert run["verdicts_not_in_choices"] == 0
    assert "0 not one of the choices" in result.output


def test_the_worker_queues_must_hold_the_jobs_queue():
    result = CliRunner().invoke(bench_command, ["grading", "--worker-queues", "interactive"])
    assert result.exit_code == 2
    assert "--worker-queues must include bulk (the jobs' queue), got 'interactive'" in result.output


def test_a_shared_prefix_is_charged_once():
    # 1 FLOP/s and 1 B/s: every time is a raw count
    ceilings = DeviceCeilings(matmul_tflops=1e-12, bandwidth_gbs=1e-9)
    counts = ModelCounts(linear_params=50, lm_head_params=0, weight_bytes=20, kv_bytes_per_token=10,
                         attn_flops_per_key=1)
    bound = shared_prefix_bound(counts, ceilings, prefix_len=4, suffix_lens=[2, 2], output_lens=[1, 1],
                                max_batch=2, max_step_tokens=16)
    # tokens 4 + 2 + 2 through 100 FLOPs each; keys: prefix 1+2+3+4, each suffix 2*4 + 1+2
    assert bound["prefill_bound_s"] == pytest.approx(100 * 8 + 10 + 2 * 11)
    whole = generation_bound(counts, ceilings, [6, 6], [1, 1], max_batch=2, max_step_tokens=16)
    assert whole["prefill_bound_s"] == pytest.approx(100 * 12 + 2 * 21)  # every prompt computed whole
    assert bound["decode_bound_s"] == whole["decode_bound_s"] == 0  # one output token: from the prefill
    no_prefix = shared_prefix_bound(counts, ceilings, 0, [6, 6], [3, 3], max_batch=2, max_step_tokens=16)
    same = generation_bound(counts, ceilings, [6, 6], [3, 3], max_batch=2, max_step_tokens=16)
    assert no_prefix["bound_s"] == pytest.approx(same["bound_s"])
