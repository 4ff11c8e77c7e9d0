"""The offline engine against HF transformers on the same tiny weights (CPU, float32)."""

import random

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.models.tiny import build_tiny_model

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    return {arch: build_tiny_model(tmp_path_factory.mktemp(arch) / "model", arch=arch, seed=3) for arch in ARCHS}


def make_prompts(vocab_size, n=16, seed=0):
    """Mixed lengths; half share a 24-token prefix (three blocks of 8)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab_size) for _ in range(24)]
    prompts = []
    for i in range(n):
        length = rng.randrange(2, 60)
        own = [rng.randrange(3, vocab_size) for _ in range(length)]
        prompts.append(shared + own if i % 2 else own)
    return prompts


def hf_greedy(path, prompts, max_new_tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs, model


@pytest.mark.parametrize("arch,async_scheduling", [(a, False) for a in ARCHS] + [("llama", True), ("qwen3", True)])
def test_greedy_matches_hf_under_pressure(tiny_paths, arch, async_scheduling):
    """Chunked prefill (budget 32), shared prefixes and preemption (30 blocks) at once."""
    path = tiny_paths[arch]
    llm = LLM(str(path), device="cpu", block_size=8, max_num_batched_tokens=32, max_num_seqs=8,
              num_gpu_blocks_override=30, swap_space=0, preemption_mode="recompute",
              async_scheduling=async_scheduling)
    prompts = make_prompts(llm.llm_engine.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    expected, _ = hf_greedy(path, prompts, MAX_TOKENS)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert [o.prompt_token_ids for o in outs] == prompts
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0, "the block budget was meant to force preemption"
    assert stats.prefix_cache_hit_rate > 0 and stats.prefix_cache_hit_tokens > 0
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks


def test_greedy_matches_hf_roomy(tiny_paths):
    path = tiny_paths["llama"]
    llm = LLM(str(path), device="cpu", swap_space=0, enable_prefix_caching=False)
    prompts = make_prompts(llm.llm_engine.vocab_size, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    expected, _ = hf_greedy(path, prompts, MAX_TOKENS)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert llm.llm_engine.get_stats().prefix_cache_hit_tokens == 0  # shared prefixes, caching off


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(tiny_paths, request):
    """Every test on it runs with and without async scheduling."""
    return LLM(str(tiny_paths["llama"]), device="cpu", swap_space=0, block_size=8, async_scheduling=request.param)


def test_async_outputs_lag_one_step_and_penalties_run_in_step(tiny_paths):
    """Async: a step's tokens come out of the next call; a request with penalties makes the
    engine read every token back before the next launch, with the same tokens as sync."""
    engines = {mode: LLM(str(tiny_paths["llama"]), device="cpu", swap_space=0, async_scheduling=mode).llm_engine
               for mode in (False, True)}
    assert engines[True].config.scheduler.async_scheduling and not engines[False].config.scheduler.async_scheduling
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for mode, engine in engines.items():
        engine.add_request("a", [5, 6, 7], greedy)
        first = engine.step()  # prefill, first token sampled
        assert (first == []) is mode
        outs = first + engine.step() + engine.step() + engine.step()
        assert not engine.has_unfinished_requests()
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
    penal = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3,
                           frequency_penalty=0.5)
    runs = {}
    for mode, engine in engines.items():
        engine.add_request("p", [9, 9, 9, 4], penal)
        engine.add_request("g", [3, 1, 4, 1, 5], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if mode:
                    assert engine._inflight is None, "a penalty request must run each step synchronously"
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        runs[mode] = done
    assert runs[True] == runs[False]


def test_logprobs_match_hf_log_softmax(llm, tiny_paths):
    prompt = [5, 17, 99, 23, 42, 7]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_paths["llama"], dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0]
    ref = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]  # (6, V)
    total = 0.0
    for i, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert len(entry) == 3 or len(entry) == 4
        assert entry[tok].logprob == pytest.approx(ref[i, tok].item(), abs=1e-4)
        top = ref[i].topk(3)
        for lp, idx in zip(top.values.tolist(), top.indices.tolist()):
            assert entry[idx].logprob == pytest.approx(lp, abs=1e-4)
        total += ref[i, tok].item()
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-3)


def test_seeded_sampling_same_in_any_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate([[11, 12, 13]], params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=7, ignore_eos=True)
    mixed = llm.generate([[40, 41], [11, 12, 13], [9] * 20], [others, params, others], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    different_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=10, ignore_eos=True)
    assert llm.generate([[11, 12, 13]], different_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n_completions(llm):
    out = llm.generate(["Hello world"], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert all(len(c.token_ids) == 8 for c in out.outputs)


def test_stop_token_ids_and_min_tokens(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    base = llm.generate(["The quick brown"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    stop_id = base[2]
    first = base.index(stop_id)
    out = llm.generate(["The quick brown"], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_id],
                                                           ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_id
    # min_tokens forbids the stop id before 5 tokens exist
    out = llm.generate(["The quick brown"], SamplingParams(temperature=0.0, max_tokens=10, min_tokens=5,
                                                           stop_token_ids=[stop_id], ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert stop_id not in out.token_ids[:4]
    assert len(out.token_ids) >= 5


def test_min_tokens_lets_the_stop_id_end_the_next_token(llm, tiny_paths):
    """min_tokens=k holds a stop id back for k tokens, not k + 1: HF's greedy tokens, cut just
    after the stop id at index k, in a batch beside other requests (async: the previous token
    is still on the device when the next one is sampled)."""
    prompt = [5, 6, 7]
    expected, _ = hf_greedy(tiny_paths["llama"], [prompt], 8)
    expected = expected[0]
    k = next(i for i in range(1, 6) if expected[i] not in expected[:i])
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=k, stop_token_ids=[expected[k]],
                            ignore_eos=True)
    other = SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True, seed=1)
    outs = llm.generate([[40, 41, 42, 43], prompt, [9] * 20], [other, params, other], use_tqdm=False)
    out = outs[1].outputs[0]
    assert out.token_ids == expected[: k + 1]
    assert out.finish_reason == "stop" and out.stop_reason == expected[k]


def test_stop_string_across_tokens_not_in_text(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, skip_special_tokens=False)
    full = llm.generate(["Queues hold"], greedy, use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    pieces = [tok.decode(full.token_ids[: i + 1]) for i in range(len(full.token_ids))]
    # a stop string that starts inside one token's text and ends inside a later one
    boundary = next(i for i in range(2, len(pieces)) if len(pieces[i - 1]) >= 2 and len(pieces[i]) > len(pieces[i - 1]))
    start = len(pieces[boundary - 1]) - 1
    stop = full.text[start : start + 2]
    assert len(stop) == 2
    out = llm.generate(["Queues hold"], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop],
                                                       skip_special_tokens=False), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.find(stop)]
    assert stop not in out.text


def test_streamed_deltas_rebuild_text_with_multibyte(llm, tiny_paths):
    from engine import LLMEngine

    engine = llm.llm_engine
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True)
    engine.add_request("mb", "Emoji 🚀 and Zürich", params)
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].delta_text)
            final = out
    text = final.outputs[0].text
    assert "".join(deltas) == text
    assert text == llm.get_tokenizer().decode(final.outputs[0].token_ids, skip_special_tokens=True)
    assert isinstance(LLMEngine, type)


def test_detokenizer_multibyte_split():
    from engine.core.sequence import Sequence
    from engine.models.tokenizer import Detokenizer

    tok = transformers.AutoTokenizer.from_pretrained(str(build_tiny_model.__module__ and _tok_dir()))
    text = "🚀 Zürich 東京 𝔘"
    ids = tok(text)["input_ids"]
    seq = Sequence("x", 0, [], 0, SamplingParams())
    det = Detokenizer(tok)
    det.start(seq)
    out = ""
    for t in ids:
        seq.token_ids.append(t)
        delta = det.step(seq)
        assert "\ufffd" not in delta
        out += delta
    assert out == text


@pytest.mark.parametrize("native", [True, False])
def test_detokenizer_deltas_equal_a_whole_decode(native):
    """Random ids (byte pieces, specials, split characters): the deltas, joined, equal one
    decode of the output; both the native stream path and the two-decode path."""
    from engine.core.sequence import Sequence
    from engine.models.tokenizer import Detokenizer

    tok = transformers.AutoTokenizer.from_pretrained(_tok_dir())
    rng = random.Random(3)
    prompt = tok("Grüße aus 東京:")["input_ids"]
    for trial in range(20):
        skip = trial % 2 == 0
        det = Detokenizer(tok)
        if not native:
            det._backend = None
        assert (det._backend is not None) == native
        seq = Sequence("x", 0, list(prompt), len(prompt), SamplingParams(skip_special_tokens=skip))
        det.start(seq)
        out = ""
        for _ in range(30):
            seq.token_ids.append(rng.randrange(len(tok)))
            out += det.step(seq)
        whole = tok.decode(seq.output_token_ids, skip_special_tokens=skip)
        # held-back text (an unfinished character at the end) is the only difference allowed
        assert whole.startswith(out) and set(whole[len(out):]) <= {"\ufffd"}, (trial, out, whole)


def _tok_dir():
    import tempfile

    from engine.models.tiny import build_tokenizer

    d = tempfile.mkdtemp()
    build_tokenizer(d)
    return d


def test_chat_renders_template(llm):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    expected = tok(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"]
    assert out.prompt_token_ids == expected


def test_chat_renders_tools_and_a_tool_calls_arguments_as_an_object(llm):
    """vLLM's LLM.chat(tools=...): the template gets the tools, and a tool call's arguments, given
    as OpenAI's JSON string, as an object (so a template's tojson writes JSON, not a quoted string)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "20 C"}]
    out = llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False, tools=tools)[0]
    assert "<tools>\nget_weather: Weather now\n</tools>" in out.prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in out.prompt
    with pytest.raises(ValueError, match="tool call's arguments are not valid JSON"):
        llm.chat([{**msgs[1], "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "get_weather", "arguments": "{city"}}]}], use_tqdm=False)


def test_abort_frees_everything(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add_request("keep", [1, 2, 3, 4, 5], params)
    engine.add_request("drop", [6, 7, 8, 9, 10, 11], params)
    engine.step()
    engine.abort_request("drop")
    seen = set()
    while engine.has_unfinished_requests():
        seen.update(o.request_id for o in engine.step())
    assert seen == {"keep"}
    stats = engine.get_stats()
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks


def test_bad_arguments_name_the_field(tiny_paths, llm):
    with pytest.raises(ValueError, match="bogus"):
        LLM(str(tiny_paths["llama"]), bogus=1)
    with pytest.raises(ValueError, match="block_size"):
        LLM(str(tiny_paths["llama"]), block_size=3)
    with pytest.raises(ValueError, match="all_reduce must be one of nccl, symmetric; got 'mpi'"):
        LLM(str(tiny_paths["llama"]), all_reduce="mpi")
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5] * 600], SamplingParams(max_tokens=4), use_tqdm=False)
    # as in vLLM, max_tokens past the context generates to the context's end (512 here)
    long = llm.generate([[5] * 500], SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)[0]
    assert len(long.outputs[0].token_ids) == 12 and long.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([[10**9]], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_refused_prompt_takes_back_the_prompts_before_it(llm):
    """A prompt refused after others of its call were added (too long, a bad token id, a bad
    prompt) leaves none of them in the engine: the next call returns its own outputs alone."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for bad in ([5] * 600, [10**9], {"prompt_token_ids": [3], "bogus": 1}):
        with pytest.raises(ValueError):
            llm.generate([[1, 2, 3], [7, 8], bad], params, use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="max_model_len"):
        llm.chat([[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Hi " * 600}]], params,
                 use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    outs = llm.generate([[4, 5, 6]], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [[4, 5, 6]]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_dtypes_run(tiny_paths, dtype):
    llm = LLM(str(tiny_paths["qwen2"]), device="cpu", dtype=dtype, swap_space=0)
    out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5
