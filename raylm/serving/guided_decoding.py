"""A request's structured output: response_format, the guided_* fields, structural_tag and (chat) a tool_choice
that demands a call, as the one GuidedDecodingParams the engine decodes under.

At most one of them may constrain a request; each is parsed here (xgrammar, without a tokenizer), so a malformed
schema, regex or grammar is a 400 naming the field before the request reaches the engine.
"""

from __future__ import annotations

from typing import Any

from raylm.sampling_params import GuidedDecodingParams
from raylm.serving.errors import bad_request
from raylm.serving.protocol import ResponseFormat, SamplingRequest

# Request fields that constrain the output, and the GuidedDecodingParams field each sets.
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar", "structural_tag": "structural_tag"}

Constraint = tuple[str, dict[str, Any]]  # the request field (as `param`), GuidedDecodingParams keyword arguments


def _format_constraint(response_format: ResponseFormat | None) -> list[Constraint]:
    """What a response_format asks for: nothing for text."""
    if response_format is None or response_format.type == "text":
        return []
    if response_format.type == "json_object":
        return [("response_format", {"json_object": True})]
    return [("response_format.json_schema.schema", {"json": response_format.json_schema.schema_})]


def request_constraints(body: SamplingRequest) -> list[Constraint]:
    """Every constraint a completion or chat request body gives."""
    return _format_constraint(body.response_format) + [
        (name, {kind: getattr(body, name)}) for name, kind in _GUIDED_FIELDS.items() if getattr(body, name) is not None]


def guided_decoding(constraints: list[Constraint], begin_after: str | None = None) -> GuidedDecodingParams | None:
    """The one constraint of a request, checked; None without any. 400 when there are several or it is malformed.

    begin_after: where the constraint starts (a reasoning model's `</think>`: the answer is constrained)."""
    if not constraints:
        return None
    if len(constraints) > 1:
        first, second = constraints[0][0].split(".")[0], constraints[1][0].split(".")[0]
        raise bad_request(f"{first} and {second} both constrain the output; give at most one of them", second)
    param, kwargs = constraints[0]
    try:
        guided = GuidedDecodingParams(**kwargs, begin_after=begin_after)
    except (ValueError, TypeError) as exc:
        raise bad_request(_naming(str(exc), param), param, "invalid_value") from exc
    from raylm.engine.structured_output import check_guided  # xgrammar: loaded with the first such request

    try:
        check_guided(guided)
    except ValueError as exc:
        raise bad_request(_naming(str(exc), param), param, "invalid_value") from exc
    return guided


def _naming(message: str, param: str) -> str:
    """The engine's message about guided_decoding.KIND, about the request's field instead."""
    if message.startswith("guided_decoding."):
        return param + message[message.find(" "):]
    return f"{param}: {message}"
