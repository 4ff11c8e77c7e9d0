"""Structured outputs in the benchmarks: ``--structured json-schema`` on ``bench throughput``
and ``bench latency`` runs the workload twice in one call, every request constrained by a
grading JSON schema and then unconstrained, and reports the ratio.

Dummy weights make noise, and a grammar ends an output when it is complete, so ``ignore_eos``
cannot hold lengths fixed. NOTE: the constrained run goes first, with the schema's free
string (``reason``, ``--structured-string-len`` characters at most, half of that at least)
keeping outputs long, capped by the workload's output lengths; the unconstrained run then
generates exactly as many tokens per request as the constrained one did (``ignore_eos``).
Both runs do the same work token for token, so their tokens per second compare directly.

Presets ship no tokenizer and a grammar needs one: a byte-level BPE of the model's vocabulary
size is trained on generated text once and kept (``--structured-tokenizer`` gives another).
"""

from __future__ import annotations

import copy
import logging
import os
import random
import time
from pathlib import Path
from typing import Any, Callable

import click

logger = logging.getLogger(__name__)

_CORPUS_LINES = 60_000


def structured_options(f: Callable) -> Callable:
    options = [
        click.option("--structured", type=click.Choice(["none", "json-schema"]), default="none", show_default=True,
                     help="json-schema: also run every request constrained by a grading JSON schema; report the ratio."),
        click.option("--structured-distinct", type=int, default=1, show_default=True,
                     help="How many different schemas the requests spread over (each compiled once, in the warm-up)."),
        click.option("--structured-string-len", type=int, default=1600, show_default=True,
                     help="Characters of the schema's free string field at most (half of it at least)."),
        click.option("--structured-tokenizer", type=click.Path(file_okay=False), default=None,
                     help="A tokenizer folder; default: a BPE of the model's vocabulary built once and cached."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def grading_schema(i: int, string_len: int) -> dict[str, Any]:
    """The ``i``-th grading schema: a score, a verdict (its third value makes it distinct) and a reason."""
    return {
        "type": "object",
        "properties": {
            "score": {"type": "integer", "minimum": 1, "maximum": 10},
            "verdict": {"enum": ["pass", "fail", f"review-{i}"]},
            "reason": {"type": "string", "minLength": string_len // 2, "maxLength": string_len},
        },
        "required": ["score", "verdict", "reason"],
        "additionalProperties": False,
    }


def constrained_params(output_lens: list[int], distinct: int, string_len: int, offset: int = 0) -> list:
    from engine import SamplingParams, StructuredOutputsParams

    schemas = [grading_schema(offset + i, string_len) for i in range(distinct)]
    return [SamplingParams(temperature=0.0, max_tokens=out,
                           structured_outputs=StructuredOutputsParams(json=copy.deepcopy(schemas[i % distinct])))
            for i, out in enumerate(output_lens)]


def matched_params(output_lens: list[int]) -> list:
    """Unconstrained, exactly these lengths."""
    from engine import SamplingParams

    return [SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True) for out in output_lens]


def check_opts(opts: dict[str, Any]) -> None:
    if opts["structured_distinct"] < 1:
        raise click.BadParameter(f"--structured-distinct must be >= 1, got {opts['structured_distinct']}")
    if opts["structured_string_len"] < 2:
        raise click.BadParameter(f"--structured-string-len must be >= 2, got {opts['structured_string_len']}")


def prepare_tokenizer(opts: dict[str, Any], hf_config: Any) -> None:
    """Put a tokenizer folder in ``opts["tokenizer"]`` for a structured run (none otherwise)."""
    opts["tokenizer"] = None
    if opts["structured"] == "none":
        return
    opts["tokenizer"] = opts["structured_tokenizer"] or bench_tokenizer(hf_config)


def bench_tokenizer(hf_config: Any) -> str:
    """The folder of a tokenizer for a model that ships none (a preset): a byte-level BPE of
    its vocabulary size and end-of-sequence ids, built on first use and cached under
    ``$SLUICEWAY_BENCH_CACHE`` (default ``~/.cache/sluiceway``)."""
    eos = hf_config.eos_token_id
    eos_ids = sorted(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    vocab_size = hf_config.vocab_size
    root = Path(os.environ.get("SLUICEWAY_BENCH_CACHE", Path.home() / ".cache" / "sluiceway"))
    path = root / f"bench-tokenizer-{vocab_size}-eos-{'-'.join(map(str, eos_ids)) or 'none'}"
    if not (path / "tokenizer.json").exists():
        start = time.perf_counter()
        build_tokenizer(path, vocab_size, eos_ids)
        logger.info("bench tokenizer: %d tokens built in %.0f s at %s", vocab_size, time.perf_counter() - start, path)
    return str(path)


def build_tokenizer(path: Path, vocab_size: int, eos_ids: list[int], lines: int | None = None) -> None:
    """A byte-level BPE of exactly ``vocab_size`` tokens, trained on generated words, numbers and
    punctuation (JSON's included), then reserved special tokens up to the size; the model's
    end-of-sequence ids must be among them (a preset's are: Llama 3 keeps its last 256 ids so).

    ``lines`` of generated text; by default half a line per token, between 2,000 and 60,000."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    trained = min([vocab_size - 256] + [i for i in eos_ids if i >= 512])
    if any(i < trained for i in eos_ids) or trained < 512:
        raise click.BadParameter(f"the model's end-of-sequence ids {eos_ids} leave no room for a trained vocabulary "
                                 f"of {vocab_size} tokens; pass --structured-tokenizer")
    # NOTE: the corpus grows with the merges it must feed: 60,000 lines for llama3's 128,256 ids
    # (as before, so a cached tokenizer is the same), a few thousand for a small test vocabulary
    if lines is None:
        lines = max(2_000, min(_CORPUS_LINES, vocab_size // 2))
    rng = random.Random(0)
    syllables = [a + b for a in "bcdfghjklmnprstvwz" for b in ("a", "e", "i", "o", "u", "ai", "ou", "ee")]
    marks = [".", ",", "!", "?", ":", ";", '"', "'", "(", ")", "{", "}", "[", "]", "-", "\n", '":', '",', "0", "1",
             "42", "2024", "3.14", " \"", "\t"]

    def word() -> str:
        w = "".join(rng.choice(syllables) for _ in range(rng.choice((1, 1, 2, 2, 2, 3, 3, 4))))
        return w.capitalize() if rng.random() < 0.1 else w

    corpus = [" ".join(word() if rng.random() < 0.85 else rng.choice(marks) + word()
                       for _ in range(rng.randint(5, 30))) for _ in range(lines)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=trained, special_tokens=[], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, unk_token=None)
    start = len(fast)
    fast.add_special_tokens({"additional_special_tokens": [f"<|reserved_{i}|>" for i in range(start, vocab_size)]})
    if eos_ids:
        fast.eos_token = f"<|reserved_{eos_ids[0]}|>"
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))


def warm_up(llm, output_lens: list[int], prompts: list[list[int]], opts: dict[str, Any]) -> float:
    """Compile the timed run's schemas outside the timing (their seconds are returned), then
    run batches of 1, 16 and 17 constrained rows: the bitmask kernel is compiled per kind of
    batch size (one, a multiple of 16, any other)."""
    engine = llm.llm_engine
    distinct, string_len = opts["structured_distinct"], opts["structured_string_len"]

    def run(count: int, max_tokens: int) -> None:
        for i, p in enumerate(constrained_params([max_tokens] * count, distinct, string_len)):
            engine.add_request(f"warm-structured-{i}", None, p, prompt_token_ids=prompts[i % len(prompts)][:8],
                               final_only=True)
        while engine.has_unfinished_requests():
            engine.step()

    start = time.perf_counter()
    run(distinct, 2)
    compile_s = time.perf_counter() - start
    for count in (1, 16, 17):
        run(count, 4)
    return compile_s


def paired_runs(llm, workload, run: Callable[..., dict[str, Any]], opts: dict[str, Any]) -> dict[str, Any]:
    """The constrained run, then the unconstrained run of the same lengths; both results and the ratio."""
    from bench.run import Workload

    params = constrained_params(workload.output_lens, opts["structured_distinct"], opts["structured_string_len"])
    constrained = run(workload, params)
    lengths = constrained.pop("output_lens")
    finished = constrained.pop("finish_reasons")
    # NOTE: the same prompts again would be served from the prefix cache the constrained run
    # filled; each prompt rotated by one token costs the same to compute and shares no block.
    fresh = [p[1:] + p[:1] for p in workload.prompts]
    plain = run(Workload(fresh, lengths), matched_params(lengths))
    plain.pop("output_lens"), plain.pop("finish_reasons")
    return dict(constrained=constrained, unconstrained=plain,
                constrained_finished_stop=sum(1 for f in finished if f == "stop"),
                ratio=constrained["output_tok_s"] / plain["output_tok_s"])
