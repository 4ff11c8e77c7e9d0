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

from sluiceway_kernels import paged_decode_attention, paged_prefill_attention, paged_prefill_attention_ref

# (context_len, q_len): a whole prompt, a prefix-cache hit, a chunk of a chunked prefill,
# a decode step, a one-token prompt, and a prompt ending on a block boundary
MIXED = [(37, 37), (50, 10), (90, 24), (33, 1), (1, 1), (32, 32)]


def batch_of(cases, **kwargs):
    return make_paged_batch([c for c, _ in cases], [q for _, q in cases], **kwargs)


def run_both(batch, max_query_len=None, **kwargs):
    scale = batch.q.shape[-1] ** -0.5
    max_query_len = batch.max_query_len if max_query_len is None else max_query_len
    args = (
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.query_start_loc,
        batch.context_lens,
        batch.block_tables,
        scale,
        max_query_len,
    )
    out = poisoned(batch.q.shape, batch.q.dtype)
    result = paged_prefill_attention(*args, out=out, **kwargs)
    assert result is out
    return out, paged_prefill_attention_ref(*args), scale


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,block_size",
    [
        (4, 4, 16),  # MHA
        (8, 2, 8),  # GQA
        (8, 2, 32),
        (14, 2, 64),  # a group of 7: tiles hold 9 tokens
        (8, 1, 128),  # MQA
        (4, 2, 1),  # degenerate pages
        (4, 2, 256),  # the largest block
    ],
)
def test_matches_reference_across_groups_and_block_sizes(num_heads, num_kv_heads, block_size):
    batch = batch_of(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=block_size)
    out, ref, _ = run_both(batch)
    assert_close(out, ref)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_head_dims(head_dim):
    batch = batch_of([(20, 20), (40, 7)], num_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=16)
    out, ref, _ = run_both(batch)
    assert_close(out, ref)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_half_dtypes(dtype):
    batch = batch_of(MIXED, num_heads=8, num_kv_heads=2, block_size=16, dtype=dtype)
    out, ref, _ = run_both(batch)
    assert out.dtype == dtype
    assert_close(out, ref)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_long_prompt_spans_many_tiles(dtype):
    # 150 queries over 200 positions: several query tiles, unmasked and diagonal kv tiles
    batch = batch_of([(200, 150), (3, 2)], num_heads=2, num_kv_heads=1, block_size=16, dtype=dtype)
    out, ref, _ = run_both(batch)
    assert_close(out, ref)


def test_generous_max_query_len_and_empty_query():
    # a sequence with no new tokens this step, and a bound above the true longest query
    batch = batch_of([(10, 0), (40, 12), (5, 5)], num_heads=4, num_kv_heads=2, block_size=8)
    out, ref, _ = run_both(batch, max_query_len=64)
    assert_close(out, ref)
    out, ref, _ = run_both(batch, max_query_len=1)  # too small a bound changes only the tiles
    assert_close(out, ref)


def test_single_token_queries_match_decode_kernel():
    batch = batch_of([(c, 1) for c in [1, 16, 17, 70]], num_heads=8, num_kv_heads=2, block_size=16)
    out, _, scale = run_both(batch)
    decode = paged_decode_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, scale, partition_size=16
    )
    assert_close(out, decode)


def test_strided_query():
    batch = batch_of(MIXED, num_heads=4, num_kv_heads=2, block_size=16)
    fused = torch.randn(batch.q.shape[0], 8, 64, device=DEVICE)  # q as a view of a fused qkv output
    fused[:, :4] = batch.q
    batch.q = fused[:, :4]
    out, ref, _ = run_both(batch)
    assert_close(out, ref)


@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(8, 2, 16), (6, 3, 1), (4, 1, 32)])
def test_reference_matches_naive_attention(num_heads, num_kv_heads, block_size):
    batch = batch_of(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=block_size)
    _, ref, scale = run_both(batch)
    torch.testing.assert_close(ref.double().cpu(), naive_attention(batch, scale), atol=1e-5, rtol=1e-5)


def test_rejects_bad_arguments():
    batch = batch_of([(5, 5), (9, 2)], num_heads=4, num_kv_heads=2)
    args = [
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.query_start_loc,
        batch.context_lens,
        batch.block_tables,
        0.1,
        5,
    ]
    with pytest.raises(ValueError, match="max_query_len"):
        paged_prefill_attention(*args[:7], -1)
    with pytest.raises(ValueError, match="context_lens has shape"):
        paged_prefill_attention(*args[:4], batch.context_lens[:1], *args[5:])
    with pytest.raises(ValueError, match="cache head_dim"):
        paged_prefill_attention(batch.q[..., :32], *args[1:])
    with pytest.raises(ValueError, match="q has dtype"):
        paged_prefill_attention(batch.q.double(), *args[1:])


@gpu_test
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_gpu_llama8b_prefill_with_prefix_hits(block_size, dtype):
    cases = [(2048, 2048), (8192, 512), (4000, 1), (1000, 999), (6000, 2048), (17, 17)]
    batch = batch_of(cases, num_heads=32, num_kv_heads=8, head_dim=128, block_size=block_size, dtype=dtype)
    out, ref, _ = run_both(batch)
    assert_close(out, ref)


@gpu_test
def test_gpu_group_of_seven_and_head_dim_80():
    batch = batch_of(
        [(3000, 1500), (700, 700)], num_heads=28, num_kv_heads=4, head_dim=80, block_size=16, dtype=torch.bfloat16
    )
    out, ref, _ = run_both(batch)
    assert_close(out, ref)
