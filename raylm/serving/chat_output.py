"""A chat choice's text read into what the API returns: the thinking (reasoning_content), the answer (content)
and the tool calls, whole or as deltas while it streams.

The reasoning parser splits the text first; the tool calls are read from the answer alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from raylm.serving.protocol import ChatResponseMessage, ResponseFunctionCall, ResponseToolCall
from raylm.serving.reasoning_parsers import REASONING_PARSERS, ReasoningStream
from raylm.serving.tool_parsers import NamedToolCallStream, ToolCallDelta, ToolCallStream, join_calls
from raylm.serving.tools import ToolUse


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def fields(self) -> dict[str, Any]:
        """The delta's fields in a stream chunk, those with news only."""
        fields: dict[str, Any] = {}
        if self.reasoning:
            fields["reasoning_content"] = self.reasoning
        if self.content:
            fields["content"] = self.content
        if self.tool_calls:
            fields["tool_calls"] = _merged(self.tool_calls)
        return fields


def _merged(deltas: list[ToolCallDelta]) -> list[dict[str, Any]]:
    """OpenAI's tool_calls deltas, one entry per call."""
    entries: list[dict[str, Any]] = []
    for delta in deltas:
        if entries and entries[-1]["index"] == delta.index:
            entries[-1]["function"]["arguments"] += delta.arguments
            continue
        entry: dict[str, Any] = {"index": delta.index, "function": {"arguments": delta.arguments}}
        if delta.id is not None:
            entry.update(id=delta.id, type="function")
            entry["function"]["name"] = delta.name
        entries.append(entry)
    return entries


class ChoiceReader:
    """One choice's text, read as it arrives (feed) or whole (message)."""

    def __init__(self, reasoning_parser: str | None, tools: ToolUse, prompt: str | None):
        self._reasoning = ReasoningStream(REASONING_PARSERS[reasoning_parser], prompt) if reasoning_parser else None
        self._tools: ToolCallStream | NamedToolCallStream | None = tools.output_stream()

    @property
    def called_tools(self) -> bool:
        return self._tools is not None and self._tools.num_calls > 0

    def feed(self, text: str, final: bool) -> ChatDelta:
        """The next text of the choice (final: its last), read."""
        delta = ChatDelta(content=text)
        if self._reasoning is not None:
            delta.reasoning, delta.content = self._reasoning.feed(text, final)
        if self._tools is not None:
            delta.content, delta.tool_calls = self._tools.feed(delta.content, final)
        return delta

    def message(self, text: str) -> ChatResponseMessage:
        """The message of the whole choice."""
        delta = self.feed(text, final=True)
        calls = [ResponseToolCall(id=call.id, function=ResponseFunctionCall(name=call.name, arguments=call.arguments))
                 for call in join_calls(delta.tool_calls)]
        parsed = self._reasoning is not None or self._tools is not None
        content = delta.content or None if parsed and (calls or delta.reasoning) else delta.content
        return ChatResponseMessage(content=content, reasoning_content=delta.reasoning or None,
                                   tool_calls=calls or None)

    def finish_reason(self, reason: str | None) -> str | None:
        """A choice that stopped after calling tools finishes with "tool_calls"."""
        return "tool_calls" if reason == "stop" and self.called_tools else reason
