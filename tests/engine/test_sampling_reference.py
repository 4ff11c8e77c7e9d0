"""The sampler's rules against HF transformers' logits warpers and plain-torch statements of
vLLM's documented rules, on rows that share one batch with rows of other parameters."""

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    SequenceBiasLogitsProcessor, TopKLogitsWarper, TopPLogitsWarper)

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


def vllm_kept(logits, top_k, top_p, min_p):
    """The tokens vLLM's sampler leaves, in its order: min-p over the whole vocabulary's
    probabilities, then top-k, then top-p as vLLM states it (the least likely tokens whose mass
    together stays within 1 - top_p go)."""
    scores = logits.clone()  # (V,)
    probs = scores.softmax(-1)
    scores[probs < min_p * probs.max()] = float("-inf")
    if top_k > 0:
        scores[scores < scores.topk(min(top_k, V)).values[-1]] = float("-inf")
    if top_p < 1.0:
        ascending, index = scores.softmax(-1).sort()  # (V,), (V,)
        tail = ascending.cumsum(-1) <= 1 - top_p
        tail[-1] = False
        scores[index[tail]] = float("-inf")
    return set((scores > float("-inf")).nonzero().flatten().tolist())


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


@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 0.75, 0.1), (0, 0.9, 0.05), (6, 0.8, 0.1), (4, 0.7, 0.2)])
def test_min_p_comes_before_top_k_and_top_p_as_in_vllm(top_k, top_p, min_p):
    """min-p acts first, on the whole vocabulary, so top-p measures its mass among the tokens
    min-p kept (vLLM's order): the kept sets are vLLM's, and on some rows not HF's (top-k, top-p,
    then min-p), where the nucleus of the whole distribution keeps more. Rows of other
    parameters share the batch."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, V, generator=g) * 2  # (64, V) no ties: each rule's cut is one set
    filtered = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p)
    rows = [filtered if i % 2 == 0 else SamplingParams(temperature=1.0, top_p=0.9) for i in range(64)]
    out = Sampler(V, set())._filter(logits, [seq(p) for p in rows])  # (64, V)
    orders_differ = 0
    for row, p in enumerate(rows):
        kept = set((out[row] > float("-inf")).nonzero().flatten().tolist())
        assert kept == vllm_kept(logits[row], p.top_k, p.top_p, p.min_p), f"row {row}"
        orders_differ += kept != hf_kept(logits[row], p.top_k, p.top_p, p.min_p)
    assert orders_differ, "no row tells vLLM's order from HF's"


def test_a_top_k_past_the_vocabulary_keeps_every_token():
    """top_k above the vocabulary size (vLLM takes any k) keeps all, as HF's warper does, beside
    a row whose filter makes the batch filter (was an index past the sorted logits: a crash)."""
    logits = torch.randn(V, generator=torch.Generator().manual_seed(2))  # (V,) no ties: top_p's cut is one set
    rows = [SamplingParams(temperature=1.0, top_k=10 * V), SamplingParams(temperature=1.0, top_k=10 * V, top_p=0.7),
            SamplingParams(temperature=1.0, top_k=3)]
    out = Sampler(V, set())._filter(logits.repeat(3, 1), [seq(p) for p in rows])  # (3, V)
    for row, p in enumerate(rows):
        kept = set((out[row] > float("-inf")).nonzero().flatten().tolist())
        assert kept == hf_kept(logits, min(p.top_k, V), p.top_p, p.min_p), f"row {row}"
    assert len(set((out[0] > float("-inf")).nonzero().flatten().tolist())) == V


def test_logit_bias_comes_before_the_repetition_penalty_as_in_hf():
    """Greedy tokens equal the argmax of HF's processors run in HF's order (the bias, then the
    repetition penalty over prompt and output tokens), then vLLM's frequency and presence
    penalties over the output tokens; rows without them share the batch."""
    g = torch.Generator().manual_seed(1)
    rows, seqs, expected = 24, [], []
    logits = torch.randn(rows, V, generator=g) * 2  # (rows, V)
    for i in range(rows):
        history = torch.randint(0, V, (6,), generator=g).tolist()
        bias = {t: float(b) for t, b in zip(history[:3], torch.randint(1, 5, (3,), generator=g).tolist())}
        plain = i % 4 == 3
        params = (SamplingParams(temperature=0.0) if plain else
                  SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias=bias, frequency_penalty=0.3,
                                 presence_penalty=0.2))
        seqs.append(seq(params, tokens=history, prompt_len=2))
        scores = logits[i].clone().unsqueeze(0)  # (1, V)
        if not plain:
            scores = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})(torch.tensor([history]), scores)
            scores = RepetitionPenaltyLogitsProcessor(2.0)(torch.tensor([history]), scores)
            output = history[2:]
            for t in set(output):
                scores[0, t] -= 0.3 * output.count(t) + 0.2
        expected.append(int(scores.argmax()))
    assert Sampler(V, set()).sample(logits, seqs).result().token_ids == expected
