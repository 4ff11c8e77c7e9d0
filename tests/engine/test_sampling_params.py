import json
import sys
import subprocess

import pytest

from engine.sampling_params import SamplingParams


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("max_tokens", 0), ("n", 0), ("top_k", -2),
    ("min_p", 1.5), ("presence_penalty", 3.0), ("repetition_penalty", 0.0), ("logprobs", 21),
    ("seed", -2), ("seed", -1.0), ("stop", [""]), ("min_tokens", 100), ("temperature", float("nan")),
    ("max_tokens", "5"), ("allowed_token_ids", 5), ("allowed_token_ids", "12"), ("allowed_token_ids", {1: 2}),
    ("bad_words", 5), ("bad_words", {"word": 1}),
])
def test_out_of_range_raises_naming_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_a_temperature_below_vllms_floor_is_raised_to_it(monkeypatch, caplog):
    """Positive temperatures below 0.01 are taken as 0.01 (vLLM's SamplingParams does the same;
    at 1e-38, logits / T overflowed to inf); 0 stays greedy. The change is logged once."""
    from engine import sampling_params

    monkeypatch.setattr(sampling_params, "_logged", set())
    with caplog.at_level("WARNING", logger="engine.sampling_params"):
        assert [SamplingParams(temperature=t).temperature for t in (1e-38, 1e-6, 0.005)] == [0.01] * 3
    assert [SamplingParams(temperature=t).temperature for t in (0, 0.0, 0.01, 0.7)] == [0, 0.0, 0.01, 0.7]
    assert len([r for r in caplog.records if "temperature" in r.getMessage()]) == 1


def test_seed_minus_one_means_no_seed_as_in_vllm():
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams.from_dict({"seed": -1}).to_dict()["seed"] is None
    assert SamplingParams(seed=0).seed == 0
    with pytest.raises(ValueError, match=r"^seed must be -1 \(no seed\) or an integer >= 0, got -2$"):
        SamplingParams(seed=-2)


def test_json_round_trip():
    p = SamplingParams(n=2, temperature=0.5, top_p=0.9, top_k=20, stop="END", stop_token_ids=[3], seed=1,
                       max_tokens=50, min_tokens=2, logprobs=2)
    again = SamplingParams.from_dict(json.loads(json.dumps(p.to_dict())))
    assert again == p and again.stop == ["END"]


def test_unknown_field():
    with pytest.raises(ValueError, match="wibble"):
        SamplingParams.from_dict({"wibble": 1})


def test_torch_free():
    code = "import sys, engine.sampling_params, engine.outputs; import engine; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr
