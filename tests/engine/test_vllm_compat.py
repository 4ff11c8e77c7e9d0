"""vLLM's offline surface, row by row: every row of docs/VLLM_COMPAT.md is one test case here,
running the call a vLLM script makes against the engine on a tiny model."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.vllm_args import IGNORED
from tests.engine.vllm_compat_helpers import CHAT, GREEDY, PROMPT, args, doc_rows, greedy_ids, ignored_check, raises, run

@pytest.fixture(scope="module")
def ctx(tiny_model_factory, tmp_path_factory):
    """One tiny engine for the module, and one whose generation_config.json sets sampling defaults."""
    path = tiny_model_factory("llama", seed=1)
    gen_path = tmp_path_factory.mktemp("gen-config") / "model"
    shutil.copytree(path, gen_path)
    config = json.loads((gen_path / "generation_config.json").read_text())
    config.update(temperature=0.0, top_k=20, top_p=0.9, repetition_penalty=1.05, max_new_tokens=7)
    (gen_path / "generation_config.json").write_text(json.dumps(config))
    llm = LLM(str(path), device="cpu", swap_space=0, max_model_len=128)
    gen = LLM(str(gen_path), device="cpu", swap_space=0, max_model_len=128)
    yield SimpleNamespace(llm=llm, gen=gen, path=path, gen_path=gen_path, tok=llm.get_tokenizer())
    llm.shutdown()
    gen.shutdown()


# ----- LLM arguments ---------------------------------------------------------------------
def _llm_defaults(ctx):
    cfg = ctx.llm.llm_engine.config
    assert (cfg.cache.block_size, cfg.cache.enable_prefix_caching, cfg.scheduler.max_num_seqs) == (16, True, 256)


def _seed(ctx):
    """None is the default seed, 0, as vLLM's V1 engine takes it: unseeded draws are the default's."""
    unseeded = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
    draws = []
    for seed in (None, 0):
        with LLM(str(ctx.path), seed=seed, device="cpu", swap_space=0, max_model_len=128) as llm:
            draws.append(llm.generate(PROMPT, unseeded, use_tqdm=False)[0].outputs[0].token_ids)
    assert draws[0] == draws[1]
    raises(lambda: args(ctx, seed="3"), "seed must be an integer or None, got '3'")


LLM_ARGS = {
    "model": lambda c: c.llm.llm_engine.config.model.path == c.path,
    "tokenizer": lambda c: LLM(str(c.path), tokenizer=str(c.path), device="cpu", swap_space=0,
                               max_model_len=32).get_tokenizer() is not None,
    "dtype": lambda c: str(args(c, dtype="float32").dtype) == "float32",
    "quantization": lambda c: (args(c, quantization="fp8"),
                               raises(lambda: args(c, quantization="awq"), "awq.*not supported")),
    "tensor_parallel_size": lambda c: args(c, tensor_parallel_size=2).tensor_parallel_size == 2,
    "seed": lambda c: _seed(c),
    "gpu_memory_utilization": lambda c: raises(lambda: args(c, gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    "swap_space": lambda c: args(c, swap_space=2).swap_space == 2,
    "max_num_seqs": lambda c: args(c, max_num_seqs=8).scheduler_config(64).max_num_seqs == 8,
    "max_num_batched_tokens": lambda c: args(c, max_num_batched_tokens=512).scheduler_config(64).max_num_batched_tokens == 512,
    "max_model_len": lambda c: c.llm.llm_engine.max_model_len == 128,
    "block_size": lambda c: _llm_defaults(c),
    "enable_prefix_caching": lambda c: args(c, enable_prefix_caching=False).cache_config().enable_prefix_caching is False,
    "enforce_eager": lambda c: args(c, enforce_eager=True).enforce_eager,
    "kv_cache_dtype": lambda c: args(c, kv_cache_dtype="fp8").cache_config().kv_cache_dtype == "fp8",
    "revision": lambda c: args(c, revision="main").revision == "main",
    "load_format": lambda c: raises(lambda: args(c, load_format="gguf"), "load_format"),
    "device": lambda c: c.llm.llm_engine.config.model.device.type == "cpu",
    "max_logprobs": lambda c: raises(
        lambda: LLM(str(c.path), device="cpu", swap_space=0, max_model_len=32, max_logprobs=1).generate(
            "Hi", SamplingParams(logprobs=2), use_tqdm=False), "exceeds max_logprobs"),
    "generation_config": lambda c: LLM(str(c.gen_path), device="cpu", swap_space=0, max_model_len=32,
                                       generation_config="vllm").get_default_sampling_params() == SamplingParams(),
    "override_generation_config": lambda c: LLM(
        str(c.gen_path), device="cpu", swap_space=0, max_model_len=32,
        override_generation_config={"temperature": 0.5}).get_default_sampling_params().temperature == 0.5,
    "unknown names": lambda c: raises(lambda: args(c, no_such_flag=1), "unknown engine argument.*no_such_flag.*known:"),
}
LLM_ARGS.update({name: ignored_check(name) for name in IGNORED})
LLM_ARGS["scheduling_policy"] = lambda c: (
    raises(lambda: args(c, scheduling_policy="lifo"), "scheduling_policy must be one of"),
    args(c).scheduler_config(64).scheduling_policy == "priority",
    args(c, scheduling_policy="fcfs").scheduler_config(64).scheduling_policy == "fcfs")[1:] == (True, True)
LLM_ARGS["enable_lora"] = lambda c: (args(c, enable_lora=False),
                                     raises(lambda: args(c, enable_lora=True), "enable_lora=True is not supported"))


# ----- generate / chat arguments ---------------------------------------------------------
def _prompts(c):
    ids = c.tok("Hello")["input_ids"]
    outs = c.llm.generate(["Hello", {"prompt": "Hello"}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert [o.request_id for o in outs] == [str(int(outs[0].request_id) + i) for i in range(3)]


def _params_list(c):
    outs = c.llm.generate(["a", "b"], [SamplingParams(max_tokens=2, ignore_eos=True),
                                       SamplingParams(max_tokens=3, ignore_eos=True)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 3]


def _tqdm_factory(c):
    made = []

    def factory(**kw):
        from tqdm import tqdm
        made.append(kw)
        return tqdm(disable=True, **kw)
    c.llm.generate("Hi", GREEDY, use_tqdm=factory)
    assert made and made[0]["total"] == 1


def _render(c, **kw) -> str:
    return c.llm.chat(CHAT, GREEDY, use_tqdm=False, **kw)[0].prompt


GENERATE_ARGS = {
    "prompts": _prompts,
    "sampling_params": _params_list,
    "use_tqdm": _tqdm_factory,
    "lora_request": lambda c: (c.llm.generate("Hi", GREEDY, use_tqdm=False, lora_request=None),
                               raises(lambda: c.llm.generate("Hi", GREEDY, lora_request=object()), "lora_request")),
    "priority": lambda c: len(c.llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=[1, 0])) == 2,
}
CHAT_ARGS = {
    "messages": lambda c: c.llm.chat([CHAT, [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]],
                                     GREEDY, use_tqdm=False)[1].prompt == _render(c),
    "sampling_params": lambda c: len(c.llm.chat(CHAT, SamplingParams(max_tokens=3, ignore_eos=True),
                                                use_tqdm=False)[0].outputs[0].token_ids) == 3,
    "use_tqdm": lambda c: c.llm.chat(CHAT, GREEDY, use_tqdm=False),
    "lora_request": lambda c: raises(lambda: c.llm.chat(CHAT, GREEDY, lora_request=object()), "lora_request"),
    "chat_template": lambda c: _render(c, chat_template="{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    == "[Hello]",
    "chat_template_content_format": lambda c: (
        _render(c, chat_template_content_format="string"),
        raises(lambda: _render(c, chat_template_content_format="openai"), "chat_template_content_format")),
    "add_generation_prompt": lambda c: not _render(c, add_generation_prompt=False).endswith("assistant\n"),
    "continue_final_message": lambda c: c.llm.chat(
        CHAT + [{"role": "assistant", "content": "Paris is"}], GREEDY, use_tqdm=False, add_generation_prompt=False,
        continue_final_message=True)[0].prompt.endswith("Paris is"),
    "tools": lambda c: "get_time" in _render(
        c, tools=[{"type": "function", "function": {"name": "get_time", "parameters": {}}}],
        chat_template="{{ tools[0]['function']['name'] }}{% for m in messages %}{{ m['content'] }}{% endfor %}"),
    "chat_template_kwargs": lambda c: _render(
        c, chat_template="{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
        chat_template_kwargs={"greeting": "Hey "}) == "Hey Hello",
    "mm_processor_kwargs": lambda c: raises(lambda: _render(c, mm_processor_kwargs={"x": 1}), "mm_processor_kwargs"),
}


# ----- LLM methods -----------------------------------------------------------------------
def _default_params(c):
    p = c.gen.get_default_sampling_params()
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.max_tokens) == (0.0, 20, 0.9, 1.05, 7)
    out = c.gen.generate("Hello", use_tqdm=False)[0].outputs[0]  # no params: the model's defaults
    assert len(out.token_ids) == 7 or out.finish_reason == "stop"
    assert c.llm.get_default_sampling_params() == SamplingParams()


def _missing(name: str):
    return lambda c: not hasattr(c.llm, name)


METHODS = {
    "generate": lambda c: isinstance(c.llm.generate("Hi", GREEDY, use_tqdm=False)[0], RequestOutput),
    "chat": lambda c: isinstance(c.llm.chat(CHAT, GREEDY, use_tqdm=False)[0], RequestOutput),
    "get_tokenizer": lambda c: c.llm.get_tokenizer().decode(c.tok("Hello")["input_ids"]) == "Hello",
    "get_default_sampling_params": _default_params,
    "llm_engine": lambda c: c.llm.llm_engine.has_unfinished_requests() is False,
}
METHODS.update({name: _missing(name) for name in (
    "set_tokenizer", "encode", "embed", "classify", "score", "reward", "beam_search", "start_profile",
    "stop_profile", "reset_prefix_cache", "sleep", "wake_up", "get_metrics", "collective_rpc", "apply_model")})


# ----- SamplingParams fields -------------------------------------------------------------
def _stop_token(c):
    ids = greedy_ids(c)
    at = 3
    while ids[at] in ids[:at]:
        at += 1
    out = run(c, temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=[ids[at]])
    assert out.token_ids == ids[: at + 1] and out.stop_reason == ids[at] and out.finish_reason == "stop"
    assert out.text == c.tok.decode(ids[:at])  # the stopping token's text is left out


def _stop_string(c):
    full = run(c, temperature=0.0, max_tokens=8, ignore_eos=True).text
    stop = full[3:5]
    cut = run(c, temperature=0.0, max_tokens=8, ignore_eos=True, stop=[stop])
    assert cut.text == full[: full.index(stop)] and cut.stop_reason == stop


def _include_stop(c):
    ids = greedy_ids(c)
    full = c.tok.decode(ids)
    stop = full[3:5]
    kept = run(c, temperature=0.0, max_tokens=8, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == full[: full.index(stop) + len(stop)]
    at = next(i for i in range(3, 8) if ids[i] not in ids[:i])
    token = run(c, temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=[ids[at]],
                include_stop_str_in_output=True)
    assert token.text == c.tok.decode(ids[: at + 1])


def _bad_words(c):
    ids = greedy_ids(c)
    word = c.tok.decode(ids[2:3]).strip()
    assert word, "the test needs a token with visible text"
    out = run(c, temperature=0.0, max_tokens=8, ignore_eos=True, bad_words=[word])
    assert out.token_ids[:2] == ids[:2] and out.token_ids[2] != ids[2]
    assert word not in out.text


def _logit_bias(c):
    ids = greedy_ids(c, n=2)
    target = next(t for t in range(10, 50) if t != ids[0])
    out = run(c, temperature=0.0, max_tokens=2, ignore_eos=True, logit_bias={target: 100.0})
    assert out.token_ids == [target, target]


def _allowed(c):
    out = run(c, temperature=1.0, max_tokens=8, ignore_eos=True, allowed_token_ids=[11, 12], seed=0)
    assert set(out.token_ids) <= {11, 12}
    raises(lambda: run(c, allowed_token_ids=[10**6]), r"allowed_token_ids: 1000000 is not a token id in \[0, 384\)")


def _truncate(c):
    prompt = c.tok("The quick brown fox jumps over the lazy dog.")["input_ids"]
    out = c.llm.generate([prompt], SamplingParams(max_tokens=1, truncate_prompt_tokens=4), use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt[-4:]


def _logprobs(c):
    out = run(c, temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2)
    for token, step in zip(out.token_ids, out.logprobs):
        chosen = step[token]
        assert isinstance(chosen, Logprob) and chosen.rank == 1
        assert chosen.decoded_token == c.tok.decode([token])
        assert sorted(lp.rank for lp in step.values()) == [1, 2]
    sampled = run(c, temperature=5.0, max_tokens=12, ignore_eos=True, logprobs=0, seed=4)
    ranks = [step[t].rank for t, step in zip(sampled.token_ids, sampled.logprobs)]
    assert max(ranks) > 1, "a hot draw picks tokens other than the best; their rank says how far"


def _max_tokens(c):
    to_end = run(c, temperature=0.0, max_tokens=None, ignore_eos=True)
    prompt = len(c.tok(PROMPT)["input_ids"])
    assert len(to_end.token_ids) == 128 - prompt and to_end.finish_reason == "length"
    assert run(c, temperature=0.0, max_tokens=10_000, ignore_eos=True).token_ids == to_end.token_ids


def _n(c):
    out = c.llm.generate("Hi", SamplingParams(n=3, max_tokens=3, seed=1), use_tqdm=False)[0].outputs
    assert [o.index for o in out] == [0, 1, 2]


def _greedy_is_argmax(c):
    out = run(c, temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    assert [s[t].rank for t, s in zip(out.token_ids, out.logprobs)] == [1] * 6


def _penalty(name, value):
    return lambda c: run(c, temperature=0.0, max_tokens=12, ignore_eos=True, **{name: value}).token_ids \
        != greedy_ids(c, n=12)


def _unsupported_field(name, value):
    def check(c):
        with pytest.raises(TypeError, match=name):
            SamplingParams(**{name: value})
        raises(lambda: SamplingParams.from_dict({name: value}), f"unknown sampling field.*{name}")
    return check


SAMPLING = {
    "n": _n,
    "temperature": _greedy_is_argmax,
    "top_p": lambda c: run(c, temperature=1.0, top_p=1e-6, max_tokens=4, ignore_eos=True, seed=5).token_ids
    == greedy_ids(c, n=4),
    "top_k": lambda c: run(c, temperature=1.0, top_k=1, max_tokens=4, ignore_eos=True, seed=5).token_ids
    == greedy_ids(c, n=4),
    "min_p": lambda c: run(c, temperature=1.0, min_p=1.0, max_tokens=4, ignore_eos=True, seed=5).token_ids
    == greedy_ids(c, n=4),
    "presence_penalty": _penalty("presence_penalty", 2.0),
    "frequency_penalty": _penalty("frequency_penalty", 2.0),
    "repetition_penalty": _penalty("repetition_penalty", 3.0),
    "seed": lambda c: run(c, temperature=1.0, max_tokens=6, seed=9).token_ids
    == run(c, temperature=1.0, max_tokens=6, seed=9).token_ids,
    "stop": _stop_string,
    "stop_token_ids": _stop_token,
    "include_stop_str_in_output": _include_stop,
    "bad_words": _bad_words,
    "ignore_eos": lambda c: len(run(c, max_tokens=20, ignore_eos=True, seed=0).token_ids) == 20,
    "max_tokens": _max_tokens,
    "min_tokens": lambda c: len(run(c, temperature=0.0, max_tokens=9, min_tokens=9, stop_token_ids=list(range(300)))
                                .token_ids) == 9,
    "logprobs": _logprobs,
    "prompt_logprobs": lambda c: (lambda o: o.prompt_logprobs[0] is None
                                  and len(o.prompt_logprobs) == len(o.prompt_token_ids)
                                  and all(t in d and len(d) >= 1 for t, d in zip(o.prompt_token_ids[1:],
                                                                                o.prompt_logprobs[1:])))(
        c.llm.generate(PROMPT, SamplingParams(prompt_logprobs=1, max_tokens=1), use_tqdm=False)[0]),
    "detokenize": lambda c: run(c, temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False).text == "",
    "skip_special_tokens": lambda c: "<|im_end|>" in run(
        c, temperature=0.0, max_tokens=3, ignore_eos=True, skip_special_tokens=False,
        logit_bias={c.tok.convert_tokens_to_ids("<|im_end|>"): 100.0}).text,
    "spaces_between_special_tokens": lambda c: run(c, temperature=0.0, max_tokens=4, ignore_eos=True,
                                                   spaces_between_special_tokens=False).text
    == run(c, temperature=0.0, max_tokens=4, ignore_eos=True).text,
    "logit_bias": _logit_bias,
    "allowed_token_ids": _allowed,
    "truncate_prompt_tokens": _truncate,
    "extra_args": lambda c: SamplingParams(extra_args={"k": 1}).extra_args == {"k": 1},
    "logits_processors": _unsupported_field("logits_processors", []),
    "output_kind": _unsupported_field("output_kind", 0),
    "structured_outputs": lambda c: run(c, temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(
        choice=["yes", "no"])).text in ("yes", "no"),
    "guided_decoding": _unsupported_field("guided_decoding", {}),
    "best_of": _unsupported_field("best_of", 2),
}


# ----- outputs ---------------------------------------------------------------------------
def _out(c) -> RequestOutput:
    return c.llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1),
                          use_tqdm=False)[0]


REQUEST_OUTPUT = {
    "request_id": lambda c: _out(c).request_id.isdigit(),
    "prompt": lambda c: _out(c).prompt == PROMPT,
    "prompt_token_ids": lambda c: _out(c).prompt_token_ids == c.tok(PROMPT)["input_ids"],
    "prompt_logprobs": lambda c: _out(c).prompt_logprobs is None,
    "outputs": lambda c: isinstance(_out(c).outputs[0], CompletionOutput),
    "finished": lambda c: _out(c).finished is True,
    "metrics": lambda c: (lambda m: m.finished_time >= m.first_token_time >= m.arrival_time)(_out(c).metrics),
    "lora_request": lambda c: _out(c).lora_request is None,
    "num_cached_tokens": lambda c: _out(c).num_cached_tokens >= 0,
    "encoder_prompt": lambda c: not hasattr(_out(c), "encoder_prompt"),
    "encoder_prompt_token_ids": lambda c: not hasattr(_out(c), "encoder_prompt_token_ids"),
    "multi_modal_placeholders": lambda c: not hasattr(_out(c), "multi_modal_placeholders"),
    "kv_transfer_params": lambda c: not hasattr(_out(c), "kv_transfer_params"),
}
COMPLETION_OUTPUT = {
    "index": lambda c: _out(c).outputs[0].index == 0,
    "text": lambda c: _out(c).outputs[0].text == c.tok.decode(_out(c).outputs[0].token_ids),
    "token_ids": lambda c: len(_out(c).outputs[0].token_ids) == 4,
    "cumulative_logprob": lambda c: _out(c).outputs[0].cumulative_logprob == pytest.approx(
        sum(s[t].logprob for t, s in zip(_out(c).outputs[0].token_ids, _out(c).outputs[0].logprobs)), abs=1e-4),
    "logprobs": lambda c: all(isinstance(v, Logprob) for s in _out(c).outputs[0].logprobs for v in s.values()),
    "finish_reason": lambda c: _out(c).outputs[0].finish_reason == "length",
    "stop_reason": lambda c: _out(c).outputs[0].stop_reason is None,
    "lora_request": lambda c: _out(c).outputs[0].lora_request is None,
    "finished()": lambda c: _out(c).outputs[0].finished() is True,
}
LOGPROB = {
    "logprob": lambda c: all(v.logprob <= 0 for s in _out(c).outputs[0].logprobs for v in s.values()),
    "rank": lambda c: all(v.rank >= 1 for s in _out(c).outputs[0].logprobs for v in s.values()),
    "decoded_token": lambda c: all(isinstance(v.decoded_token, str) for s in _out(c).outputs[0].logprobs
                                   for v in s.values()),
    "token_bytes": lambda c: all(isinstance(v.token_bytes, bytes) and v.token_bytes
                                 for s in _out(c).outputs[0].logprobs for v in s.values()),
}

CHECKS = {
    "LLM arguments": LLM_ARGS,
    "generate arguments": GENERATE_ARGS,
    "chat arguments": CHAT_ARGS,
    "LLM methods": METHODS,
    "SamplingParams fields": SAMPLING,
    "RequestOutput fields": REQUEST_OUTPUT,
    "CompletionOutput fields": COMPLETION_OUTPUT,
    "Logprob fields": LOGPROB,
}


def test_every_row_has_a_check_and_every_check_a_row():
    rows = {(section, name) for section, name, _ in doc_rows()}
    checks = {(section, name) for section, table in CHECKS.items() for name in table}
    assert rows - checks == set(), "rows without a check"
    assert checks - rows == set(), "checks without a row"


@pytest.mark.parametrize("section,name,status", doc_rows(), ids=lambda v: str(v))
def test_row(ctx, section, name, status):
    result = CHECKS[section][name](ctx)
    assert result is not False, f"{section} / {name} ({status}) does not behave as the table says"


def test_an_ignored_argument_is_logged_once_per_process(ctx, caplog):
    from engine import vllm_args

    vllm_args._logged.discard("served_model_name")  # an earlier row may have logged it already
    with caplog.at_level("WARNING", logger="engine.config"):
        args(ctx, served_model_name="a")
        args(ctx, served_model_name="b")
    found = [r.getMessage() for r in caplog.records if "served_model_name" in r.getMessage()]
    assert len(found) == 1 and "accepted and ignored" in found[0]
