"""``kv_cache_dtype="fp8"``: keys and values held as float8 e4m3 (CPU, float32 weights).

The reference is HF transformers on the same weights with every key and value rounded to
float8 e4m3 (clamped to +-448) before attention: the engine's greedy tokens must equal it,
through both attention backends, with chunked prefill, prefix caching and swap preemption.
"""

import pytest
import torch
import transformers
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from engine import LLM, SamplingParams
from engine.models.tiny import build_tiny_model
from tests.engine.test_generate import make_prompts

MAX_TOKENS = 12


def _fp8_round(t: torch.Tensor) -> torch.Tensor:
    top = torch.finfo(torch.float8_e4m3fn).max  # 448
    return t.float().clamp(-top, top).to(torch.float8_e4m3fn).to(t.dtype)


def _fp8_kv_sdpa(module, query, key, value, attention_mask, **kwargs):
    return sdpa_attention_forward(module, query, _fp8_round(key), _fp8_round(value), attention_mask, **kwargs)


AttentionInterface.register("fp8_kv_sdpa", _fp8_kv_sdpa)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llama") / "model", arch="llama", seed=3)


@pytest.fixture(scope="module")
def hf_fp8(tiny_llama):
    """``greedy(prompts) -> (token lists, their logprobs)`` from HF with float8-rounded keys and values."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32,
                                                              attn_implementation="fp8_kv_sdpa")
    model.generation_config.eos_token_id = None

    def greedy(prompts):
        tokens, logprobs = [], []
        with torch.no_grad():
            for p in prompts:
                ids = torch.tensor([p])
                gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                     min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0,
                                     output_logits=True, return_dict_in_generate=True)
                new = gen.sequences[0, len(p):]
                tokens.append(new.tolist())
                steps = torch.log_softmax(torch.stack(gen.logits)[:, 0].float(), dim=-1)  # (steps, V)
                logprobs.append(steps.gather(1, new[:, None])[:, 0].tolist())
        return tokens, logprobs

    return greedy


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


GPU = pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("device,backend", [("cpu", "torch"), ("cpu", "triton"),
                                            pytest.param("cuda", "triton", marks=GPU)])
def test_greedy_matches_hf_with_float8_keys_and_values(tiny_llama, hf_fp8, device, backend):
    """Chunked prefill (budget 32), shared prefixes and swap preemption (30 blocks) at once;
    on a GPU with CUDA graphs too (HF runs on the CPU)."""
    with LLM(str(tiny_llama), device=device, dtype="float32", kv_cache_dtype="fp8", attention_backend=backend,
             block_size=8, max_num_batched_tokens=32, max_num_seqs=8, num_gpu_blocks_override=30, swap_space=0.01,
             preemption_mode="swap", gpu_memory_utilization=0.3) as llm:
        engine = llm.llm_engine
        assert engine.executor.runner.cache.kv_caches[0][0].dtype == torch.float8_e4m3fn
        prompts = make_prompts(engine.vocab_size, n=6, seed=2)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        stats = engine.get_stats()
        blocks_in = engine.executor.runner.cache.counters.blocks_in
    tokens, logprobs = hf_fp8(prompts)
    assert [o.outputs[0].token_ids for o in outs] == tokens
    # float8 rounding moves logprobs by 0.02-0.15 on these weights; the engine stays within 1e-4 of HF's
    for out, expected in zip(outs, logprobs):
        got = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
        # on a GPU a key a hair from a float8 rounding midpoint may round the other way than on the CPU
        assert got == pytest.approx(expected, abs=1e-4 if device == "cpu" else 1e-2)
    assert stats.num_preemptions > 0 and blocks_in > 0, "meant to swap"
    assert stats.prefix_cache_hit_rate > 0


def test_float8_changes_the_numbers_and_halves_the_cache(tiny_llama):
    """Against the float32 cache: each block takes a quarter of the bytes, and the logprobs move
    (so the tests above compare a cache that really is float8)."""
    prompts = make_prompts(384, n=4, seed=5)
    runs = {}
    for kv in ("auto", "fp8"):
        with LLM(str(tiny_llama), device="cpu", kv_cache_dtype=kv, swap_space=0, num_gpu_blocks_override=64) as llm:
            runs[kv] = (llm.llm_engine.config.kv_bytes_per_block,
                        [o.outputs[0].logprobs for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
    assert runs["fp8"][0] * 4 == runs["auto"][0]
    first = [(lp[0], lp8[0]) for lp, lp8 in zip(runs["auto"][1], runs["fp8"][1])]
    moved = [abs(max(v.logprob for v in a.values()) - max(v.logprob for v in b.values())) for a, b in first]
    assert max(moved) > 1e-4


def test_unknown_kv_cache_dtype_names_the_field(tiny_llama):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3; got 'int4'"):
        LLM(str(tiny_llama), device="cpu", kv_cache_dtype="int4")
