"""``LLMEngine.add_request(..., resume_token_ids=...)``: a run resumed from the tokens an
interrupted run produced ends exactly as the uninterrupted run does."""

import pytest

from engine import LLMEngine, SamplingParams
from engine.models.tiny import build_tiny_model

PROMPT = "Emoji 🚀 and Zürich, then more"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("resume") / "model", arch="llama", seed=3)
    eng = LLMEngine(model=str(path), device="cpu", max_num_seqs=4, seed=0)
    yield eng
    eng.shutdown()


def run(engine, rid, params, resume=None, final_only=False):
    """Drive one request to its end: (final output, deltas of every output, tokens sampled)."""
    before = engine.get_stats()
    engine.add_request(rid, PROMPT, params, resume_token_ids=resume, final_only=final_only)
    final, deltas = None, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            deltas.append((len(c.token_ids) - len(c.delta_token_ids), c.delta_token_ids, c.delta_text))
            final = out
    after = engine.get_stats()
    return final, deltas, after.num_generation_tokens - before.num_generation_tokens, \
        after.num_prompt_tokens - before.num_prompt_tokens


@pytest.mark.parametrize("sampling", [
    dict(temperature=0.0, max_tokens=24, ignore_eos=True),
    dict(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True),
    dict(temperature=0.8, top_p=0.9, seed=5, max_tokens=24, stop=["zz", "q"], min_tokens=12),
], ids=["greedy", "seeded", "seeded-stops"])
def test_a_resumed_request_ends_as_the_uninterrupted_one(engine, sampling):
    params = SamplingParams(**sampling)
    whole, whole_deltas, _, _ = run(engine, "whole", params)
    out = whole.outputs[0]
    for cut in (1, 7, len(out.token_ids) - 1):
        resumed, deltas, sampled, prefilled = run(engine, f"resumed-{cut}", params, resume=out.token_ids[:cut])
        got = resumed.outputs[0]
        assert got.token_ids == out.token_ids and got.text == out.text
        assert (got.finish_reason, got.stop_reason) == (out.finish_reason, out.stop_reason)
        assert sampled == len(out.token_ids) - cut  # only the missing tokens are generated
        # the deltas continue at the cut: the uninterrupted stream's text up to the cut, then these
        assert deltas[0][0] == cut and sum((d[1] for d in deltas), []) == out.token_ids[cut:]
        streamed_before = "".join(t for offset, _, t in whole_deltas if offset < cut)
        assert streamed_before + "".join(d[2] for d in deltas) == out.text


def test_resumed_tokens_that_already_end_the_request_are_reported_at_the_next_step(engine):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    whole, _, _, _ = run(engine, "short", params)
    resumed, deltas, sampled, _ = run(engine, "short-again", params, resume=whole.outputs[0].token_ids)
    assert resumed.finished and resumed.outputs[0].token_ids == whole.outputs[0].token_ids
    assert resumed.outputs[0].finish_reason == "length" and sampled == 0 and deltas == [(6, [], "")]


def test_output_token_ids_reads_a_final_only_request_in_flight(engine):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine.add_request("peek", PROMPT, params, final_only=True)
    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        ids = engine.output_token_ids("peek")
        if ids is not None:
            seen.append(len(ids[0]))
    assert seen and seen == sorted(seen) and max(seen) < 10 and engine.output_token_ids("peek") is None


def test_bad_resume_token_ids_name_the_problem(engine):
    with pytest.raises(ValueError, match="n = 2"):
        engine.add_request("n2", PROMPT, SamplingParams(n=2), resume_token_ids=[1])
    with pytest.raises(ValueError, match="over max_tokens"):
        engine.add_request("long", PROMPT, SamplingParams(max_tokens=2), resume_token_ids=[1, 2, 3])
    with pytest.raises(ValueError, match="not a token id"):
        engine.add_request("bad", PROMPT, SamplingParams(), resume_token_ids=[-1])
    assert not engine.has_unfinished_requests()
