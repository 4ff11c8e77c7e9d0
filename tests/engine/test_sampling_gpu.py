"""Sampling through the engine on a CUDA GPU, against HF transformers' float32 logits.

In its own module so that no other module's engine holds GPU memory while these size theirs.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.test_gpu import SIZES, make_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def fp32_llama(tmp_path_factory):
    from engine.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("fp32") / "model", arch="llama", seed=9, **SIZES)


def test_sampled_first_tokens_follow_hf_softmax(fp32_llama):
    """Unseeded sampling at T = 0.7 through the engine's GPU sampler: the first token's
    frequencies over 3,000 requests follow softmax(logits / 0.7) of HF's float32 logits."""
    import transformers

    prompt = make_prompts(300, 6, seed=3)[4]
    model = transformers.AutoModelForCausalLM.from_pretrained(fp32_llama, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt], device="cuda")).logits[0, -1].float().cpu()
    del model
    temperature, n = 0.7, 3000
    probs = torch.softmax(logits / temperature, dim=-1)
    assert 0.05 < probs.max() < 0.9, "the test needs a spread-out distribution"
    llm = LLM(str(fp32_llama), dtype="float32", swap_space=0, gpu_memory_utilization=0.3, max_num_seqs=256)
    outs = llm.generate([prompt] * n, SamplingParams(temperature=temperature, max_tokens=1, ignore_eos=True),
                        use_tqdm=False)
    llm.shutdown()
    counts = torch.bincount(torch.tensor([o.outputs[0].token_ids[0] for o in outs]), minlength=len(probs))
    freq = counts.double() / n
    # each token within five standard deviations of its binomial count (plus a count of slack)
    bound = 5 * (probs.double() * (1 - probs.double()) / n).sqrt() + 1.0 / n
    worst = int(((freq - probs.double()).abs() - bound).argmax())
    assert ((freq - probs.double()).abs() <= bound).all(), (
        f"token {worst}: frequency {freq[worst]:.4f}, softmax(logits / T) {probs[worst]:.4f}")
    # and the samples are likelier at T = 0.7 than at T = 1 or T^2 (a temperature dropped or applied twice)
    def log_likelihood(t: float) -> float:
        return float((counts * torch.log_softmax(logits / t, dim=-1)).sum())

    assert log_likelihood(temperature) > max(log_likelihood(1.0), log_likelihood(temperature**2))


def test_seeded_sampling_repeats_whatever_shares_the_batch(fp32_llama):
    """A request with a seed draws the same tokens alone and among unseeded requests."""
    prompts = make_prompts(300, 12, seed=4)
    seeded = [SamplingParams(temperature=0.9, top_p=0.95, seed=s, max_tokens=12, ignore_eos=True) for s in range(4)]
    llm = LLM(str(fp32_llama), dtype="float32", swap_space=0, gpu_memory_utilization=0.3, max_num_seqs=32)
    alone = llm.generate(prompts[:4], seeded, use_tqdm=False)
    crowd = llm.generate(prompts[4:] + prompts[:4],
                         [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)] * 8 + seeded,
                         use_tqdm=False)[8:]
    llm.shutdown()
    assert [o.outputs[0].token_ids for o in crowd] == [o.outputs[0].token_ids for o in alone]
    assert len({tuple(o.outputs[0].token_ids) for o in alone}) == 4
