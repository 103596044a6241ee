"""Chat messages to a prompt: roles, content parts, and the chat template."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jinja2

from raylm.inputs import apply_chat_template
from raylm.serving.errors import bad_request
from raylm.serving.protocol import ChatMessage, ContentPart, ResponseInputMessage

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
    """Messages as the chat template takes them: {"role", "content"[, "name"]} with string content.

    OpenAI's "developer" role is the system role of chat templates; tool and function messages need tool
    calling, which raylm does not support yet.
    """
    dicts = []
    for position, message in enumerate(messages):
        where = f"{param}.{position}"
        if message.role in ("tool", "function"):
            raise bad_request(f"raylm does not support messages with role {message.role!r} yet", f"{where}.role",
                              "unsupported_parameter")
        entry = {"role": "system" if message.role == "developer" else message.role,
                 "content": content_text(message.content, where)}
        if getattr(message, "name", None):
            entry["name"] = message.name
        dicts.append(entry)
    return dicts


def render_chat(tokenizer: Any, messages: list[dict], chat_template: str | None,
                add_generation_prompt: bool = True) -> tuple[str, list[int]]:
    """The conversation rendered by the chat template, and its token ids.

    The template writes the special tokens itself, so the tokenizer adds none.
    """
    try:
        text = apply_chat_template(tokenizer, messages, chat_template, add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as exc:
        raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from exc
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from exc
    return text, tokenizer.encode(text, add_special_tokens=False)
