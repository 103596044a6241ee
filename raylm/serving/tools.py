"""How a chat request uses its tools: which the chat template offers the model, whether a call is enforced by
structured output, and how the output is read back as tool calls.

- no tools, or tool_choice "none": the template offers none and the output is not parsed (the model was told of
  no tool, so whatever it writes is its answer); a template still renders the calls and results of the history;
- "auto" (the default with tools): the template offers them and the server's tool_call_parser reads the calls
  the model chose to make out of its text (a server without one answers 400: it could not return them);
- "required": the output is decoded under a JSON schema of an array of one or more calls ({"name", "arguments"}
  of the offered tools; one call when parallel_tool_calls is false), so every call parses;
- a named function: the output is decoded under that function's parameters schema, and is that call's arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raylm.serving.errors import bad_request
from raylm.serving.guided_decoding import Constraint
from raylm.serving.protocol import ChatCompletionRequest, ChatTool
from raylm.serving.tool_parsers import JSON_ARRAY, TOOL_CALL_PARSERS, NamedToolCallStream, ToolCallStream

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass
class ToolUse:
    """One chat request's tools: what the template renders, the enforcing constraint, and the output's reader."""

    offered: list[dict] | None  # the tools as the chat template takes them, or None
    constraint: Constraint | None  # the JSON schema a required or named choice decodes under
    parser: str | None  # a TOOL_CALL_PARSERS name, "required" (the array), or None (no parsing)
    named: str | None = None  # the function a named choice calls

    def output_stream(self) -> ToolCallStream | NamedToolCallStream | None:
        """A reader of one choice's output (its answer, after any reasoning), or None when it is not parsed."""
        if self.named is not None:
            return NamedToolCallStream(self.named)
        if self.parser == "required":
            return ToolCallStream(JSON_ARRAY)
        return ToolCallStream(TOOL_CALL_PARSERS[self.parser]) if self.parser is not None else None


def tool_use(body: ChatCompletionRequest, tool_call_parser: str | None) -> ToolUse:
    """How `body` uses its tools; 400 naming the field for a choice it cannot honour."""
    tools, choice = body.tools or [], body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools: give the functions the model may call", "tool_choice",
                              "invalid_value")
        return ToolUse(None, None, None)
    names = [tool.function.name for tool in tools]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise bad_request(f"tools must have distinct names; {repeated} appear more than once", "tools", "invalid_value")
    if choice == "none":
        return ToolUse(None, None, None)
    offered = [tool.model_dump(exclude_none=True) for tool in tools]
    if choice in (None, "auto"):
        if tool_call_parser is None:
            raise bad_request("tool_choice 'auto' needs a server started with --tool_call_parser (hermes or "
                              "llama3_json) to read the calls out of the model's text; 'required' or a named "
                              "function work without one", "tool_choice", "invalid_value")
        return ToolUse(offered, None, tool_call_parser)
    if choice == "required":
        schema = _calls_schema(tools, one_call=body.parallel_tool_calls is False)
        return ToolUse(offered, ("tool_choice", {"json": schema}), "required")
    by_name = {tool.function.name: tool for tool in tools}
    tool = by_name.get(choice.function.name)
    if tool is None:
        raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not among the tools "
                          f"({names})", "tool_choice.function.name", "invalid_value")
    return ToolUse(offered, ("tool_choice", {"json": _parameters(tool)}), None, tool.function.name)


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters or _ANY_OBJECT


def _calls_schema(tools: list[ChatTool], one_call: bool) -> dict[str, Any]:
    """A JSON array of calls of the tools: [{"name": <one of them>, "arguments": <its parameters>}, ...]."""
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                               "arguments": _parameters(tool)},
              "required": ["name", "arguments"], "additionalProperties": False} for tool in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if one_call:
        schema["maxItems"] = 1
    return schema
