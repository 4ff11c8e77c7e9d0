"""Which tool-call parser reads each served model's auto tool choice (``--tool-call-parser``).

The flag is given once per choice: ``PARSER`` for every model (the default) and ``MODEL=PARSER``
for one model over it, ``MODEL`` being the name the model is served under (its workers'
``--served-model-name``, as ``GET /v1/models`` lists it). So one gateway serves a Qwen model
(``hermes``) beside a Llama one (``llama3_json``). A model without a parser of its own takes
the default; with no default either, its auto tool choice is a 400, as every one is on a
gateway without ``--enable-auto-tool-choice``.

The parser a request gets rides in its job's metadata (``producers.openai_tools``), so the
whole answer, the stream and a batch line's answer all read the calls with the one chosen here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from producers.openai_tools import check_parser
from producers.tool_parsers import PARSERS

SPEC_FORM = "PARSER (every model's) or MODEL=PARSER (one model's)"


@dataclass(frozen=True)
class ModelParsers:
    """The tool-call parser of each model: its own, or the default (None: auto tool choice refused)."""

    default: str | None = None
    by_model: Mapping[str, str] = field(default_factory=dict)  # served model name -> its parser

    def of(self, model: Any) -> str | None:
        """The parser of ``model``, a request body's ``model`` as sent (not yet checked to be a name)."""
        return self.by_model.get(model, self.default) if isinstance(model, str) else self.default

    def of_body(self, body: Any) -> str | None:
        """The parser of the model a request body names."""
        return self.of(body.get("model") if isinstance(body, dict) else None)


NO_PARSERS = ModelParsers()  # auto tool choice off: every auto request a 400


def read_model_parsers(specs: Iterable[str]) -> ModelParsers:
    """``--tool-call-parser`` values as each model's parser; ``ValueError`` names the bad one and
    lists the parsers.

    NOTE: the model is what comes before the last ``=`` (no parser's name has one), so a served
    name that holds an ``=`` still works. A choice given twice the same way is harmless; two
    defaults, or one model given two parsers, is refused: only one of them could hold."""
    default: str | None = None
    by_model: dict[str, str] = {}
    for spec in specs:
        model, _, parser = spec.rpartition("=")
        if "=" in spec and (not model or not parser):
            raise ValueError(f"tool_call_parser: {spec!r} must be {SPEC_FORM}; the parsers are {', '.join(PARSERS)}")
        try:
            check_parser(parser)
        except ValueError as exc:
            where = f"{spec!r}: " if model else ""
            raise ValueError(f"tool_call_parser: {where}{exc}") from None
        if not model:
            if default not in (None, parser):
                raise ValueError(f"tool_call_parser: two default parsers, {default} and {parser}; give one, and"
                                 " MODEL=PARSER for the models that write their calls another way")
            default = parser
        elif by_model.setdefault(model, parser) != parser:
            raise ValueError(f"tool_call_parser: model {model!r} is given two parsers, {by_model[model]} and {parser}")
    return ModelParsers(default, by_model)
