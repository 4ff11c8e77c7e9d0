import pytest
import torch
from kernels_testlib import (
    ALL_DTYPES,
    DEVICE,
    HALF_DTYPES,
    assert_close,
    gpu_test,
    make_paged_batch,
    naive_attention,
    poisoned,
)

from sluiceway_kernels import paged_decode_attention, paged_decode_attention_ref
from sluiceway_kernels.paged_decode_attention import MIN_PARTITION, choose_splits


MIXED = [1, 15, 16, 17, 70]  # length 1 and either side of a 16-token block


def run_both(batch, scale=None, **kwargs):
    scale = scale or batch.q.shape[-1] ** -0.5
    out = poisoned(batch.q.shape, batch.q.dtype)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, scale)
    result = paged_decode_attention(*args, out=out, **kwargs)
    assert result is out
    return out, paged_decode_attention_ref(*args), scale


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,block_size",
    [
        (4, 4, 16),  # MHA
        (8, 2, 8),  # GQA
        (8, 2, 32),
        (14, 2, 64),  # a group of 7
        (8, 1, 128),  # MQA
        (8, 1, 1),  # degenerate pages
        (4, 2, 2),
        (4, 2, 256),  # the largest block
    ],
)
def test_matches_reference_across_groups_and_block_sizes(num_heads, num_kv_heads, block_size, early_reads):
    batch = make_paged_batch(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=block_size)
    out, ref, _ = run_both(batch)
    assert_close(out, ref)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_head_dims(head_dim):
    batch = make_paged_batch([9, 40], num_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=16)
    out, ref, _ = run_both(batch)
    assert_close(out, ref)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("partition_size", [None, 16])
def test_half_dtypes(dtype, partition_size):
    batch = make_paged_batch(MIXED, num_heads=8, num_kv_heads=2, block_size=16, dtype=dtype)
    out, ref, _ = run_both(batch, partition_size=partition_size)
    assert out.dtype == dtype
    assert_close(out, ref)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("partition_size", [16, 24, 64])  # aligned, unaligned, one tile
def test_split_k_partitions(dtype, partition_size, early_reads):
    # contexts from 1 to 150 tokens: 1 to 10 splits, some sequences leaving later splits empty
    batch = make_paged_batch([1, 23, 64, 65, 150], num_heads=8, num_kv_heads=2, block_size=8, dtype=dtype)
    out, ref, _ = run_both(batch, partition_size=partition_size)
    assert_close(out, ref)


def test_more_splits_than_one_reduction_chunk():
    # 40 splits of 8 tokens: the reduction folds them in several chunks of 16
    batch = make_paged_batch([320, 5], num_heads=4, num_kv_heads=2, block_size=16)
    out, ref, _ = run_both(batch, partition_size=8)
    assert_close(out, ref)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(6, 2, 64), (16, 2, 128), (4, 4, 64)])
def test_the_last_split_merges_every_head_of_its_group(num_heads, num_kv_heads, head_dim):
    # groups of 3 (one masked merge row), 8 (8 splits a merge step at head_dim 128) and 1;
    # 40 splits of 8 tokens, so the merge takes several steps
    batch = make_paged_batch([320, 5, 97], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                             block_size=16)
    out, ref, _ = run_both(batch, partition_size=8)
    assert_close(out, ref)


def test_context_longer_than_bound_is_still_exact(early_reads):
    # the last split runs to the end even when max_context_len understates the longest context
    batch = make_paged_batch([100, 37], num_heads=4, num_kv_heads=1, block_size=16)
    out, ref, _ = run_both(batch, max_context_len=32, partition_size=16)
    assert_close(out, ref)
    out, ref, _ = run_both(batch, max_context_len=8)
    assert_close(out, ref)


def test_strided_query_and_empty_context(early_reads):
    batch = make_paged_batch([0, 30, 5], num_heads=4, num_kv_heads=2, block_size=16)
    fused = torch.randn(3, 12, 64, device=DEVICE)  # q as a view of a fused qkv output
    fused[:, :4] = batch.q
    batch.q = fused[:, :4]
    out, ref, _ = run_both(batch)
    assert_close(out, ref)
    assert torch.all(out[0] == 0)


@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(8, 2, 16), (6, 3, 1), (4, 1, 64)])
def test_reference_matches_naive_attention(num_heads, num_kv_heads, block_size):
    batch = make_paged_batch(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=block_size)
    _, ref, scale = run_both(batch)
    torch.testing.assert_close(ref.double().cpu(), naive_attention(batch, scale), atol=1e-5, rtol=1e-5)


def test_choose_splits_uses_host_sizes_only():
    assert choose_splits(256, 8, 8192, 132) == 1  # big batch: no split
    assert choose_splits(1, 8, 8192, 132) == 33  # two programs per SM, pieces >= MIN_PARTITION tokens
    assert choose_splits(1, 8, 64, 132) == 1  # one tile: no split
    assert choose_splits(1, 8, 384, 132) == 6  # a short context: one-tile pieces
    assert choose_splits(1, 8, 16 * MIN_PARTITION, 132) == 16


def test_rejects_bad_arguments():
    batch = make_paged_batch([5, 9], num_heads=6, num_kv_heads=2)
    args = [batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.1]
    with pytest.raises(ValueError, match="multiple of kv heads"):
        paged_decode_attention(batch.q[:, :5], *args[1:])
    with pytest.raises(ValueError, match="must both have q.s dtype"):
        paged_decode_attention(batch.q.half(), *args[1:])
    with pytest.raises(ValueError, match="block_tables has 1 rows"):
        paged_decode_attention(*args[:3], batch.block_tables[:1], *args[4:])
    with pytest.raises(ValueError, match="context_lens has dtype"):
        paged_decode_attention(*args[:4], batch.context_lens.float(), 0.1)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode_attention(batch.q, batch.k_cache[:, :12], batch.v_cache[:, :12], *args[3:])
    with pytest.raises(ValueError, match="out has shape"):
        paged_decode_attention(*args, out=torch.empty(1, 6, 64, device=DEVICE))


@gpu_test
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_gpu_llama8b_long_contexts(block_size, dtype, early_reads):
    context = [8192, 1, 4097, 2000, 8191, 513, 31, 6000]
    batch = make_paged_batch(context, num_heads=32, num_kv_heads=8, head_dim=128, block_size=block_size, dtype=dtype)
    out, ref, _ = run_both(batch, max_context_len=8192)
    assert_close(out, ref)
    out, ref, _ = run_both(batch, max_context_len=8192, partition_size=512)
    assert_close(out, ref)


@gpu_test
def test_gpu_cuda_graph_replay_with_new_lengths(early_reads):
    max_len = 4096
    batch = make_paged_batch([max_len] * 4, num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    scale = 128**-0.5
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, scale)
    out = torch.empty_like(batch.q)
    paged_decode_attention(*args, out=out, max_context_len=max_len)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(*args, out=out, max_context_len=max_len)
    batch.context_lens.copy_(torch.tensor([1, 700, 4096, 2049], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, paged_decode_attention_ref(*args))


def test_split_context_is_one_launch(monkeypatch):
    # the last split to finish merges the partial states: no second (reduction) kernel
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    launches = []
    for cls in (InterpretedFunction, JITFunction):
        def counted(self, *args, _run=cls.run, **kwargs):
            launches.append(self)
            return _run(self, *args, **kwargs)

        monkeypatch.setattr(cls, "run", counted)
    batch = make_paged_batch([150, 40], num_heads=4, num_kv_heads=2, block_size=16)
    out, ref, _ = run_both(batch, partition_size=16)  # up to 10 splits
    assert len(launches) == 1
    assert_close(out, ref)
