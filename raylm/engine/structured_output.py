"""Structured output: a request's GuidedDecodingParams compiled with xgrammar into a token mask per step.

- grammar_of / check_guided: the grammar of a request, parsed without a tokenizer (the driver and the HTTP server
  check a request with it, so a malformed schema is a clear error before it reaches the engine);
- GrammarCompiler: the engine's compiler for its tokenizer; compiles on a thread of its own, never the engine's,
  and keeps each grammar by its text, so requests with the same schema compile once;
- Guide: one sequence's matcher, advanced by each token the sequence accepts; it masks the sequence's next draw
  until the grammar is complete (then only the stop tokens are allowed) and can wait for a marker first (a
  reasoning model's `</think>`: the constraint applies to the answer only).
"""

from __future__ import annotations

import json
import logging
import re

from raylm.sampling_params import GuidedDecodingParams

logger = logging.getLogger(__name__)

_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def _message(exc: Exception) -> str:
    """xgrammar's error without its source location."""
    return _LOG_PREFIX.sub("", str(exc).strip()).strip()


def _choice_ebnf(choices: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def grammar_of(guided: GuidedDecodingParams):
    """The xgrammar Grammar of `guided`; ValueError naming the field and what is wrong with it."""
    import xgrammar as xgr

    kind = guided.kind
    try:
        if kind == "json":
            schema = guided.json if isinstance(guided.json, str) else json.dumps(guided.json)
            return xgr.Grammar.from_json_schema(schema)
        if kind == "json_object":
            return xgr.Grammar.builtin_json_grammar()
        if kind == "regex":
            return xgr.Grammar.from_regex(guided.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(_choice_ebnf(guided.choice))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(guided.grammar)
        if kind == "lark":
            return xgr.Grammar.from_lark(guided.lark)
        tag = guided.structural_tag
        return xgr.Grammar.from_structural_tag(tag if isinstance(tag, str) else json.dumps(tag))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"guided_decoding.{kind} is not valid: {_message(exc)}") from None


def check_guided(guided: GuidedDecodingParams) -> None:
    """Raises ValueError when `guided` does not parse (a malformed JSON schema, regex or grammar)."""
    grammar_of(guided)
