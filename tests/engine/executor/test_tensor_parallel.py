"""Tensor parallelism on CPU: spawned gloo ranks give the same greedy tokens as one rank,
fail loudly, and leave no process behind."""

from __future__ import annotations

import gc
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from engine import LLM, EngineArgs, SamplingParams
from engine.errors import ModelNotFound
from engine.executor import step_wire
from engine.executor.distributed import destroy_tensor_parallel, init_tensor_parallel
from engine.executor.ranks import RankError, Ranks
from engine.executor.spawning import free_port
from engine.models.resolve import create_engine_config
from engine.runner.attention.metadata import AttentionMetadata
from engine.runner.model_runner import StepInputs

REPO = Path(__file__).resolve().parents[3]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# chunked prefill (a 32-token budget), shared prefixes and swap preemption (20 blocks of 8)
PRESSURE = dict(block_size=8, max_num_batched_tokens=32, max_num_seqs=8, num_gpu_blocks_override=20,
                swap_space=0.01, preemption_mode="swap")
ROOMY = dict(block_size=8, swap_space=0)


def make_prompts(vocab_size: int, n: int, seed: int) -> list[list[int]]:
    """Mixed lengths; every other prompt starts with the same 24 tokens (three blocks of 8)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab_size) for _ in range(24)]
    prompts = []
    for i in range(n):
        own = [rng.randrange(3, vocab_size) for _ in range(rng.randrange(2, 40))]
        prompts.append(shared + own if i % 2 else own)
    return prompts


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def reference(path: Path, prompts: list[list[int]], **kw) -> list[list[int]]:
    """TP=1 tokens, computed before any TP engine exists (one TP state per process)."""
    with LLM(str(path), device="cpu", **kw) as llm:
        return greedy(llm, prompts)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def spawned_ranks() -> set[int]:
    """Rank processes (multiprocessing spawn children) of this test process."""
    ranks = set()
    for pid in children(os.getpid()):
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes() and alive(pid):
                ranks.add(pid)
        except OSError:
            pass
    return ranks


def wait_gone(pids, timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


# ----- the step message, no processes ------------------------------------------------------
def test_step_message_round_trip():
    attn = AttentionMetadata(
        slot_mapping=torch.tensor([5, 6, 7, -1]), block_tables=torch.tensor([[1, 2], [3, 0]], dtype=torch.int32),
        context_lens=torch.tensor([3, 1], dtype=torch.int32), query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
        max_query_len=3, max_context_len=3, decode_only=False,
    )
    inputs = StepInputs(torch.tensor([9, 8, 7, 6]), torch.tensor([0, 1, 2, 0]), attn, torch.tensor([2, 3]),
                        torch.tensor([[4, 0]]), torch.empty((0, 2), dtype=torch.long))
    back = step_wire.decode_step(StepInputs, bytearray(step_wire.encode_step(inputs)), torch.device("cpu"))
    for name in ("input_ids", "positions", "logits_indices", "swap_out", "swap_in"):
        a, b = getattr(inputs, name), getattr(back, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for name in ("slot_mapping", "block_tables", "context_lens", "query_start_loc"):
        a, b = getattr(attn, name), getattr(back.attn, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert (back.attn.max_query_len, back.attn.max_context_len, back.attn.decode_only) == (3, 3, False)
    assert step_wire.decode_op(step_wire.encode_op(step_wire.OP_STOP))[:2] == (step_wire.OP_STOP, [])


# ----- validation, no processes ------------------------------------------------------------
def test_heads_not_divisible(tiny_model_factory):
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(3\) must divide the model's 4 attention heads"):
        LLM(str(tiny_model_factory("llama", seed=3)), device="cpu", tensor_parallel_size=3)


def test_more_ranks_than_gpus(tiny_model_factory, monkeypatch):
    from engine.models import loader as model_loader

    monkeypatch.setattr(model_loader, "resolve_device", lambda device: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\) needs 2 CUDA devices, but 1 is visible"):
        LLM(str(tiny_model_factory("llama", seed=3)), tensor_parallel_size=2)


def test_symmetric_all_reduce_is_asked_for_only_by_gpu_ranks_that_opt_in(tiny_model_factory, monkeypatch):
    import dataclasses

    from engine.config import EngineArgs
    from engine.executor.distributed import SYMMETRIC_MAX_BYTES
    from engine.models.resolve import create_engine_config

    path = str(tiny_model_factory("llama", seed=3))
    config = create_engine_config(EngineArgs(path, device="cpu", tensor_parallel_size=2, all_reduce="symmetric",
                                             dtype="bfloat16", max_num_batched_tokens=4096))
    assert config.symmetric_all_reduce() is None  # gloo on CPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # the same config, as if on two GPUs

    def on_gpu(**parallel):
        return dataclasses.replace(
            config, model=dataclasses.replace(config.model, device=torch.device("cuda")),
            parallel=dataclasses.replace(config.parallel, **parallel))

    step_bytes = 4096 * config.shape.hidden_size * 2  # a step's tokens x hidden, bf16
    assert on_gpu().symmetric_all_reduce() == (torch.bfloat16, min(SYMMETRIC_MAX_BYTES, step_bytes))
    assert on_gpu(all_reduce="nccl").symmetric_all_reduce() is None
    assert on_gpu(tensor_parallel_size=1).symmetric_all_reduce() is None


# ----- one TP=2 engine shared by the class --------------------------------------------------
@pytest.fixture(scope="class")
def case(tiny_model_factory):
    """Llama with 2 KV heads at TP=2 (async scheduling, the default) and its TP=1 tokens
    (synchronous); shut down (and checked) after the class."""
    path = tiny_model_factory("llama", seed=3)
    prompts = make_prompts(384, 12, seed=0)
    expected = reference(path, prompts, async_scheduling=False, **PRESSURE)
    llm = LLM(str(path), device="cpu", tensor_parallel_size=2, **PRESSURE)
    assert llm.llm_engine.config.scheduler.async_scheduling
    yield path, llm, prompts, expected
    pids = llm.llm_engine.executor.rank_pids
    llm.shutdown()
    assert wait_gone(pids) == [], "ranks outlived LLM.shutdown()"


class TestSharedEngine:
    """One TP=2 engine under chunked prefill, prefix caching and swapping."""

    def test_pressure_matches_tp1(self, case):
        _, llm, prompts, expected = case
        assert greedy(llm, prompts) == expected
        stats = llm.llm_engine.get_stats()
        assert stats.num_preemptions > 0 and stats.num_swapped_out_blocks > 0, "meant to swap"
        assert stats.prefix_cache_hit_rate > 0
        assert stats.num_free_gpu_blocks == stats.num_gpu_blocks

    def test_swap_pool_resizes_on_every_rank(self, case):
        _, llm, prompts, expected = case
        engine = llm.llm_engine
        assert engine.resize_swap_pool(0) == 0 and engine.executor.num_cpu_blocks == 0
        before = engine.get_stats()
        assert greedy(llm, prompts) == expected  # preempted sequences are recomputed
        assert engine.get_stats().num_swap_outs == before.num_swap_outs
        assert engine.resize_swap_pool(int(PRESSURE["swap_space"] * 2**30)) > 0
        assert greedy(llm, prompts) == expected
        assert engine.get_stats().num_swap_outs > before.num_swap_outs

    def test_ranks_are_spawned_processes(self, case):
        _, llm, _, _ = case
        pids = llm.llm_engine.executor.rank_pids
        assert len(pids) == 1 and all(alive(p) for p in pids)
        assert set(pids) <= spawned_ranks()

    def test_ranks_outlive_a_group_wide_sigterm(self, case):
        """A service manager's SIGTERM to every process leaves rank 0 in charge of stopping."""
        _, llm, prompts, expected = case
        pids = llm.llm_engine.executor.rank_pids
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
            os.kill(pid, signal.SIGINT)
        assert greedy(llm, prompts[:4]) == expected[:4]
        assert all(alive(p) for p in pids)

    def test_structured_outputs_at_tp2(self, case):
        """Masks made on rank 0 under async scheduling; the sampled tokens reach the other rank as
        usual, so constrained outputs finish valid."""
        from tests.engine.structured_helpers import FLAG, GRADE, assert_all_valid, json_valid

        _, llm, _, _ = case
        schemas = [GRADE, FLAG, GRADE, FLAG]
        params = [SamplingParams(temperature=0.0, max_tokens=64, structured_outputs={"json": s}) for s in schemas]
        outs = llm.generate(["Grade this", "Queues hold", "Paris", "数据"], params, use_tqdm=False)
        assert_all_valid(outs, [json_valid(s) for s in schemas])

    def test_one_tp_engine_per_process(self, case):
        path, _, _, _ = case
        with pytest.raises(RuntimeError, match="already live in this process"):
            LLM(str(path), device="cpu", tensor_parallel_size=2, **ROOMY)
        with pytest.raises(RuntimeError, match="one tensor-parallel engine per process"):
            LLM(str(path), device="cpu", **ROOMY)


# ----- engines of their own ----------------------------------------------------------------
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_qwen3_single_kv_head(tiny_model_factory, kv_cache_dtype):
    """One KV head replicated on both ranks, in the model's dtype and in a float8 KV cache,
    scheduled synchronously against an async TP=1 run; ranks exit at the end of the ``with``
    block."""
    path = tiny_model_factory("qwen3", seed=3, num_key_value_heads=1)
    prompts = make_prompts(384, 6, seed=1)
    expected = reference(path, prompts, kv_cache_dtype=kv_cache_dtype, **ROOMY)
    with LLM(str(path), device="cpu", tensor_parallel_size=2, async_scheduling=False, kv_cache_dtype=kv_cache_dtype,
             **ROOMY) as llm:
        assert not llm.llm_engine.config.scheduler.async_scheduling
        pids = llm.llm_engine.executor.rank_pids
        assert greedy(llm, prompts) == expected
        assert greedy(llm, prompts[:2]) == expected[:2]  # again, from the prefix cache
    assert wait_gone(pids) == []


def test_small_batch_kernels_at_tp2(tiny_model_factory):
    """Decode batches of up to 8 through the small-batch kernels on both ranks (each rank's
    column shard of q/k/v and gate/up, its row shard of o and down, summed): the tokens of a
    TP=1 run without them."""
    from sluiceway_kernels._common import interpreting

    if not interpreting():
        pytest.skip("the Triton kernels on CPU need TRITON_INTERPRET=1")
    path = tiny_model_factory("llama", seed=4)
    prompts = make_prompts(384, 6, seed=2)
    expected = reference(path, prompts, max_num_seqs=4, **ROOMY)
    with LLM(str(path), device="cpu", tensor_parallel_size=2, max_num_seqs=4, small_batch_kernels=True,
             **ROOMY) as llm:
        assert all(layer.small_batch_kernels for layer in llm.llm_engine.executor.runner.model.model.layers)
        assert greedy(llm, prompts) == expected


def test_killed_rank_raises_and_shutdown_leaves_nothing(tiny_model_factory):
    """Qwen2 (biased QKV) at TP=2; then a rank is killed: the next step names it."""
    path = tiny_model_factory("qwen2", seed=3)
    prompts = make_prompts(384, 4, seed=2)
    expected = reference(path, prompts, **ROOMY)
    llm = LLM(str(path), device="cpu", tensor_parallel_size=2, **ROOMY)
    assert greedy(llm, prompts) == expected
    (pid,) = llm.llm_engine.executor.rank_pids
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(RankError, match="rank 1 .* failed:\nkilled by SIGKILL"):
        greedy(llm, prompts)
    with pytest.raises(RuntimeError, match="out of step"):
        greedy(llm, prompts)
    llm.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        greedy(llm, prompts)


def test_tp4_and_a_failing_rank_step(tiny_model_factory):
    """TP=4 (one query head, one replicated KV head per rank) matches TP=1; a rank that
    raises mid-run surfaces with its traceback; dropping the engine reaps every rank."""
    path = tiny_model_factory("llama", seed=3)
    prompts = make_prompts(384, 4, seed=3)
    expected = reference(path, prompts, **ROOMY)
    llm = LLM(str(path), device="cpu", tensor_parallel_size=4, **ROOMY)
    pids = llm.llm_engine.executor.rank_pids
    assert greedy(llm, prompts) == expected
    llm.llm_engine.executor._ranks.conns[1].send_bytes(step_wire.encode_op(99))  # rank 2 gets an unknown op
    with pytest.raises(RankError) as excinfo:
        greedy(llm, prompts)
    assert excinfo.value.rank == 2
    assert "Traceback" in excinfo.value.detail and "unknown op 99" in excinfo.value.detail
    del llm, excinfo
    gc.collect()
    assert wait_gone(pids) == []


def test_rank_failing_to_load_raises_its_traceback(tiny_model_factory, tmp_path):
    """A checkpoint whose q_proj is short: rank 0's rows are there, rank 1's are not."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "short-q"
    shutil.copytree(tiny_model_factory("llama", seed=3), path)
    weights = load_file(path / "model.safetensors")
    name = "model.layers.1.self_attn.q_proj.weight"
    weights[name] = weights[name][:40].contiguous()  # rank 1 needs rows 32..63
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    before = spawned_ranks()
    with pytest.raises(RankError) as excinfo:
        LLM(str(path), device="cpu", tensor_parallel_size=2, **ROOMY)
    assert excinfo.value.rank == 1
    assert "Traceback" in excinfo.value.detail and "q_proj: checkpoint shape (8, 64)" in excinfo.value.detail
    assert wait_gone(spawned_ranks() - before) == []


_PARENT = textwrap.dedent("""
    import sys, time
    from engine import LLM

    if __name__ == "__main__":
        llm = LLM(sys.argv[1], device="cpu", tensor_parallel_size=2, swap_space=0)
        print("ready", flush=True)
        time.sleep(300)
""")


def test_ranks_exit_when_the_parent_is_killed(tiny_model_factory, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(_PARENT)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    parent = subprocess.Popen([sys.executable, str(script), str(tiny_model_factory("llama", seed=3))],
                              stdout=subprocess.PIPE, env=env, cwd=tmp_path)
    try:
        assert parent.stdout.readline().strip() == b"ready"
        descendants = children(parent.pid)
        assert descendants, "the parent should have spawned a rank"
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert wait_gone(descendants, timeout=10) == []
    finally:
        parent.kill()
        parent.wait()


def test_a_rank_that_finds_no_weights_is_model_not_found(tiny_model_factory, tmp_path):
    """Rank 0 (this process) joins the group and builds nothing, so the spawned rank alone finds
    no weights: its report is the loader's message, and the executor raises it as ``ModelNotFound``."""
    path = tmp_path / "no-weights"
    shutil.copytree(tiny_model_factory("llama", seed=3), path)
    (path / "model.safetensors").unlink()
    config = create_engine_config(EngineArgs(model=str(path), device="cpu", tensor_parallel_size=2, **ROOMY))
    init_method = f"tcp://127.0.0.1:{free_port()}"
    ranks = Ranks(config, init_method, abort_on_failure=False)
    try:
        ranks.wait_started()
        init_tensor_parallel(0, 2, "gloo", init_method)
        failure = ranks.failure(timeout=60)
    finally:
        ranks.kill()
        destroy_tensor_parallel()
    assert failure.rank == 1 and failure.model_not_found
    assert failure.detail == f"no *.safetensors weights in {path}"  # the message, no traceback
    # and as a whole engine, where rank 0 finds the same: ModelNotFound, not a rank's traceback
    before = spawned_ranks()
    with pytest.raises(ModelNotFound, match=r"no \*\.safetensors weights in"):
        LLM(str(path), device="cpu", tensor_parallel_size=2, **ROOMY)
    assert wait_gone(spawned_ranks() - before) == []
