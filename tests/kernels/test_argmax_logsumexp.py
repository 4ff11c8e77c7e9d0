"""The fused greedy choice and log-normaliser against torch's argmax and logsumexp."""

import pytest
import torch
from kernels_testlib import DEVICE, gpu_test

from sluiceway_kernels import argmax_logsumexp, argmax_logsumexp_ref


def rows(batch, vocab, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, vocab, generator=gen) * 4).to(dtype).to(DEVICE)


def check(logits, **kwargs):
    ids, lse = argmax_logsumexp(logits, **kwargs)
    ref_ids, ref_lse = argmax_logsumexp_ref(logits)
    assert ids.dtype == torch.int64 and lse.dtype == torch.float32
    assert torch.equal(ids.cpu(), ref_ids.cpu())
    torch.testing.assert_close(lse.cpu(), ref_lse.cpu(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batch,vocab,num_splits", [(1, 1, None), (3, 1000, None), (5, 5000, 3), (2, 3000, 64),
                                                    (4, 20000, None)])
def test_matches_torch(batch, vocab, num_splits):
    check(rows(batch, vocab), num_splits=num_splits)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_logits(dtype):
    check(rows(6, 3000, dtype), num_splits=2)


def test_first_maximum_and_minus_infinity():
    logits = torch.zeros(4, 9000, device=DEVICE)
    logits[0, [5, 17, 8500]] = 4.0  # ties inside one tile and across splits
    logits[1, [1030, 8999]] = 2.0
    logits[2] = float("-inf")  # nothing allowed: column 0 and -inf, as torch gives
    logits[3, :8000] = float("-inf")  # the finite part only in the last split
    logits[3, 8999] = 1.0
    for splits in (1, 4):
        ids, lse = argmax_logsumexp(logits, num_splits=splits)
        assert ids.tolist() == [5, 1030, 0, 8999]
        assert lse[2].item() == float("-inf")
        torch.testing.assert_close(lse.cpu(), torch.logsumexp(logits.cpu(), dim=-1))


def test_a_column_slice_of_wider_logits():
    wide = rows(3, 5000)
    check(wide[:, :4097], num_splits=2)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="logits must have 2 dims"):
        argmax_logsumexp(torch.zeros(5, device=DEVICE))
    with pytest.raises(ValueError, match="logits has dtype"):
        argmax_logsumexp(torch.zeros(2, 5, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        argmax_logsumexp(torch.zeros(5, 4, device=DEVICE).t())
    with pytest.raises(ValueError, match="num_splits must be positive"):
        argmax_logsumexp(torch.zeros(2, 5, device=DEVICE), num_splits=0)
    ids, lse = argmax_logsumexp(torch.zeros(0, 5, device=DEVICE))
    assert ids.shape == lse.shape == (0,)


@gpu_test
@pytest.mark.parametrize("batch", [1, 64, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_llama3_vocab(batch, dtype):
    check(rows(batch, 128256, dtype))
