"""The sampler's filters and penalties against a direct, loop-by-loop computation."""

import math

import pytest
import torch

from engine.runner.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.core.sequence import Sequence

V = 12
# the sampler's own draws on CPU, and on a GPU through its Triton kernels
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


def seq(params, tokens=(1, 2, 3), prompt_len=2):
    return Sequence("r", 0, list(tokens), prompt_len, params)


def draw(sampler, logits, seqs):
    """The sampler's choices for ``seqs``, read back."""
    return sampler.sample(logits, seqs).result()


def direct_filter(logits, top_k, top_p, min_p):
    """Keep-set per the definitions, in vLLM's order: min_p over the whole vocabulary, then
    top-k, then the smallest nucleus (of what is left, renormalised) reaching top_p."""
    order = sorted(range(V), key=lambda i: -logits[i])
    z = sum(math.exp(x) for x in logits)
    pmax = math.exp(logits[order[0]]) / z
    kept = [i for i in order if math.exp(logits[i]) / z >= min_p * pmax][: top_k if top_k > 0 else V]
    z = sum(math.exp(logits[i]) for i in kept)
    probs = {i: math.exp(logits[i]) / z for i in kept}
    nucleus, mass = [], 0.0
    for i in kept:
        if mass >= top_p and nucleus:
            break
        nucleus.append(i)
        mass += probs[i]
    return set(nucleus)


@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 1.0, 0.0), (3, 1.0, 0.0), (0, 0.6, 0.0), (5, 0.8, 0.0),
                                               (0, 1.0, 0.3), (4, 0.9, 0.2), (0, 0.75, 0.1)])
def test_filters_match_direct(top_k, top_p, min_p):
    torch.manual_seed(top_k)
    logits = torch.randn(2, V) * 2
    sampler = Sampler(V, set())
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p)
    seqs = [seq(params), seq(params)]
    out = sampler._filter(logits.clone(), seqs) if sampler._filters(seqs) else logits
    for row in range(2):
        kept = {i for i in range(V) if out[row, i] > float("-inf")}
        assert kept == direct_filter(logits[row].tolist(), top_k, top_p, min_p)
        for i in kept:
            assert out[row, i] == logits[row, i]


def test_penalties_match_direct():
    logits = torch.randn(1, V)
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25)
    s = seq(params, tokens=(1, 2, 3, 3, 5, 3), prompt_len=2)  # output: 3, 3, 5, 3
    out = Sampler(V, set())._apply_penalties(logits.clone(), [s])[0]
    for i in range(V):
        x = logits[0, i].item()
        if i in {1, 2, 3, 5}:
            x = x / 1.3 if x > 0 else x * 1.3
        count = [3, 3, 5, 3].count(i)
        x -= 0.25 * count + 0.5 * (count > 0)
        assert out[i].item() == pytest.approx(x, abs=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_min_tokens_masks_eos_and_stop_ids(device):
    logits = torch.zeros(1, V, device=device)
    logits[0, 4] = 10.0
    logits[0, 6] = 9.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[6])
    out = draw(Sampler(V, {4}), logits, [seq(params, tokens=(1, 2, 9), prompt_len=2)])
    assert out.token_ids[0] not in (4, 6)


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_follows_the_distribution(device):
    """Empirical frequencies of the exponential race match softmax(logits / T)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0] + [-30.0] * (V - 4)])
    params = SamplingParams(temperature=0.7)
    sampler = Sampler(V, set(), seed=3)
    n = 4000
    big = logits.repeat(n, 1).to(device)
    out = draw(sampler, big, [seq(params) for _ in range(n)])
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=V).float() / n
    expected = torch.softmax(logits[0] / 0.7, dim=0)
    assert torch.allclose(counts[:4], expected[:4], atol=0.03)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax_and_logprobs_raw(device):
    logits = torch.randn(3, V)
    params = SamplingParams(temperature=0.0, logprobs=2)
    out = draw(Sampler(V, set()), logits.to(device), [seq(params) for _ in range(3)])
    assert out.token_ids == logits.argmax(-1).tolist()
    ref = torch.log_softmax(logits, -1)
    for i in range(3):
        assert out.logprobs[i] == pytest.approx(ref[i, out.token_ids[i]].item(), abs=1e-6)
        assert set(out.top_logprobs[i]) == set(ref[i].topk(2).indices.tolist())


@pytest.mark.parametrize("device", DEVICES)
def test_tied_tokens_share_the_worse_rank(device):
    """A rank counts the tokens at least as likely, as vLLM's does: two tied for the top are both 2,
    and greedy decoding takes the first of them; a chosen token outside the top k is ranked too."""
    logits = torch.full((3, V), -4.0)
    logits[:, 5] = logits[:, 2] = 3.0  # tied for the top
    logits[:, 7] = 1.0
    logits[2, 0] = 5.0  # row 2: tokens 2 and 5 tie behind it, at the second place of its top 2
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.0, logprobs=1),
              SamplingParams(temperature=0.0, logprobs=2)]
    out = draw(Sampler(V, set()), logits.to(device), [seq(p) for p in params])
    assert out.token_ids == [2, 2, 0]
    assert {t: lp.rank for t, lp in out.top_logprobs[0].items()} == {2: 2, 5: 2}
    assert out.top_logprobs[1][2].rank == 2 and len(out.top_logprobs[1]) in (1, 2)
    (rival,) = set(out.top_logprobs[2]) - {0}
    assert rival in (2, 5) and {t: lp.rank for t, lp in out.top_logprobs[2].items()} == {0: 1, rival: 3}
    only_7 = SamplingParams(temperature=0.0, logprobs=2, allowed_token_ids=[7])
    assert draw(Sampler(V, set()), logits[:1].to(device), [seq(only_7)]).top_logprobs[0][7].rank == 3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("top_k,top_p", [(2, 1.0), (0, 0.8)])
def test_filtered_sampling_follows_the_tempered_filtered_distribution(top_k, top_p, device):
    """With a filter the logits are tempered, filtered, then drawn from at T = 1: the
    frequencies follow softmax(logits / T) renormalised over the kept tokens."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0] + [-30.0] * (V - 4)])
    params = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p)
    n = 4000
    out = draw(Sampler(V, set(), seed=5), logits.repeat(n, 1).to(device), [seq(params) for _ in range(n)])
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=V).float() / n
    probs = torch.softmax(logits[0] / 0.7, dim=0)
    kept = direct_filter((logits[0] / 0.7).tolist(), top_k, top_p, 0.0)
    expected = torch.zeros(V)
    expected[list(kept)] = probs[list(kept)] / probs[list(kept)].sum()
    assert set(torch.nonzero(counts).flatten().tolist()) <= kept
    assert torch.allclose(counts, expected, atol=0.03)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_min_p_comes_before_top_p_in_the_draws(dtype, device):
    """Tempered probabilities 0.4, 0.3, 0.2 and a tail of 0.1: min_p = 0.1 drops the tail first,
    leaving 0.44, 0.33, 0.22, of which top_p = 0.75 keeps two tokens (vLLM's order). Top-p first
    (HF's order) keeps three: the whole distribution's nucleus reaches 0.75 only at the third."""
    temperature, n = 0.5, 400
    probs = torch.tensor([0.4, 0.3, 0.2] + [0.1 / (V - 3)] * (V - 3))  # (V,)
    logits = (probs.log() * temperature).to(dtype).repeat(n, 1).to(device)  # (n, V) tempered: probs again
    params = SamplingParams(temperature=temperature, top_p=0.75, min_p=0.1)
    out = draw(Sampler(V, set(), seed=7), logits, [seq(params) for _ in range(n)])
    assert set(out.token_ids) == {0, 1}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tiny_temperature_draws_the_most_likely_token_without_nan(dtype, device):
    """A temperature of 1e-38 is raised to vLLM's floor of 0.01 (it overflowed logits / T: every
    positive logit became inf and the first of them won, or the filters' softmax made NaN).
    At 0.01 a gap of 1 between the two largest logits is 100 once tempered, past the noise's
    span of under 20: the largest is always drawn."""
    logits = torch.zeros(4, V)
    logits[:, 0] = 29.0
    logits[:, 3] = 30.0
    rows = [SamplingParams(temperature=1e-38), SamplingParams(temperature=1e-6),
            SamplingParams(temperature=1e-38, top_p=0.9, min_p=0.1), SamplingParams(temperature=1e-6, top_k=3)]
    assert all(p.temperature == 0.01 for p in rows)
    out = draw(Sampler(V, set()), logits.to(dtype).to(device), [seq(p) for p in rows])
    assert out.token_ids == [3, 3, 3, 3]
    assert all(math.isfinite(lp) for lp in out.logprobs)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_beside_sampled_rows_take_the_first_maximum(device):
    logits = torch.zeros(3, V, device=device)
    logits[:, [4, 7]] = 5.0  # a tie: greedy takes 4
    greedy = SamplingParams(temperature=0.0, top_k=1)
    sampled = SamplingParams(temperature=1.0, top_k=2)
    out = draw(Sampler(V, set()), logits, [seq(greedy), seq(sampled), seq(SamplingParams(temperature=0.0))])
    assert out.token_ids[0] == 4 and out.token_ids[2] == 4
    assert out.token_ids[1] in (4, 7)


@pytest.mark.parametrize("device", DEVICES)
def test_unseeded_draws_repeat_with_the_engine_seed_and_seeded_rows_ignore_it(device):
    logits = torch.zeros(64, V, device=device)
    free = [seq(SamplingParams(temperature=1.0)) for _ in range(64)]
    first = draw(Sampler(V, set(), seed=1), logits, free).token_ids
    assert draw(Sampler(V, set(), seed=1), logits, free).token_ids == first
    assert draw(Sampler(V, set(), seed=2), logits, free).token_ids != first
    pinned = [seq(SamplingParams(temperature=1.0, seed=9)) for _ in range(2)]
    assert draw(Sampler(V, set(), seed=1), logits[:2], pinned).token_ids == draw(Sampler(V, set(), seed=2),
        logits[:2], pinned).token_ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("top_k", [0, 40])
def test_gpu_draws_the_tokens_the_cpu_draws(top_k):
    """Same logits, same row seeds: the GPU's kernels pick the tokens of the CPU's torch path,
    for sampled rows (seeded and drawn from the engine seed) and greedy rows alike."""
    vocab = 1000
    torch.manual_seed(11)
    logits = torch.randn(96, vocab) * 3
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=top_k),
              SamplingParams(temperature=1.3, seed=7, top_k=top_k)]
    seqs = [seq(params[i % 3], tokens=(1, 2, 3 + i)) for i in range(96)]
    cpu = draw(Sampler(vocab, set(), seed=4), logits, seqs)
    gpu = draw(Sampler(vocab, set(), seed=4), logits.cuda(), seqs)
    assert gpu.token_ids == cpu.token_ids
    assert gpu.logprobs == pytest.approx(cpu.logprobs, abs=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["greedy", "greedy+logprobs", "greedy+penalty", "sampled"])
def test_logit_stats_of_a_decode_graph_choose_what_the_sampler_finds_itself(case, device):
    """A decode graph hands the sampler ``LogitStats`` of its logits (engine/runner/cuda_graph.py):
    the tokens and logprobs are those the sampler computes without them; an all-greedy step
    with no rule and no top logprobs takes the graph's choice as is."""
    from engine.runner.sampler import logit_stats

    torch.manual_seed(0)
    logits = torch.randn(4, V, device=device)
    params = {"greedy": SamplingParams(temperature=0.0),
              "greedy+logprobs": SamplingParams(temperature=0.0, logprobs=2),
              "greedy+penalty": SamplingParams(temperature=0.0, repetition_penalty=3.0),
              "sampled": SamplingParams(temperature=0.8, seed=7)}[case]
    seqs = [seq(params, tokens=(1, 2, int(logits[i].argmax()))) for i in range(4)]
    stats = logit_stats(logits)
    stats.greedy_rows[1] += 100.0  # marks the rows the graph made: read back as they are only on the fast path
    out = Sampler(V, set()).sample(logits, seqs, stats=stats).result()
    alone = Sampler(V, set()).sample(logits, seqs).result()
    assert out.token_ids == alone.token_ids
    shift = 100.0 if case == "greedy" else 0.0
    assert out.logprobs == pytest.approx([lp + shift for lp in alone.logprobs], abs=1e-5)
    assert out.top_logprobs == alone.top_logprobs
    if case == "greedy+penalty":  # the penalty moved every row's choice off the raw argmax
        assert out.token_ids != stats.best.tolist()


def test_logit_stats_over_padded_columns_are_not_used():
    """Stats a graph computed over an LM head wider than the vocabulary (padding) could name a
    token that does not exist: the sampler then finds its own."""
    from engine.runner.sampler import logit_stats

    logits = torch.randn(2, V + 4)
    logits[:, V + 1] = 50.0  # a padding column holds the maximum
    out = Sampler(V, set()).sample(logits, [seq(SamplingParams(temperature=0.0))] * 2,
                                   stats=logit_stats(logits)).result()
    assert out.token_ids == logits[:, :V].argmax(-1).tolist()
