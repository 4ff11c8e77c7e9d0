"""Triton kernels for the engine, each beside a plain-torch reference of the same signature.

The launchers need a CUDA device (or ``TRITON_INTERPRET=1`` on CPU); the ``*_ref`` functions
run anywhere and are what the CPU attention backend uses. Importing this package never
needs a GPU, nor triton itself.
"""

from sluiceway_kernels._common import triton_available
from sluiceway_kernels.argmax_logsumexp import argmax_logsumexp, argmax_logsumexp_ref
from sluiceway_kernels.fp8_small_m import fp8_small_m_matmul
from sluiceway_kernels.fp8_quant import per_token_quant_fp8, per_token_quant_fp8_ref, scale_epilogue, scale_epilogue_ref
from sluiceway_kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_ref
from sluiceway_kernels.paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from sluiceway_kernels.rope_decode_attention import rope_decode_attention, rope_decode_attention_ref
from sluiceway_kernels.rope_store import rope_store, rope_store_ref
from sluiceway_kernels.rms_norm import rms_norm, rms_norm_ref
from sluiceway_kernels.rotary import apply_rotary, apply_rotary_ref, make_cos_sin_cache
from sluiceway_kernels.sampling import sample_from_logits, sample_from_logits_ref
from sluiceway_kernels.silu_mul import silu_and_mul, silu_and_mul_fp8, silu_and_mul_fp8_ref, silu_and_mul_ref
from sluiceway_kernels.silu_mul_gemv import silu_mul_linear, silu_mul_linear_ref
from sluiceway_kernels.small_m_linear import small_m_linear, small_m_linear_ref
from sluiceway_kernels.store_kvcache import store_kvcache, store_kvcache_ref

__all__ = [
    "triton_available",
    "store_kvcache",
    "store_kvcache_ref",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "rope_decode_attention",
    "rope_decode_attention_ref",
    "rope_store",
    "rope_store_ref",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "rms_norm",
    "rms_norm_ref",
    "apply_rotary",
    "apply_rotary_ref",
    "make_cos_sin_cache",
    "silu_and_mul",
    "silu_and_mul_ref",
    "silu_mul_linear",
    "silu_mul_linear_ref",
    "small_m_linear",
    "small_m_linear_ref",
    "sample_from_logits",
    "sample_from_logits_ref",
    "argmax_logsumexp",
    "argmax_logsumexp_ref",
    "per_token_quant_fp8",
    "fp8_small_m_matmul",
    "per_token_quant_fp8_ref",
    "scale_epilogue",
    "scale_epilogue_ref",
    "silu_and_mul_fp8",
    "silu_and_mul_fp8_ref",
]
