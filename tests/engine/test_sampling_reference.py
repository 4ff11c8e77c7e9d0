"""The sampler's rules against HF transformers' logits warpers and plain-torch statements of
vLLM's documented rules, on rows that share one batch with rows of other parameters."""

import pytest
import torch
from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from engine.core.sequence import Sequence
from engine.runner.sampler import Sampler
from engine.sampling_params import SamplingParams

V = 16


def seq(params, tokens=(1, 2, 3), prompt_len=2):
    return Sequence("r", 0, list(tokens), prompt_len, params)


def hf_kept(logits, top_k, top_p, min_p):
    """The tokens HF's warpers leave, in HF's order: top-k, top-p, min-p."""
    scores = logits.clone().unsqueeze(0)  # (1, V)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    if min_p > 0.0:
        scores = MinPLogitsWarper(min_p)(None, scores)
    return set((scores[0] > float("-inf")).nonzero().flatten().tolist())


def tied_logits():
    """Logits in steps of 0.5, so that several tokens share each value (as bf16 logits do)."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(-6, 6, (V,), generator=g).float() / 2  # (V,)


@pytest.mark.parametrize("top_k,top_p,min_p", [(2, 1.0, 0.0), (3, 1.0, 0.0), (4, 1.0, 0.0), (5, 1.0, 0.0),
                                               (4, 0.7, 0.0), (5, 1.0, 0.3)])
def test_kept_set_with_ties_matches_hf(top_k, top_p, min_p):
    """A tie at the k-th logit keeps every tied token, as HF (and vLLM) keep them; the filtered
    row shares the batch with an unfiltered one and one of another top_k."""
    logits = tied_logits()
    assert (logits == logits.sort(descending=True).values[top_k - 1]).sum() > 1, "the k-th logit must be tied"
    rows = [SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p),
            SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=7)]
    seqs = [seq(p) for p in rows]
    out = Sampler(V, set())._filter(logits.repeat(3, 1), seqs)  # (3, V)
    for row, p in enumerate(rows):
        kept = set((out[row] > float("-inf")).nonzero().flatten().tolist())
        assert kept == hf_kept(logits, p.top_k, p.top_p, p.min_p), f"row {row}"
