import pytest
import torch
import triton
import triton.language as tl
from kernels_testlib import DEVICE, gpu_test

from sluiceway_kernels import sample_from_logits, sample_from_logits_ref
from sluiceway_kernels.sampling import philox_uint32_ref


@triton.jit
def _randint_kernel(seeds_ptr, out_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    bits = tl.randint(tl.load(seeds_ptr + row), cols)
    tl.store(out_ptr + row * n + cols, bits.to(tl.int64) & 0xFFFFFFFF, mask=cols < n)


def test_philox_reference_matches_triton_randint():
    seeds = torch.tensor([0, 1, 123456789, 2**40 + 17, -5, 2**63 - 1], dtype=torch.int64, device=DEVICE)
    bits = torch.empty(6, 100, dtype=torch.int64, device=DEVICE)
    _randint_kernel[(6,)](seeds, bits, 100, BLOCK=128)
    assert torch.equal(bits.cpu(), philox_uint32_ref(seeds.cpu()[:, None], torch.arange(100)[None, :]))


def make_rows(batch, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, vocab, generator=gen) * 3).to(DEVICE)
    temperatures = torch.tensor([0.0, 0.5, 1.0, 2.0, 1.0, 0.0, 0.7, 1.3][:batch] * (batch // 8 + 1), device=DEVICE)[
        :batch
    ]
    seeds = torch.randint(-(2**62), 2**62, (batch,), generator=gen).to(DEVICE)
    return logits, temperatures, seeds


@pytest.mark.parametrize("vocab,num_splits", [(1, None), (1000, None), (5000, 3), (3000, 64)])
def test_kernel_draws_the_reference_tokens(vocab, num_splits):
    logits, temperatures, seeds = make_rows(8, vocab)
    logits[3, ::3] = float("-inf")  # filtered tokens
    out = torch.full((8,), -7, dtype=torch.int64, device=DEVICE)
    assert sample_from_logits(logits, temperatures, seeds, out=out, num_splits=num_splits) is out
    assert torch.equal(out, sample_from_logits_ref(logits, temperatures, seeds))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_logits(dtype):
    logits, temperatures, seeds = make_rows(8, 3000)
    logits = logits.to(dtype)
    assert torch.equal(
        sample_from_logits(logits, temperatures, seeds), sample_from_logits_ref(logits, temperatures, seeds)
    )


def test_greedy_rows_take_the_first_maximum():
    logits = torch.zeros(3, 9000, device=DEVICE)
    logits[0, [5, 17, 8500]] = 4.0  # ties inside one tile and across splits
    logits[1, [1030, 8999]] = 2.0
    logits[2] = float("-inf")  # nothing allowed: column 0, as torch.argmax gives
    temperatures = torch.zeros(3, device=DEVICE)
    seeds = torch.arange(3, device=DEVICE)
    assert sample_from_logits(logits, temperatures, seeds, num_splits=4).tolist() == [5, 1030, 0]
    assert sample_from_logits(logits, temperatures, seeds, num_splits=1).tolist() == [5, 1030, 0]
    assert sample_from_logits_ref(logits, temperatures, seeds).tolist() == [5, 1030, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_temperature_below_the_epsilon_is_greedy(dtype):
    """Below 1e-5 (vLLM's epsilon) a row is greedy: at 1e-38, logits / T overflowed to inf and
    the first of the overflowed tokens won (here 5, not the first maximum 17)."""
    logits = torch.zeros(3, 3000, device=DEVICE, dtype=dtype)
    logits[:, 5] = 4.0
    logits[:, [17, 2500]] = 5.0  # a tie at the top: greedy takes the first
    temperatures = torch.tensor([1e-38, 1e-6, 0.0], device=DEVICE)
    seeds = torch.arange(3, device=DEVICE)
    for num_splits in (1, 3):
        assert sample_from_logits(logits, temperatures, seeds, num_splits=num_splits).tolist() == [17, 17, 17]
    assert sample_from_logits_ref(logits, temperatures, seeds).tolist() == [17, 17, 17]


def test_same_seed_same_token_and_filtered_tokens_never_drawn():
    logits = torch.zeros(32, 50, device=DEVICE)
    logits[:, 10:] = float("-inf")  # only the first ten may be drawn
    temperatures = torch.ones(32, device=DEVICE)
    seeds = torch.arange(32, device=DEVICE)
    first = sample_from_logits(logits, temperatures, seeds)
    assert torch.equal(first, sample_from_logits(logits, temperatures, seeds))
    assert first.max() < 10 and len(set(first.tolist())) > 5  # different seeds, different draws


@pytest.mark.parametrize("temperature", [1.0, 0.5, 3.0])
def test_reference_draws_follow_softmax(temperature):
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5], device=DEVICE)
    rows = 20000
    seeds = torch.arange(rows, device=DEVICE) * 7919 + 13
    draws = sample_from_logits_ref(logits.expand(rows, -1), torch.full((rows,), temperature, device=DEVICE), seeds)
    freq = torch.bincount(draws.cpu(), minlength=5).double() / rows
    expected = torch.softmax(logits.cpu().double() / temperature, 0)
    # four standard errors of a binomial frequency
    assert torch.all((freq - expected).abs() < 4 * (expected * (1 - expected) / rows).sqrt() + 1e-9), (freq, expected)


def test_kernel_draws_follow_softmax():
    # a sanity check: exact agreement with the reference carries the full distribution test
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0], device=DEVICE)
    rows = 20000 if DEVICE.type == "cuda" else 250
    seeds = torch.arange(rows, device=DEVICE) + 2**33
    draws = sample_from_logits(logits.expand(rows, -1), torch.ones(rows, device=DEVICE), seeds)
    freq = torch.bincount(draws.cpu(), minlength=4).double() / rows
    expected = torch.softmax(logits.cpu().double(), 0)
    assert torch.all((freq - expected).abs() < 4 * (expected * (1 - expected) / rows).sqrt()), (freq, expected)


def test_rejects_bad_arguments():
    logits, temperatures, seeds = make_rows(4, 100)
    with pytest.raises(ValueError, match="seeds has dtype"):
        sample_from_logits(logits, temperatures, seeds.int())
    with pytest.raises(ValueError, match="temperatures has shape"):
        sample_from_logits(logits, temperatures[:2], seeds)
    with pytest.raises(ValueError, match="out has dtype"):
        sample_from_logits(logits, temperatures, seeds, out=torch.empty(4, device=DEVICE))


@gpu_test
@pytest.mark.parametrize("batch", [1, 256])
def test_gpu_llama3_vocab(batch):
    logits, temperatures, seeds = make_rows(batch, 128256)
    got = sample_from_logits(logits, temperatures, seeds)
    ref = sample_from_logits_ref(logits, temperatures, seeds)
    # GPU logarithms may differ from torch's in the last ulp, which can flip a near-tie
    assert (got == ref).double().mean() >= 0.99


@gpu_test
def test_gpu_cuda_graph_replay():
    logits, temperatures, seeds = make_rows(64, 32000)
    out = torch.empty(64, dtype=torch.int64, device="cuda")
    sample_from_logits(logits, temperatures, seeds, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sample_from_logits(logits, temperatures, seeds, out=out)
    seeds += 1
    graph.replay()
    torch.cuda.synchronize()
    assert (out == sample_from_logits_ref(logits, temperatures, seeds)).double().mean() >= 0.95
