"""Tensor parallelism on two CUDA GPUs (NCCL): TP=2 greedy output against TP=1, eager and
with CUDA graphs, the symmetric-memory all-reduce against NCCL's, and the failure paths that
only NCCL can show (a dead peer is not noticed by a collective, so rank 0 relies on its watcher).

Near-ties: TP=2 sums the row-parallel products in another order than TP=1, so where TP=1's
two best tokens lie within ``TIE[dtype]`` of each other the two may pick different tokens
and then go separate ways. Outputs must agree up to the first position where they differ,
and TP=1's top-2 gap there must be such a near-tie. So that the test keeps its power, at least half
of TP=1's steps must be clear choices (a gap over the tolerance): a model whose every step
were a near-tie would let any output pass. How many prompts diverge is not a criterion.

The tolerance is absolute, so the logits must stay small: bf16 rounds a logit of 16 to
steps of 0.125. With std 0.05 weights, on an H200, 6 of 16 prompts diverged in bf16, each
at a near-tie, and on the CPU 70% of bf16 steps are clear; with std 0.15 weights, 88% are
clear but the logits are large enough that a one-step rounding difference (0.125) exceeds
the tolerance.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.executor.distributed import symmetric_all_reduce_active
from engine.executor.ranks import RankError
from engine.executor.spawning import free_port

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

REPO = Path(__file__).resolve().parents[3]
SIZES = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             max_position_embeddings=1024)
TIE = {"float32": 1e-3, "bfloat16": 0.1}  # logit gap under which a different pick is rounding
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
ENGINE = dict(swap_space=0, num_gpu_blocks_override=1024, max_num_seqs=32)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from engine.models.tiny import build_tiny_model

    return {kv: build_tiny_model(tmp_path_factory.mktemp(f"kv{kv}") / "model", arch="llama" if kv == 2 else "qwen3",
                                 seed=5, std=0.05, num_key_value_heads=kv, **SIZES)
            for kv in (1, 2)}


@pytest.fixture(autouse=True)
def free_gpu():
    yield
    gc.collect()
    torch.cuda.empty_cache()


def make_prompts(vocab_size: int, n: int = 16, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 15, 16, 17, 100, 300] + [rng.randrange(2, 200) for _ in range(n - 6)]
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for length in lengths[:n]]


def generate(path: Path, tp: int, prompts, **kw):
    """Greedy outputs; under TP, rank 0's all-reduces must run over symmetric memory exactly
    when ``all_reduce="symmetric"`` asks for it."""
    llm = LLM(str(path), tensor_parallel_size=tp, **ENGINE, **kw)
    try:
        if tp > 1:
            assert symmetric_all_reduce_active() is (kw.get("all_reduce") == "symmetric")
        return llm.generate(prompts, PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.timeout(300, method="thread")  # a hang prints every thread's stack and ends the run
@pytest.mark.parametrize("kv,dtype,enforce_eager,kv_cache_dtype,all_reduce", [
    # NOTE: symmetric first: only the first engine of a process sets it up (engine.executor.distributed)
    (2, "float32", False, "auto", "symmetric"),
    (2, "float32", True, "auto", "nccl"),
    (2, "float32", False, "auto", "nccl"),
    (1, "bfloat16", False, "auto", "nccl"),
    (2, "bfloat16", False, "fp8", "nccl"),  # each rank's share of a float8 cache
])
def test_tp2_matches_tp1(models, kv, dtype, enforce_eager, kv_cache_dtype, all_reduce):
    path = models[kv]
    prompts = make_prompts(384)
    # TP=1 reads every step back before the next; TP=2 schedules asynchronously (the default),
    # its ranks fed each step's tokens by rank 0's broadcast
    common = dict(dtype=dtype, enforce_eager=enforce_eager, kv_cache_dtype=kv_cache_dtype)
    single = generate(path, 1, prompts, async_scheduling=False, **common)
    double = generate(path, 2, prompts, all_reduce=all_reduce, **common)
    gaps = [_top2_gap(step) for one in single for step in one.outputs[0].logprobs]
    clear = sum(g > TIE[dtype] for g in gaps)
    assert clear >= 0.5 * len(gaps), f"only {clear} of {len(gaps)} TP=1 steps are clear choices: the test has no power"
    for i, (one, two) in enumerate(zip(single, double)):
        a, b = one.outputs[0].token_ids, two.outputs[0].token_ids
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is None:
            continue
        gap = _top2_gap(one.outputs[0].logprobs[first])
        assert gap <= TIE[dtype], (
            f"prompt {i}: TP=2 leaves TP=1 at step {first} ({b[first]} vs {a[first]}) where TP=1's top-2 gap "
            f"is {gap:.4f}, not a near-tie ({dtype} tolerance {TIE[dtype]})"
        )


def _top2_gap(step: dict) -> float:
    top2 = sorted((lp.logprob for lp in step.values()), reverse=True)[:2]
    return top2[0] - top2[1]


@pytest.mark.timeout(180)
def test_killed_rank_surfaces_without_hanging(models):
    """NCCL does not notice a dead peer; the watcher must abort rank 0's collectives."""
    llm = LLM(str(models[2]), tensor_parallel_size=2, **ENGINE)
    prompts = make_prompts(384, 8)
    llm.generate(prompts, PARAMS, use_tqdm=False)
    (pid,) = llm.llm_engine.executor.rank_pids
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RankError, match="killed by SIGKILL"):
        for _ in range(3):  # the step in flight may finish on garbage; the next one must raise
            llm.generate(prompts, PARAMS, use_tqdm=False)
    assert time.monotonic() - start < 60
    llm.shutdown()


_COLLECTIVES = textwrap.dedent("""
    import sys
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    from engine.executor import distributed

    def check(rank, port):
        torch.cuda.set_device(rank)
        distributed.init_tensor_parallel(rank, 2, "nccl", f"tcp://127.0.0.1:{port}", (torch.bfloat16, 4 << 20))
        assert distributed.symmetric_all_reduce_active(), "symmetric memory did not start"
        gen = torch.Generator("cuda").manual_seed(rank)
        # (rows, hidden, dtype): symmetric sizes, the buffer's end, beyond it, an odd size, fp32
        for rows, hidden, dtype in [(1, 4096, torch.bfloat16), (512, 4096, torch.bfloat16),
                                    (513, 4096, torch.bfloat16), (3, 5, torch.bfloat16), (64, 256, torch.float32)]:
            x = torch.randn(rows, hidden, generator=gen, device="cuda").to(dtype)
            expected = x.clone()
            dist.all_reduce(expected)
            got = distributed.all_reduce(x.clone())
            assert torch.equal(got, expected), (rows, hidden, dtype, (got - expected).abs().max().item())
        # inside a CUDA graph, replayed on new inputs
        static = torch.zeros(256, 4096, dtype=torch.bfloat16, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            distributed.all_reduce(static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            distributed.all_reduce(static)
        for step in range(3):
            x = torch.randn(256, 4096, generator=gen, device="cuda").to(torch.bfloat16)
            expected = x.clone()
            dist.all_reduce(expected)
            static.copy_(x)
            graph.replay()
            assert torch.equal(static, expected), step
        torch.cuda.synchronize()
        del graph
        distributed.destroy_tensor_parallel()

    if __name__ == "__main__":
        mp.spawn(check, args=(int(sys.argv[1]),), nprocs=2)
        print("ok", flush=True)
""")


@pytest.mark.timeout(180)
def test_symmetric_all_reduce_equals_nccl(tmp_path):
    """The symmetric-memory all-reduce gives NCCL's sums bit for bit (two ranks: one rounding
    of a + b either way), eagerly and replayed in a CUDA graph; what it does not take (beyond
    its buffer, odd byte counts, another dtype) goes to NCCL."""
    script = tmp_path / "collectives.py"
    script.write_text(_COLLECTIVES)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    done = subprocess.run([sys.executable, str(script), str(port)], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=150)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


_PARENT = textwrap.dedent("""
    import sys, time
    from engine import LLM, SamplingParams

    if __name__ == "__main__":
        llm = LLM(sys.argv[1], tensor_parallel_size=2, swap_space=0, num_gpu_blocks_override=1024)
        llm.generate([[5] * 64] * 8, SamplingParams(max_tokens=4), use_tqdm=False)
        print("ready", flush=True)
        while True:  # keep the ranks busy in collectives when the parent dies
            llm.generate([[5] * 256] * 32, SamplingParams(max_tokens=64, ignore_eos=True), use_tqdm=False)
""")


@pytest.mark.timeout(180)
def test_ranks_exit_when_a_busy_parent_is_killed(models, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(_PARENT)
    parent = subprocess.Popen([sys.executable, str(script), str(models[2])], stdout=subprocess.PIPE,
                              env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=tmp_path)
    try:
        assert parent.stdout.readline().strip() == b"ready"
        ranks = _children(parent.pid)
        assert ranks
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_alive(p) for p in ranks):
            time.sleep(0.1)
        assert not [p for p in ranks if _alive(p)], "ranks outlived their parent"
    finally:
        parent.kill()
        parent.wait()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except OSError:
            pass
    return found
