"""small_m_linear: a few rows' product with RMSNorm (and the residual add) in its prologue and
SwiGLU in its epilogue, or SwiGLU in its prologue and RMSNorm (and the residual add) after it,
against rms_norm, a product and silu_and_mul one after another."""

import importlib

import pytest
import torch
from kernels_testlib import DEVICE, assert_close, gpu_test, poisoned

from sluiceway_kernels import rms_norm, rms_norm_ref, silu_and_mul_ref
from sluiceway_kernels.small_m_linear import MAX_ROWS, small_m_linear, small_m_linear_ref


def inputs(m, n, inner, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, inner, generator=gen) * 2).to(dtype).to(DEVICE)
    residual = torch.randn(m, inner, generator=gen).to(dtype).to(DEVICE)
    weight = (torch.randn(n, inner, generator=gen) / inner**0.5).to(dtype).to(DEVICE)
    norm_weight = (1 + 0.1 * torch.randn(inner, generator=gen)).to(dtype).to(DEVICE)
    return x, residual, weight, norm_weight


FOLDINGS = {  # name -> (norm, residual, silu_mul)
    "plain": (False, False, False),
    "norm": (True, False, False),
    "norm+residual": (True, True, False),
    "silu_mul": (False, False, True),
    "norm+residual+silu_mul": (True, True, True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("folding", list(FOLDINGS))
@pytest.mark.parametrize("m,n,inner,split_k,dot", [
    (1, 96, 200, 1, True),  # ragged columns and inner dim, one split
    (3, 64, 256, 2, True),  # splits merged by the last to arrive
    (8, 130, 520, 3, True),  # ragged splits
    (1, 96, 200, 2, False),  # multiply-adds over one row
    (3, 64, 256, 3, False),  # over four rows, one of them past M
])
def test_matches_the_unfused_steps(dtype, folding, m, n, inner, split_k, dot):
    norm, with_residual, silu_mul = FOLDINGS[folding]
    x, residual, weight, norm_weight = inputs(m, n, inner, dtype)
    kwargs = dict(norm_weight=norm_weight if norm else None, eps=1e-5,
                  residual=residual if with_residual else None, silu_mul=silu_mul)
    out = poisoned((m, n // 2 if silu_mul else n), dtype)
    got = small_m_linear(x, weight, out=out, config=(32, 32, 4, 2), split_k=split_k, dot=dot, **kwargs)
    want = small_m_linear_ref(x, weight, **kwargs)
    if with_residual:
        (got, got_residual), (want, want_residual) = got, want
        _, kernel_residual = rms_norm(x, norm_weight, 1e-5, residual)
        assert torch.equal(got_residual, kernel_residual)  # the rounded sum, as rms_norm writes it
    assert got is out
    assert_close(got, want)


@pytest.mark.parametrize("m,n,inner,split_k,dot", [
    (1, 96, 200, 1, True),  # one split of seven tiles, the last ragged
    (3, 64, 256, 2, True),  # two splits of four tiles
    (8, 130, 520, 5, True),  # ragged splits and columns
    (1, 96, 32, 1, True),  # a single tile: the loop after the preloaded one runs no step
    (3, 64, 256, 3, False),  # multiply-adds
])
@pytest.mark.parametrize("norm_after", [False, True])
def test_a_first_tile_loaded_before_the_wait_is_added_once(m, n, inner, split_k, dot, norm_after):
    # o's and down's products load their first weight tile ahead of wait_for_previous
    x, residual, weight, norm_weight = inputs(m, n, inner, torch.bfloat16)
    kwargs = dict(eps=1e-5, norm_after=norm_weight[:n] if norm_after and n <= inner else None,
                  residual=residual[:, :n] if norm_after and n <= inner else None)
    got = small_m_linear(x, weight, out=poisoned((m, n), torch.bfloat16), config=(32, 32, 4, 2), split_k=split_k,
                         dot=dot, **kwargs)
    want = small_m_linear_ref(x, weight, **kwargs)
    if kwargs["residual"] is not None:
        (got, _), (want, _) = got, want
    assert_close(got, want)


AFTER = {  # name -> (silu_in, norm_after, residual): the down projection's side of a layer
    "silu_in": (True, False, False),
    "norm_after": (False, True, False),
    "norm_after+residual": (False, True, True),
    "silu_in+norm_after+residual": (True, True, True),
}


def after_kwargs(folding, x, residual, norm_weight, n):
    silu_in, norm_after, with_residual = AFTER[folding]
    inner = x.shape[1]
    return (torch.cat([x, -x.flip(1)], 1) if silu_in else x,  # the gate's columns, then the up's
            dict(silu_in=silu_in, eps=1e-5, norm_after=norm_weight[:n] if norm_after else None,
                 residual=residual[:, :n] if with_residual else None)) if n <= inner else None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("folding", list(AFTER))
@pytest.mark.parametrize("m,n,inner,split_k,dot,chunk", [
    (1, 96, 200, 1, True, None),  # three column blocks, one split: every program ends a block
    (3, 64, 256, 2, True, None),  # splits merged by the last to arrive, then the norm by the last block
    (8, 130, 520, 3, True, 32),  # ragged splits and columns; the norm over five chunks of a row
    (1, 96, 200, 2, False, 64),  # multiply-adds over one row; two chunks
    (3, 64, 256, 3, False, None),
])
def test_the_down_side_matches_the_unfused_steps(monkeypatch, dtype, folding, m, n, inner, split_k, dot, chunk):
    if chunk:
        monkeypatch.setattr(importlib.import_module("sluiceway_kernels.small_m_linear"), "NORM_AFTER_BLOCK", chunk)
    x, residual, weight, norm_weight = inputs(m, n, inner, dtype, seed=1)
    x, kwargs = after_kwargs(folding, x, residual, norm_weight, n)
    out = poisoned((m, n), dtype)
    got = small_m_linear(x, weight, out=out, config=(32, 32, 4, 2), split_k=split_k, dot=dot, **kwargs)
    want = small_m_linear_ref(x, weight, **kwargs)
    if kwargs["residual"] is not None:
        (got, got_residual), (want, want_residual) = got, want
        product = small_m_linear(x, weight, config=(32, 32, 4, 2), split_k=split_k, dot=dot, silu_in=kwargs["silu_in"])
        _, kernel_residual = rms_norm(product, kwargs["norm_after"], 1e-5, kwargs["residual"])
        assert torch.equal(got_residual, kernel_residual)  # the product's rounded sum, as rms_norm writes it
    assert got is out
    assert_close(got, want)


def test_the_reference_is_the_unfused_steps():
    x, residual, weight, norm_weight = inputs(4, 64, 96, torch.float32)
    normed, new_residual = rms_norm_ref(x, norm_weight, 1e-6, residual)
    want = silu_and_mul_ref(normed @ weight.t())
    got, got_residual = small_m_linear_ref(x, weight, norm_weight, 1e-6, residual, silu_mul=True)
    torch.testing.assert_close(got, want)
    assert torch.equal(got_residual, new_residual)


def test_the_down_sides_reference_is_the_unfused_steps():
    x, residual, weight, norm_weight = inputs(4, 64, 96, torch.float32)
    gate_up = torch.cat([x, x.flip(1)], 1)
    want = rms_norm_ref(silu_and_mul_ref(gate_up) @ weight.t(), norm_weight[:64], 1e-6, residual[:, :64])
    got = small_m_linear_ref(gate_up, weight, residual=residual[:, :64], silu_in=True, norm_after=norm_weight[:64])
    torch.testing.assert_close(got[0], want[0])
    assert torch.equal(got[1], want[1])


def test_counters_reset_between_launches_of_every_folding():
    x, residual, weight, norm_weight = inputs(2, 64, 256, torch.float32)
    for silu_mul, after, split_k in ((False, False, 4), (True, False, 4), (False, True, 4), (False, True, 1),
                                     (False, False, 4), (False, True, 4)):
        folding = dict(norm_after=norm_weight[:64], residual=residual[:, :64]) if after else dict(
            norm_weight=norm_weight, residual=residual, silu_mul=silu_mul)
        got = small_m_linear(x, weight, config=(32, 32, 4, 2), split_k=split_k, **folding)
        want = small_m_linear_ref(x, weight, **folding)
        assert_close(got[0], want[0])


def test_rejects_bad_arguments_naming_the_field():
    x, residual, weight, norm_weight = inputs(2, 64, 256, torch.float32)
    with pytest.raises(ValueError, match="weight has 256 columns; expected x's 200"):
        small_m_linear(x[:, :200], weight)
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS}"):
        small_m_linear(x.repeat(MAX_ROWS, 1), weight)
    with pytest.raises(ValueError, match="weight has dtype"):
        small_m_linear(x, weight.half())
    with pytest.raises(ValueError, match="residual goes with norm_weight"):
        small_m_linear(x, weight, residual=residual)
    with pytest.raises(ValueError, match="norm_weight has shape"):
        small_m_linear(x, weight, norm_weight[:10])
    with pytest.raises(ValueError, match="an even count, got 63"):
        small_m_linear(x, weight[:63], silu_mul=True)
    with pytest.raises(ValueError, match="the gate then the up columns: 512 for weight's 256, got 256"):
        small_m_linear(x, weight, silu_in=True)
    with pytest.raises(ValueError, match="silu_in takes neither silu_mul nor norm_weight"):
        small_m_linear(torch.cat([x, x], 1), weight, norm_weight, silu_in=True)
    with pytest.raises(ValueError, match="one norm a launch"):
        small_m_linear(x, weight, norm_weight, norm_after=norm_weight[:64])
    with pytest.raises(ValueError, match="norm_after has shape"):
        small_m_linear(x, weight, norm_after=norm_weight)
    with pytest.raises(ValueError, match="residual has shape"):
        small_m_linear(x, weight, norm_after=norm_weight[:64], residual=residual)


@gpu_test
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("shape,folding", [
    ((6144, 4096), "norm+residual"),  # q/k/v after the input norm
    ((4096, 4096), "plain"),  # the output projection
    ((28672, 4096), "norm+residual+silu_mul"),  # gate/up after the post-attention norm
    ((4096, 14336), "plain"),  # the down projection
])
def test_gpu_llama8b_layer(m, shape, folding):
    norm, with_residual, silu_mul = FOLDINGS[folding]
    x, residual, weight, norm_weight = inputs(m, *shape, torch.bfloat16)
    kwargs = dict(norm_weight=norm_weight if norm else None, residual=residual if with_residual else None,
                  silu_mul=silu_mul)
    got, want = small_m_linear(x, weight, **kwargs), small_m_linear_ref(x, weight, **kwargs)
    if with_residual:
        (got, _), (want, _) = got, want
    assert_close(got, want)


@gpu_test
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("shape,folding", [
    ((4096, 4096), "norm_after+residual"),  # the output projection, then the post-attention norm
    ((4096, 14336), "silu_in+norm_after+residual"),  # SwiGLU, down, the next layer's input norm
])
def test_gpu_llama8b_down_side(m, shape, folding):
    x, residual, weight, norm_weight = inputs(m, shape[0], shape[1], torch.bfloat16)
    x, kwargs = after_kwargs(folding, x, residual, norm_weight, shape[0])
    for _ in range(3):  # the counters are back at zero after each launch
        got, got_residual = small_m_linear(x, weight, **kwargs)
        want, want_residual = small_m_linear_ref(x, weight, **kwargs)
        assert_close(got, want)
        assert_close(got_residual, want_residual)
