"""Structured outputs offline: JSON schemas, regexes, choices and grammars on a tiny random model.

Its text is noise, so every valid output is the constraint's doing (``structured_helpers``).
"""

from __future__ import annotations

import json
import random
import time

import pytest
import torch
import transformers

from engine import LLM, SamplingParams, StructuredOutputsParams
from tests.engine.structured_helpers import (
    FLAG, GRADE, SLOWER_SCHEMA, assert_all_valid, assert_unconstrained_would_fail, choice_valid, distinct_schema,
    json_valid, regex_valid,
)

PROMPTS = ["Grade the following answer", "What is the capital of France?", "Queues hold jobs", "数据 队列"]
MAX_TOKENS = 64


def constrained(schema=None, **kw) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=schema), **kw)


@pytest.fixture(scope="module")
def path(tiny_model_factory):
    return tiny_model_factory("llama", seed=3)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(path, request):
    """Chunked prefill (a 32-token budget) and prefix caching on, with and without async scheduling."""
    llm = LLM(str(path), device="cpu", swap_space=0, block_size=8, max_num_batched_tokens=32, max_num_seqs=16,
              async_scheduling=request.param)
    yield llm
    llm.shutdown()


def test_json_schemas_hold_greedy_sampled_n_seeded_with_logprobs(llm):
    """Greedy, sampled (n = 3, seeded, logprobs) and a stop string, next to an unconstrained row;
    long prompts go through chunked prefill and share a prefix."""
    shared = "Grade the following answer on a scale from one to ten. " * 3
    prompts = PROMPTS + [shared + "Paris.", shared + "Lyon."]
    schemas = [GRADE, FLAG, GRADE, FLAG, GRADE, GRADE]
    params = [constrained(GRADE), constrained(FLAG), constrained(GRADE, temperature=1.0, n=3, seed=7, logprobs=2),
              constrained(FLAG, temperature=0.7, top_p=0.9, seed=1), constrained(GRADE, stop=["zzz"]),
              constrained(GRADE)]
    outs = llm.generate(prompts + ["Hello"], params + [SamplingParams(temperature=0.0, max_tokens=8)], use_tqdm=False)
    checks = [json_valid(s) for s in schemas]
    assert assert_all_valid(outs[:-1], checks) >= 3
    assert len(outs[2].outputs) == 3
    for completion in outs[2].outputs:
        assert len(completion.logprobs) == len(completion.token_ids)
        assert all(len(entry) >= 2 for entry in completion.logprobs)
    assert llm.llm_engine.get_stats().prefix_cache_hit_rate > 0
    again = llm.generate([prompts[2]], params[2], use_tqdm=False)[0]  # a seeded request alone
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in outs[2].outputs]
    free = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)] * 6, use_tqdm=False)
    assert_unconstrained_would_fail(free, checks)


def test_async_scheduling_stays_on_for_constrained_requests(llm):
    """Under async scheduling each call reads back the step the call before launched, constrained
    rows or not (their sampling waits one call, their forward does not)."""
    engine = llm.llm_engine
    records = []
    engine.add_step_observer(records.append)
    try:
        outs = llm.generate(PROMPTS[:2], [constrained(GRADE), constrained(FLAG)], use_tqdm=False)
    finally:
        engine.remove_step_observer(records.append)
    assert_all_valid(outs, [json_valid(GRADE), json_valid(FLAG)])
    lag = 1 if engine.config.scheduler.async_scheduling else 0
    reads = [(r.step, r.resolved) for r in records if r.resolved]
    assert len(reads) > 20 and all(resolved == (step - lag,) for step, resolved in reads), reads[:5]


def test_regex_choice_grammar_and_json_object(llm):
    email = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
    choices = ["pass", "fail", "unsure"]
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    kinds = [dict(regex=email), dict(choice=choices), dict(grammar=grammar), dict(json_object=True)]
    checks = [regex_valid(email), choice_valid(choices), regex_valid(r"\((?:[1-9][0-9]?)(?:\+[1-9][0-9]?)*\)"),
              lambda t: isinstance(_loads(t), dict)]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(**k))
              for k in kinds]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out, check in zip(outs, checks):
        assert_all_valid([out], [check])
    free = llm.generate(PROMPTS, [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)] * 4, use_tqdm=False)
    assert_unconstrained_would_fail(free, checks)


def test_32_distinct_schemas_in_one_batch(path):
    llm = LLM(str(path), device="cpu", swap_space=0, block_size=8, max_num_seqs=32)
    schemas = [distinct_schema(i) for i in range(32)]
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(PROMPTS) for _ in range(2)) for _ in schemas]
    outs = llm.generate(prompts, [constrained(s) for s in schemas], use_tqdm=False)
    assert assert_all_valid(outs, [json_valid(s) for s in schemas]) == 32
    assert len(llm.llm_engine.structured._compiled) == 32
    # each output holds its own schema's constant: none would pass another's schema
    assert not json_valid(schemas[1])(outs[0].outputs[0].text)
    llm.shutdown()


def test_greedy_matches_hf_with_the_same_mask(path, llm):
    """HF transformers' greedy generate with a logits processor applying xgrammar's mask of the
    same grammar (the engine's backend parses the schema) gives the engine's tokens."""
    import xgrammar

    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine = llm.llm_engine
    eos = sorted(engine.eos_token_ids)
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=engine.vocab_size, stop_token_ids=eos)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1)
    for schema in (GRADE, FLAG):
        ours = llm.generate(PROMPTS[:2], constrained(schema), use_tqdm=False)
        grammar = compiler.compile_grammar(engine.structured.backend.parse(StructuredOutputsParams(json=schema)))
        for prompt, out in zip(PROMPTS[:2], ours):
            ids = torch.tensor([tokenizer(prompt)["input_ids"]])
            mask = _XGrammarMask(xgrammar, grammar, ids.shape[1])
            with torch.no_grad():
                gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                     do_sample=False, eos_token_id=eos, pad_token_id=eos[0],
                                     logits_processor=transformers.LogitsProcessorList([mask]))
            assert out.outputs[0].token_ids == gen[0, ids.shape[1]:].tolist()


class _XGrammarMask(transformers.LogitsProcessor):
    def __init__(self, xgrammar, compiled, prompt_len: int) -> None:
        self.xgr, self.matcher, self.prompt_len = xgrammar, xgrammar.GrammarMatcher(compiled), prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.prompt_len:
            assert self.matcher.accept_token(int(input_ids[0, -1]))
        bitmask = self.xgr.allocate_token_bitmask(1, scores.shape[1])
        self.matcher.fill_next_token_bitmask(bitmask, 0)
        self.xgr.apply_token_bitmask_inplace(scores, bitmask)
        return scores


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_constrained_requests_finish_valid(path, mode):
    """Too few blocks for the batch: sequences are preempted mid-output and still finish valid,
    with the tokens of a roomy run."""
    prompts = [p + " " + q for p in PROMPTS for q in PROMPTS[:3]]
    params = [constrained(GRADE if i % 2 else FLAG) for i in range(len(prompts))]
    checks = [json_valid(GRADE if i % 2 else FLAG) for i in range(len(prompts))]
    roomy = LLM(str(path), device="cpu", swap_space=0, block_size=8)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    roomy.shutdown()
    tight = LLM(str(path), device="cpu", block_size=8, max_num_seqs=12, num_gpu_blocks_override=24,
                swap_space=0.01 if mode == "swap" else 0, preemption_mode=mode)
    outs = tight.generate(prompts, params, use_tqdm=False)
    stats = tight.llm_engine.get_stats()
    tight.shutdown()
    assert stats.num_preemptions > 0, "the block budget was meant to force preemption"
    assert (stats.num_swapped_out_blocks > 0) == (mode == "swap")
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_all_valid(outs, checks)


def test_resumed_constrained_request_finishes_as_if_uninterrupted(llm):
    params = constrained(GRADE)
    whole = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    engine = llm.llm_engine
    engine.add_request("resumed", PROMPTS[0], params, resume_token_ids=whole.token_ids[:5])
    final = _run(engine)["resumed"].outputs[0]
    assert final.token_ids == whole.token_ids and final.text == whole.text


@pytest.mark.parametrize("structured,field", [
    (dict(json={"type": "object", "properties": {"a": {"type": "integr"}}}), "structured_outputs.json.properties.a.type"),
    (dict(json={"type": "array", "uniqueItems": True}), "structured_outputs.json.uniqueItems"),
    (dict(json="{not json"), "structured_outputs.json"),
    (dict(json={"type": "string", "pattern": "(("}), "structured_outputs.json"),
    (dict(regex="[a-z"), "structured_outputs.regex"),
    (dict(grammar='root ::= "a" |'), "structured_outputs.grammar"),
    (dict(grammar='start ::= "a"'), "structured_outputs.grammar"),
    (dict(json={"type": "object"}, regex="a+"), "structured_outputs: give exactly one"),
    (dict(choice=[]), "structured_outputs.choice"),
    (dict(json_object=False), "structured_outputs.json_object"),
])
def test_bad_constraints_are_refused_naming_the_field(llm, structured, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        llm.llm_engine.add_request("bad", "Hi", SamplingParams(structured_outputs=structured))
    assert "bad" not in llm.llm_engine.requests
    out = llm.generate(["Hi"], constrained(FLAG), use_tqdm=False)[0]  # the engine goes on
    assert out.outputs[0].finish_reason in ("stop", "length")


def test_slow_grammar_fails_alone_and_holds_nothing_up(path):
    """A grammar that compiles past the time limit fails its request with an error naming the
    field; the other requests run meanwhile (an unconstrained one finishes before it fails) and finish.
    NOTE: a limit of two seconds against a ~4.6 s compile (which a loaded machine slows too): at
    0.25 s against ~1.4 s, a loaded CI runner once took longer than the limit for the unconstrained
    request's five steps, and at 1 s a machine at load 6.8 did."""
    llm = LLM(str(path), device="cpu", swap_space=0, block_size=8, structured_outputs_timeout_s=2.0)
    engine = llm.llm_engine
    assert_all_valid(llm.generate(["warm"], constrained(FLAG), use_tqdm=False), [json_valid(FLAG)])
    engine.add_request("slow", "Hi", constrained(SLOWER_SCHEMA))
    engine.add_request("aborted", "Hi", constrained(SLOWER_SCHEMA))  # waits on the same compile
    engine.add_request("free", "Hi", SamplingParams(temperature=0.0, max_tokens=4))
    engine.add_request("flag", "Hi", constrained(FLAG))
    engine.abort_request("aborted")
    assert engine.structured.num_waiting == 2  # slow, and flag until a step takes it
    done, finished_while_waiting = {}, []
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
                if engine.structured.num_waiting:
                    finished_while_waiting.append(out.request_id)
    assert "free" in finished_while_waiting
    failed = done["slow"]
    assert failed.error.startswith("structured_outputs.json: the grammar did not compile within 2 s")
    assert failed.outputs[0].finish_reason == "abort" and failed.outputs[0].token_ids == []
    assert done["free"].error is None and len(done["free"].outputs[0].token_ids) == 4
    assert_all_valid([done["flag"]], [json_valid(FLAG)])
    assert "aborted" not in done and not engine.structured.num_waiting
    stats = engine.get_stats()
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
    llm.shutdown()


def test_bitmask_reference_agrees_with_the_backend():
    """Our reading of a bitmask (bit t % 32 of word t // 32 allows token t) is xgrammar's."""
    import xgrammar

    from engine.structured.backend import apply_bitmask_ref, bitmask_width

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 100, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, bitmask_width(100)), generator=gen, dtype=torch.int64).int()
    bitmask[1] = -1  # a row that allows everything
    ours, theirs = logits.clone(), logits.clone()
    apply_bitmask_ref(ours, bitmask)
    xgrammar.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=100)
    assert torch.equal(ours, theirs) and torch.equal(ours[1], logits[1])
    assert torch.isinf(ours[0]).any() and not torch.isinf(ours[0]).all()


def test_params_travel_as_json():
    params = constrained({"type": "object"}, max_tokens=5)
    data = json.loads(json.dumps(params.to_dict()))
    assert data["structured_outputs"]["json"] == {"type": "object"}
    again = SamplingParams.from_dict(data)
    assert again.structured_outputs == params.structured_outputs
    assert SamplingParams(structured_outputs={"json": '{"type": "object"}'}).structured_outputs.json == {"type": "object"}
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(structured_outputs={"regex": "a"}, ignore_eos=True)


def _run(engine) -> dict:
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def test_a_constraint_that_sampling_filters_leave_no_token_fails_its_request_alone(llm):
    """A constraint whose allowed_token_ids leave it no token: at the first token (only the
    end-of-sequence token allowed), or midway ("yes" begun and its next token not allowed). The
    request fails with an error naming the field and the position, every sequence of it with it;
    it never ends "stop" as if its answer were complete. The rest run."""
    tokenizer = llm.get_tokenizer()
    eos = tokenizer.eos_token_id
    yes = tokenizer.encode("yes", add_special_tokens=False)
    assert len(yes) > 1  # the tiny tokenizer spells "yes" in pieces: the midway case needs two

    def choice(allowed: list[int]) -> SamplingParams:
        return SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]), max_tokens=8,
                              temperature=0.0, allowed_token_ids=allowed)

    params = [constrained(FLAG, allowed_token_ids=[eos], n=2, temperature=1.0, seed=1), choice([eos]),
              choice(yes[:1] + [eos]), choice(yes + [eos]), SamplingParams(temperature=0.0, max_tokens=6)]
    outs = llm.generate(["Pick one", "Pick", "Say yes", "Say yes", "Hello"], params, use_tqdm=False)
    for out, position in zip(outs[:3], (0, 0, 1)):
        assert out.finished and out.error is not None, out
        assert out.error.startswith(f"sampling.structured_outputs: at output token {position} the constraint"), out.error
        assert {c.finish_reason for c in out.outputs} == {"abort"}
    assert len(outs[0].outputs) == 2
    # every token of "yes" and the end allowed: the choice completes, nothing is refused
    assert outs[3].error is None and outs[3].outputs[0].text == "yes" and outs[3].outputs[0].finish_reason == "stop"
    assert outs[4].error is None and len(outs[4].outputs[0].token_ids) == 6
