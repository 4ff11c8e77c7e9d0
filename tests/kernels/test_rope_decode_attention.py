"""The fused rotary + KV store + decode attention kernel against the three unfused references."""

import pytest
import torch
from kernels_testlib import DEVICE, assert_close, gpu_test, make_paged_batch, poisoned

from sluiceway_kernels import make_cos_sin_cache, paged_decode_attention, rope_decode_attention, rope_decode_attention_ref
from sluiceway_kernels._common import FP8_KV_DTYPE


def fused_step(context, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32,
               rotary_dim=None, fp8=False, seed=0):
    """A decode step: paged contexts whose last slot (the new token's) is NaN, and the new
    token's un-rotated q, k, v as views of one fused qkv output."""
    batch = make_paged_batch(context, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                             block_size=block_size, dtype=dtype, seed=seed)
    slots = []
    for b, ctx in enumerate(context):
        if ctx == 0:
            slots.append(-1)
            continue
        slot = int(batch.block_tables[b, (ctx - 1) // block_size]) * block_size + (ctx - 1) % block_size
        batch.k_cache.view(-1, num_kv_heads, head_dim)[slot] = float("nan")  # must never be read
        batch.v_cache.view(-1, num_kv_heads, head_dim)[slot] = float("nan")
        slots.append(slot)
    if fp8:
        batch.k_cache, batch.v_cache = batch.k_cache.to(FP8_KV_DTYPE), batch.v_cache.to(FP8_KV_DTYPE)
    gen = torch.Generator().manual_seed(seed + 1)
    qkv = torch.randn(len(context), num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    q, k, v = qkv[:, :num_heads], qkv[:, num_heads:num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads:]
    positions = torch.tensor([max(c - 1, 0) for c in context], device=DEVICE)
    cos_sin = make_cos_sin_cache(max(context) + 8, rotary_dim or head_dim, base=500.0, device=DEVICE)
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    return batch, qkv, (q, k, v), slot_mapping, positions, cos_sin


def run_both(context, is_neox=True, partition_size=None, max_context_len=None, **kw):
    batch, qkv, (q, k, v), slots, positions, cos_sin = fused_step(context, **kw)
    scale = q.shape[-1] ** -0.5
    ref_caches = (batch.k_cache.clone(), batch.v_cache.clone())
    qkv_before = qkv.clone()
    out = poisoned(q.shape, q.dtype)
    got = rope_decode_attention(q, k, v, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens,
                                slots, positions, cos_sin, scale, is_neox=is_neox, out=out,
                                max_context_len=max_context_len, partition_size=partition_size)
    assert got is out
    assert torch.equal(qkv, qkv_before)  # q and k are not rotated in place
    ref = rope_decode_attention_ref(q, k, v, *ref_caches, batch.block_tables, batch.context_lens, slots, positions,
                                    cos_sin, scale, is_neox=is_neox)
    return got, ref, (batch.k_cache, batch.v_cache), ref_caches


# NOTE: one step of each cache format: the interpreter rounds fp32 -> half types toward zero,
# so its rotated keys may sit one step from torch's (compiled kernels round to nearest)
CACHE_STEP = {torch.float32: 2**-20, torch.float16: 2**-10, torch.bfloat16: 2**-7, FP8_KV_DTYPE: 2**-3}


def assert_caches_equal(caches, ref_caches):
    """The caches match everywhere (NaN where the reference has NaN), the rotated new keys
    and values within one step of the cache's format.

    NOTE: absolute tolerance of one step too: a rotated element near zero is a difference of
    two products of unit-sized inputs, and a compiled kernel's fused multiply-add rounds it
    once where torch rounds twice (on an H200 one of 54,272 fp32 elements fell outside step / 64)."""
    for got, ref in zip(caches, ref_caches, strict=True):
        step = CACHE_STEP[got.dtype]
        got, ref = got.float().cpu(), ref.float().cpu()
        torch.testing.assert_close(got, ref, atol=step, rtol=step, equal_nan=True)


@pytest.mark.parametrize("dtype,is_neox", [(torch.float32, True), (torch.float16, True), (torch.bfloat16, False)])
def test_matches_unfused_kernels_reference(dtype, is_neox, early_reads):
    got, ref, caches, ref_caches = run_both([1, 15, 16, 17, 70], is_neox=is_neox, dtype=dtype)
    assert_close(got, ref)
    assert_caches_equal(caches, ref_caches)  # the rotated key and the value reached the right slot


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size,rotary_dim",
    [(4, 4, 64, 16, 64), (14, 2, 80, 8, 80), (8, 1, 128, 1, 64), (4, 2, 64, 256, 32)],  # MHA, group 7, MQA, partial
)
def test_groups_head_dims_and_partial_rotary(num_heads, num_kv_heads, head_dim, block_size, rotary_dim):
    got, ref, caches, ref_caches = run_both([3, 40], num_heads=num_heads, num_kv_heads=num_kv_heads,
                                            head_dim=head_dim, block_size=block_size, rotary_dim=rotary_dim)
    assert_close(got, ref)
    assert_caches_equal(caches, ref_caches)


@pytest.mark.parametrize("partition_size,dtype", [(16, torch.float32), (24, torch.bfloat16)])  # aligned, ragged
def test_split_contexts_merge_in_one_launch(partition_size, dtype, early_reads):
    # 1 to 10 splits; the new token falls in the last one, which may hold only it (17 = 16 + 1)
    got, ref, caches, ref_caches = run_both([1, 17, 23, 64, 65, 150], partition_size=partition_size, dtype=dtype,
                                            block_size=8)
    assert_close(got, ref)
    assert_caches_equal(caches, ref_caches)


@pytest.mark.parametrize("context", [[300], [700, 90]])
def test_graph_sized_bound_splits_each_context_by_its_own_length(context, early_reads):
    # a bound of 4096 allows 8 splits on the interpreter's 4 "SMs"; the kernel sizes each
    # sequence's splits from its real length (300 tokens: 5 one-tile pieces; 700: 6 of 128)
    got, ref, caches, ref_caches = run_both(context, num_kv_heads=1, num_heads=4, max_context_len=4096)
    assert_close(got, ref)
    assert_caches_equal(caches, ref_caches)


def test_padding_rows_write_nothing_and_return_zeros(early_reads):
    got, ref, caches, ref_caches = run_both([0, 30, 0, 5])
    assert_close(got, ref)
    assert torch.all(got[0] == 0) and torch.all(got[2] == 0)
    assert_caches_equal(caches, ref_caches)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float8_cache_rounds_the_new_token_as_the_store_does(dtype, early_reads):
    got, ref, caches, ref_caches = run_both([1, 16, 70], fp8=True, dtype=dtype)
    assert_close(got, ref, torch.bfloat16)
    assert_caches_equal(caches, ref_caches)


def test_rejects_bad_arguments():
    batch, _, (q, k, v), slots, positions, cos_sin = fused_step([5, 9])
    args = [q, k, v, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, slots, positions,
            cos_sin, 0.1]
    with pytest.raises(ValueError, match="k has shape"):
        rope_decode_attention(q, k[:, :1], *args[2:])
    with pytest.raises(ValueError, match="v has dtype"):
        rope_decode_attention(*args[:2], v.half(), *args[3:])
    with pytest.raises(ValueError, match="slot_mapping has shape"):
        rope_decode_attention(*args[:7], slots[:1], *args[8:])
    with pytest.raises(ValueError, match="cos_sin_cache width 3"):
        rope_decode_attention(*args[:9], cos_sin[:, :3], 0.1)


def test_split_counters_are_reset_for_the_next_launch():
    batch = make_paged_batch([200, 90], num_heads=4, num_kv_heads=2, block_size=16)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.125)
    first = paged_decode_attention(*args, partition_size=32).clone()
    batch.context_lens.copy_(torch.tensor([150, 89], dtype=torch.int32))  # other split counts
    second = paged_decode_attention(*args, partition_size=32)
    from sluiceway_kernels import paged_decode_attention_ref

    assert_close(second, paged_decode_attention_ref(*args))
    assert not torch.equal(first, second)


@gpu_test
def test_gpu_cuda_graph_replay_llama8b_shapes(early_reads):
    context = [2048, 1, 700, 4096]
    batch, _, (q, k, v), slots, positions, cos_sin = fused_step(context, num_heads=32, num_kv_heads=8, head_dim=128,
                                                                dtype=torch.bfloat16)
    ref_caches = (batch.k_cache.clone(), batch.v_cache.clone())
    args = (q, k, v, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, slots, positions,
            cos_sin, 128**-0.5)
    out = torch.empty_like(q)
    rope_decode_attention(*args, out=out, max_context_len=8192)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rope_decode_attention(*args, out=out, max_context_len=8192)
    for _ in range(3):  # replays reuse the counters
        out.fill_(float("nan"))
        graph.replay()
    torch.cuda.synchronize()
    ref = rope_decode_attention_ref(q, k, v, *ref_caches, *args[5:])
    assert_close(out, ref)
    assert_caches_equal((batch.k_cache, batch.v_cache), ref_caches)
