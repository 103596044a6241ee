"""Chat messages to a prompt: roles, content parts, and the chat template."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import jinja2

from raylm.inputs import apply_chat_template
from raylm.serving.errors import bad_request
from raylm.serving.protocol import ChatMessage, ContentPart, ToolCallParam
from raylm.serving.responses_protocol import ResponseInputMessage

# Part types whose text is the content: chat's "text", the Responses API's input and replayed output text.
_TEXT_PART_TYPES = ("text", "input_text", "output_text")


def content_text(content: str | Sequence[ContentPart] | None, param: str) -> str:
    """A message's content as one string; text parts are joined by newlines, other parts are rejected."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for position, part in enumerate(content):
        if part.type not in _TEXT_PART_TYPES:
            raise bad_request(f"raylm does not support content of type {part.type!r} yet",
                              f"{param}.content.{position}.type", "unsupported_parameter")
        if part.text is None:
            raise bad_request(f"a {part.type!r} content part needs a text field", f"{param}.content.{position}.text")
        texts.append(part.text)
    return "\n".join(texts)


def message_dicts(messages: Sequence[ChatMessage | ResponseInputMessage], param: str = "messages") -> list[dict]:
    """Messages as the chat template takes them: {"role", "content"[, "name", "tool_calls", "tool_call_id",
    "reasoning_content"]} with string content.

    OpenAI's "developer" role is the system role of chat templates. An assistant message's tool calls carry their
    arguments as a dict, as chat templates expect (OpenAI sends their JSON text). The deprecated "function" role
    (before tool calls) is not supported.
    """
    dicts = []
    for position, message in enumerate(messages):
        where = f"{param}.{position}"
        if message.role == "function":
            raise bad_request("raylm does not support messages with role 'function' (the deprecated form of tool "
                              "calls); send role 'tool' with tool_call_id", f"{where}.role", "unsupported_parameter")
        entry: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                                 "content": content_text(message.content, where)}
        for name in ("name", "tool_call_id", "reasoning_content"):
            if getattr(message, name, None):
                entry[name] = getattr(message, name)
        if getattr(message, "tool_calls", None):
            entry["tool_calls"] = [_template_tool_call(call, f"{where}.tool_calls.{index}")
                                   for index, call in enumerate(message.tool_calls)]
        dicts.append(entry)
    return dicts


def _template_tool_call(call: ToolCallParam, param: str) -> dict:
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError as exc:
        raise bad_request(f"{param}.function.arguments must be a JSON object's text: {exc}",
                          f"{param}.function.arguments") from exc
    if not isinstance(arguments, dict):
        raise bad_request(f"{param}.function.arguments must be a JSON object's text", f"{param}.function.arguments")
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


def render_chat(tokenizer: Any, messages: list[dict], chat_template: str | None,
                add_generation_prompt: bool = True, tools: list[dict] | None = None) -> tuple[str, list[int]]:
    """The conversation rendered by the chat template (with the tools it offers the model, if any), and its token
    ids.

    The template writes the special tokens itself, so the tokenizer adds none.
    """
    extra = {"tools": tools} if tools else {}
    try:
        text = apply_chat_template(tokenizer, messages, chat_template, add_generation_prompt=add_generation_prompt,
                                   **extra)
    except jinja2.TemplateError as exc:
        raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from exc
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from exc
    return text, tokenizer.encode(text, add_special_tokens=False)
