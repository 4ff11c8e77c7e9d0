"""The helpers of test_vllm_compat: the compatibility page's rows and the calls the checks make."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine import EngineArgs, SamplingParams
from engine.outputs import CompletionOutput
from engine.vllm_args import IGNORED

DOC = Path(__file__).resolve().parents[2] / "docs" / "VLLM_COMPAT.md"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
CHAT = [{"role": "user", "content": "Hello"}]
PROMPT = "Queues hold"  # on this tiny model, greedy output is plain ASCII of mostly distinct tokens


def doc_rows() -> list[tuple[str, str, str]]:
    """``(section, name, status)`` of every table row of the compatibility page."""
    rows, section = [], None
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        found = re.match(r"\| `([^`]+)` \| (same|different|not supported) \|", line)
        if found and section:
            rows.append((section, found.group(1), found.group(2)))
    return rows


def run(ctx, prompt=PROMPT, **params) -> CompletionOutput:
    return ctx.llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs[0]


def greedy_ids(ctx, prompt=PROMPT, n=8) -> list[int]:
    return run(ctx, prompt, temperature=0.0, max_tokens=n, ignore_eos=True).token_ids


def args(ctx, **kw) -> EngineArgs:
    return EngineArgs.from_kwargs(str(ctx.path), **kw)


def raises(fn, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fn()


def ignored_check(name: str):
    """A check that an argument vLLM has and we ignore is accepted, and refused where ignoring it would mislead."""
    rule = IGNORED[name]

    def check(ctx):
        value = rule.harmless[0] if rule.harmless is not None else "any-value"
        assert args(ctx, **{name: value}).model == str(ctx.path)
        if rule.harmless is not None:  # a value ignoring would get wrong says so
            raises(lambda: args(ctx, **{name: "something-else"}), f"{name}=.* is not supported")
    return check
