"""``EngineArgs`` and the config of each concern built from it: errors that name the flag,
before anything loads, and the resolved configs an engine runs on."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, EngineArgs, ParallelConfig, SchedulerConfig
from engine.models.resolve import create_engine_config


@pytest.mark.parametrize("flags, message", [
    (dict(max_num_seqs=16, max_num_batched_tokens=8), r"max_num_batched_tokens \(8\) must be >= max_num_seqs \(16\)"),
    (dict(max_num_seqs=9000), r"max_num_batched_tokens \(8192\) must be >= max_num_seqs \(9000\)"),
    (dict(async_scheduling=None), "async_scheduling must be true or false, got None"),
    (dict(prefill_graph_tokens=-1), "prefill_graph_tokens must be an integer from 0 \\(off\\) to 8192, got -1"),
    (dict(prefill_graph_tokens=9000), "prefill_graph_tokens must be an integer from 0 \\(off\\) to 8192, got 9000"),
    (dict(prefill_graph_tokens="512"), "prefill_graph_tokens must be an integer .* got '512'"),
    (dict(small_batch_kernels="yes"), "small_batch_kernels must be true or false, got 'yes'"),
])
def test_a_bad_flag_fails_before_anything_loads(flags, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs("/no/such/model", **flags)  # the folder is never looked at


def test_each_concern_validates_itself():
    with pytest.raises(ValueError, match="max_model_len must be a positive integer, got 0"):
        SchedulerConfig(max_model_len=0)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3; got 'int8'"):
        CacheConfig(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="all_reduce must be one of nccl, symmetric; got 'ring'"):
        ParallelConfig(all_reduce="ring")


def test_the_engine_config_is_resolved_from_the_checkpoint(tiny_model_factory):
    path = tiny_model_factory("llama")
    config = create_engine_config(EngineArgs(str(path), device="cpu", swap_space=0.5, tensor_parallel_size=2,
                                             max_num_batched_tokens=256))
    assert config.model.path == path.resolve() and config.model.max_model_len == 512  # the model's context
    assert config.scheduler.max_model_len == 512 and config.scheduler.max_num_batched_tokens == 256
    assert config.scheduler.async_scheduling is True  # the default: on
    assert config.cache.swap_bytes == 1 << 29 and config.parallel.tensor_parallel_size == 2
    assert config.shape.num_kv_heads_per_rank == 1  # 2 KV heads over 2 ranks
    assert config.kv_bytes_per_block == config.shape.kv_bytes_per_token(4) * config.cache.block_size
    with pytest.raises(ValueError, match=r"max_model_len \(4096\) exceeds the model's context length \(512\)"):
        create_engine_config(EngineArgs(str(path), device="cpu", max_model_len=4096))


def test_prompt_step_graphs_are_on_by_default_on_one_gpu_only(tiny_model_factory):
    path = str(tiny_model_factory("llama"))
    assert create_engine_config(EngineArgs(path, device="cpu")).model.prefill_graph_tokens == 512
    # not yet run across GPUs: eager under tensor parallelism unless asked for
    assert create_engine_config(EngineArgs(path, device="cpu", tensor_parallel_size=2)).model.prefill_graph_tokens == 0
    assert create_engine_config(EngineArgs(path, device="cpu", tensor_parallel_size=2,
                                           prefill_graph_tokens=256)).model.prefill_graph_tokens == 256
    assert create_engine_config(EngineArgs(path, device="cpu", prefill_graph_tokens=0)).model.prefill_graph_tokens == 0
