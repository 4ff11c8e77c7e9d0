"""``quantization="fp8"`` on a CUDA GPU: ``torch._scaled_mm`` against the emulation, the
error against bf16 on llama3-8b's layer shapes, and the engine against HF."""

import pytest
import torch

from engine import LLM
from engine.layers.fp8 import SMALL_M, fp8_linear, fp8_matmul_emulated, quantize_rows
from kernels.fp8_quant import per_token_quant_fp8_ref, quantize_rows_ref
from engine.tiny import build_tiny_model
from tests.engine.test_fp8 import GREEDY, hf_greedy, hf_on_dequantized_weights
from tests.engine.test_generate import make_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU of compute capability 8.9+")]

# llama3-8b's four matmuls per layer: (in, out)
LLAMA3_8B = {"qkv_proj": (4096, 6144), "o_proj": (4096, 4096), "gate_up_proj": (4096, 28672),
             "down_proj": (14336, 4096)}
# NOTE: e4m3 keeps 3 mantissa bits, so each operand carries ~2.6% rms rounding error and a
# product of two ~3.7% (seen 0.0373-0.0375 in the CPU emulation on these shapes); the bound
# leaves room for bf16 rounding of the output.
REL_ERROR_BOUND = 0.045


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llama") / "model", arch="llama", seed=3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 8, SMALL_M, SMALL_M + 1, 512])  # unit-scale path, then rowwise scales
@pytest.mark.parametrize("bias", [False, True])
def test_scaled_mm_equals_the_emulation(dtype, m, bias):
    torch.manual_seed(m)
    w = torch.randn(1024, 512, device="cuda") * 0.02
    q, scale = quantize_rows(w)
    q_ref, scale_ref = quantize_rows_ref(w)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(scale, scale_ref)
    x = (torch.randn(m, 512, device="cuda") * 3).to(dtype)
    b = torch.randn(1024, device="cuda").to(dtype) if bias else None
    y = fp8_linear(x, q, scale, b)
    xq, xs = per_token_quant_fp8_ref(x)
    expected = fp8_matmul_emulated(xq, xs, q, scale, b, torch.float32)
    assert y.dtype == dtype and y.shape == (m, 1024)
    rel = ((y.float() - expected).norm() / expected.norm()).item()
    assert rel < (4e-3 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("name", list(LLAMA3_8B))
def test_relative_error_against_bf16_on_llama3_8b_layer_shapes(name):
    """Dummy-weight statistics (N(0, 0.02)), 256 tokens of unit activations: the FP8 layer is
    within REL_ERROR_BOUND of the bf16 one."""
    k, n = LLAMA3_8B[name]
    torch.manual_seed(0)
    w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    x = torch.randn(256, k, device="cuda").to(torch.bfloat16)
    q, scale = quantize_rows(w)
    reference = torch.nn.functional.linear(x, w).float()
    rel = ((fp8_linear(x, q, scale).float() - reference).norm() / reference.norm()).item()
    print(f"{name}: relative error against bf16 {rel:.4f}")
    assert 0.01 < rel < REL_ERROR_BOUND


def test_engine_greedy_matches_hf_on_dequantized_weights(tiny_llama):
    """On the GPU with CUDA graphs: decode batches below SMALL_M take the unit-scale product,
    the prefill rowwise scales (fp32 model: the epilogue applies them)."""
    path = tiny_llama
    prompts = make_prompts(384, n=6, seed=2)
    with LLM(str(path), device="cuda", dtype="float32", quantization="fp8", gpu_memory_utilization=0.3,
             swap_space=0) as llm:
        assert llm.llm_engine.executor.runner.model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    tokens, logprobs = hf_greedy(hf_on_dequantized_weights(path), prompts)
    assert [o.outputs[0].token_ids for o in outs] == tokens
    for out, expected in zip(outs, logprobs):
        got = [lp[t] for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
        assert got == pytest.approx(expected, abs=2e-2)


def test_bf16_engine_runs_fp8_end_to_end(tiny_llama):
    """bf16 activations take rowwise scales in prefill; the tokens are those of the emulation
    for most prompts (bf16 rounding may flip a near tie)."""
    path = tiny_llama
    prompts = make_prompts(384, n=8, seed=3)
    with LLM(str(path), device="cuda", dtype="bfloat16", quantization="fp8", gpu_memory_utilization=0.3,
             swap_space=0) as llm:
        gpu = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    with LLM(str(path), device="cpu", dtype="bfloat16", quantization="fp8", swap_space=0) as llm:
        cpu = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    same_first = sum(a[:4] == b[:4] for a, b in zip(gpu, cpu))
    assert same_first >= 6, (gpu, cpu)
