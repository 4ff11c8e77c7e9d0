"""Prompt logprobs and continuation scores against HF transformers' log-softmax (fp32, CPU):
every architecture, under chunked prefill and prefix caching, and at TP=2 with spawned ranks."""

from __future__ import annotations

import functools
import json
import shutil
from types import SimpleNamespace

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.errors import ContextLengthError

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
ATOL = 1e-4
# a 16-token step budget chunks every prompt here; blocks of 4 make the prefix cache matter
CHUNKED = dict(device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=16, max_num_seqs=4)


@functools.lru_cache(maxsize=None)
def _hf(path: str):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logprobs(path, tokens: list[int]) -> torch.Tensor:
    """(L, V): row p is the log-softmax of the logits after tokens[: p + 1]."""
    with torch.inference_mode():
        return torch.log_softmax(_hf(str(path))(torch.tensor([tokens])).logits[0].double(), dim=-1)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def check_prompt_logprobs(out, path, k: int) -> None:
    prompt = out.prompt_token_ids
    ref = hf_logprobs(path, prompt)
    found = out.prompt_logprobs
    assert len(found) == len(prompt) and found[0] is None
    for p in range(1, len(prompt)):
        entry, row = found[p], ref[p - 1]
        own = entry[prompt[p]]
        assert abs(own.logprob - row[prompt[p]].item()) < ATOL, p
        assert own.rank == int((row >= row[prompt[p]]).sum())  # tokens at least as likely, as vLLM counts
        top_values, top_ids = row.topk(k)
        ranked = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank <= k)
        assert [t for _, t, _ in ranked] == top_ids.tolist(), p
        assert max(abs(v - r) for (_, _, v), r in zip(ranked, top_values.tolist())) < ATOL


def check_scores(scores, path, prompt: list[int], candidates: list[list[int]]) -> None:
    assert [s.index for s in scores] == list(range(len(candidates)))
    for score, cand in zip(scores, candidates):
        ref = hf_logprobs(path, prompt + cand)[len(prompt) - 1 : -1]  # (len(cand), V)
        expected = sum(ref[j, t].item() for j, t in enumerate(cand))
        assert abs(score.logprob - expected) < ATOL and score.num_tokens == len(cand) and score.token_ids == cand
        assert score.is_greedy == all(ref[j].argmax().item() == t for j, t in enumerate(cand))


def greedy_tail(path, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf_logprobs(path, ids)[-1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logprobs_and_scores_match_hf(tiny_model_factory, arch):
    """Chunked prefill, a prompt already in the prefix cache, and candidates sharing their prompt."""
    path = tiny_model_factory(arch)
    prompt = tokens(37, seed=1)  # three chunks
    with LLM(str(path), **CHUNKED) as llm:
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)  # now cached
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2, prompt_logprobs=3),
                           use_tqdm=False)[0]
        assert out.num_cached_tokens == 0  # NOTE: the documented cost: the prompt is recomputed for its logits
        check_prompt_logprobs(out, path, k=3)

        stats = llm.llm_engine.block_manager.prefix_stats
        hits_before = stats.hit_tokens
        question = tokens(30, seed=2)
        candidates = [greedy_tail(path, question, 3), tokens(5, seed=3), [prompt[0]]]
        scores = llm.score_continuations({"prompt_token_ids": question}, candidates)
        check_scores(scores, path, question, candidates)
        assert scores[0].is_greedy and not scores[1].is_greedy
        # each candidate found the question's first 28 tokens (7 blocks) in the cache
        assert stats.hit_tokens - hits_before >= len(candidates) * 28


def test_scores_of_several_prompts_and_text_continuations(tiny_model_factory):
    path = tiny_model_factory("llama")
    with LLM(str(path), **CHUNKED) as llm:
        tok = llm.get_tokenizer()
        prompts = ["What is the capital of France?", "The quick brown fox"]
        groups = [[" Paris", " Lyon is", " Kraków"], [" jumps"]]
        found = llm.score_continuations(prompts, groups)
        assert [len(g) for g in found] == [3, 1]
        for prompt, cands, scores in zip(prompts, groups, found):
            ids = tok(prompt)["input_ids"]
            check_scores(scores, path, ids, [tok(c, add_special_tokens=False)["input_ids"] for c in cands])
        with pytest.raises(ValueError, match="continuations.1: must not be empty"):
            llm.score_continuations("a prompt", [" a", []])
        vocab = llm.llm_engine.vocab_size
        for bad in (vocab, -1, True, 2.0):  # past the vocabulary, negative, a bool, a float: each named
            with pytest.raises(ValueError, match=f"continuations.1: {bad!r} is not a token id in \\[0, {vocab}\\)"):
                llm.score_continuations("a prompt", [[5], [7, bad, 9]])
            with pytest.raises(ValueError, match=f"prompt_token_ids: {bad!r} is not a token id"):
                llm.generate({"prompt_token_ids": [3, bad]}, SamplingParams(max_tokens=1))
        with pytest.raises(ValueError, match="prompt_logprobs \\(21\\)|prompt_logprobs must be <= 20"):
            SamplingParams(prompt_logprobs=21)
        # a string where a list of candidates belongs is refused, not scored character by character
        with pytest.raises(ValueError, match="continuations.0: expected a list of candidates .*got str ' yes'"):
            llm.score_continuations(prompts, [" yes", " no"])
        with pytest.raises(ValueError, match="continuations: expected a list of candidates .*got str ' yes'"):
            llm.score_continuations("a prompt", " yes")
        with pytest.raises(ValueError, match="is not a token id"):  # the first prompt's request does not linger
            llm.score_continuations(prompts, [[" yes"], [[vocab]]])
        assert not llm.llm_engine.has_unfinished_requests()


def test_tied_logits_share_the_worse_rank_and_greedy_decoding_takes_the_first():
    """Continuations " 2" and " 5" of a prompt whose logits tie them for the top, and a prompt
    logprob tied behind the top: a rank counts the tokens at least as likely, as vLLM's does
    (both tied are rank 2), and only the first argmax, 2, is greedy."""
    from engine.core.scheduler_output import ScheduledSeq, SchedulerOutput
    from engine.core.sequence import Request, Sequence
    from engine.outputs import RequestMetrics
    from engine.runner.prompt_logprobs import PromptLogprobs
    from engine.scoring import SCORING_PARAMS, continuation_scores, scoring_sequences

    row = torch.full((12,), -4.0)
    row[2] = row[5] = 3.0
    seqs, gate = scoring_sequences("s", [1, 3], [[2], [5]], 0, 0, block_size=4, prefix_caching=False)
    asked = Sequence("p", 0, [1, 3, 2, 5], 4, SamplingParams(prompt_logprobs=2), prompt_logprobs_from=1)
    behind = row.clone()
    behind[9] = 5.0  # 2 and 5 tie at the second place of asked's top 2, at the last prompt token
    logits = torch.stack([row, row, row, row, behind])  # s's two rows, then asked's three
    scheduled = SchedulerOutput([ScheduledSeq.of(seq, seq.num_tokens) for seq in [*seqs, asked]])
    PromptLogprobs.launch(scheduled, logits).collect(SimpleNamespace(name_tokens=lambda entry: None))

    scores = continuation_scores(Request("s", None, [1, 3], SCORING_PARAMS, seqs, RequestMetrics(0.0)))
    assert [s.is_greedy for s in scores] == [True, False]
    assert [seq.prompt_logprobs[0][t].rank for seq, t in zip(seqs, (2, 5))] == [2, 2]
    first, _, last = asked.prompt_logprobs
    assert {t: lp.rank for t, lp in first.items()} == {3: 12, 2: 2, 5: 2}
    assert {t: lp.rank for t, lp in last.items()} in ({5: 3, 9: 1, 2: 3}, {5: 3, 9: 1})  # 2 or 5 in the top 2


def sentencepiece_style_model(tiny_model_factory, folder) -> str:
    """The tiny llama's weights beside a tokenizer that marks the start of every text it encodes
    with "▁" (the dummy prefix of Llama 2's and Mistral's SentencePiece tokenizers; transformers'
    ``LlamaTokenizer``), trained here on a few sentences."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    shutil.copytree(tiny_model_factory("llama"), folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).unlink(missing_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    special = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    corpus = ["The capital of France is Paris. Lyon is a city in France.", "Is the answer right? Verdict: Yes.",
              "Verdict: No. Yes, it is right. No, it is wrong."]
    tok.train_from_iterator(corpus * 8, trainers.BpeTrainer(vocab_size=384, special_tokens=special,
                                                            show_progress=False))
    bpe = json.loads(tok.to_str())["model"]
    transformers.LlamaTokenizer(vocab=bpe["vocab"], merges=[tuple(m) for m in bpe["merges"]]).save_pretrained(folder)
    return str(folder)


def test_text_continuations_are_tokenized_as_they_follow_the_prompt(tiny_model_factory, tmp_path):
    """With a tokenizer that marks a text's start, "Yes" alone is "▁Yes" but after "Verdict:\\n"
    it has no "▁": each text candidate scores the tokens the prompt and it make together, as HF
    transformers scores them (a leading space kept, a duplicate and a shared first token too)."""
    path = sentencepiece_style_model(tiny_model_factory, tmp_path / "sp")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    groups = {"Is the answer right? Verdict:\n": ["Yes", "No", "Yes, it is right.", "Yes"],
              "The capital of France is": [" Paris", " Lyon", " Paris is"]}
    with LLM(path, **CHUNKED) as llm:
        found = llm.score_continuations(list(groups), list(groups.values()))
    for (prompt, cands), scores in zip(groups.items(), found):
        head = tok(prompt)["input_ids"]
        tails = []
        for cand in cands:
            whole = tok(prompt + cand)["input_ids"]
            assert whole[: len(head)] == head
            tails.append(whole[len(head):])
        assert [s.token_ids for s in scores] == tails
        check_scores(scores, path, head, tails)
    assert tok("Yes", add_special_tokens=False)["input_ids"] != found[0][0].token_ids  # alone it is "▁Yes"


def test_a_continuation_may_fill_the_context(tiny_model_factory):
    """The token a scoring sequence samples past its end is dropped, so prompt + continuation may be
    max_model_len tokens (HF scores them); one more names the continuation and the limit."""
    path = tiny_model_factory("llama")
    prompt, candidates = tokens(30, seed=8), [tokens(18, seed=9), tokens(3, seed=10)]
    with LLM(str(path), max_model_len=48, **CHUNKED) as llm:
        check_scores(llm.score_continuations({"prompt_token_ids": prompt}, candidates), path, prompt, candidates)
        with pytest.raises(ContextLengthError, match="continuations.1: the prompt \\(30 tokens\\) and this"
                                                     " continuation \\(19\\) are 49 tokens; the model's context"
                                                     " \\(max_model_len\\) is 48"):
            llm.score_continuations({"prompt_token_ids": prompt}, [[5], tokens(19, seed=11)])
        with pytest.raises(ContextLengthError, match="prompt is 48 tokens long"):
            llm.score_continuations({"prompt_token_ids": tokens(48, seed=12)}, [[5]])


def test_tensor_parallel_prompt_logprobs_and_scores(tiny_model_factory):
    """TP=2 over spawned gloo ranks: each rank holds half the vocabulary, rank 0 reduces."""
    path = tiny_model_factory("qwen2", seed=3)
    prompt, question = tokens(29, seed=4), tokens(22, seed=5)
    candidates = [tokens(3, seed=6), greedy_tail(path, question, 2)]
    with LLM(str(path), tensor_parallel_size=2, **CHUNKED) as llm:
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=2),
                           use_tqdm=False)[0]
        scores = llm.score_continuations({"prompt_token_ids": question}, candidates)
    check_prompt_logprobs(out, path, k=2)
    check_scores(scores, path, question, candidates)


def test_one_token_jobs_sharing_a_prefix_compute_it_once_and_run_together(tiny_model_factory):
    """Jobs ending at their first token publish their prompt blocks, so the ones waiting on
    the shared prefix find it (and are not admitted one per step)."""
    from engine import LLMEngine

    engine = LLMEngine(model=str(tiny_model_factory("llama")), device="cpu", block_size=4, max_num_seqs=8)
    prefix = tokens(40, seed=7)
    for i in range(8):
        engine.add_request(str(i), prefix + tokens(3, seed=10 + i), SamplingParams(max_tokens=1), final_only=True)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert engine.block_manager.prefix_stats.hit_tokens == 7 * 40
    assert steps <= 5
    engine.shutdown()
