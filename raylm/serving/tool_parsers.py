"""Tool calls in a model's output: the formats models write them in, parsed whole or as the text streams.

A format is runs of JSON call objects ({"name": ..., "arguments" or "parameters": {...}}) set in the text:
- hermes (Hermes, Qwen2.5/Qwen3): each call in `<tool_call>...</tool_call>`, text around them;
- llama3_json (Llama 3.x): `<|python_tag|>` (or the output's first character) opens calls separated by `;`;
- the JSON array raylm decodes under a schema for tool_choice "required": `[{"name", "arguments"}, ...]`.

ToolCallStream follows one output: fed text as it arrives, it returns the content to show and the tool-call
deltas (a call's id and name first, then its arguments as they are written, the model's own JSON text). Parsing
a whole output is one feed with final=True, so a streamed answer and a whole one agree. A call whose JSON is
broken stays in the content, never an error; only when it breaks after its name was streamed (the text cut by
max_tokens, say) can it no longer move back, and it ends with what was sent.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from enum import Enum

# A call object's start up to its arguments' value, when the name comes first (as every template writes it).
_NAME_THEN_ARGUMENTS = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass(frozen=True)
class ToolCallFormat:
    """Where a model's output holds tool calls."""

    name: str
    opens: tuple[str, ...]  # text that opens a run of calls (not part of any output)
    closes: str | None = None  # text that closes a run; without it a run ends at the first text that is no call
    separator: str | None = None  # between the calls of one run
    opens_with_call: bool = False  # a call at the output's very start opens a run without any marker


HERMES = ToolCallFormat("hermes", opens=("<tool_call>",), closes="</tool_call>")
LLAMA3_JSON = ToolCallFormat("llama3_json", opens=("<|python_tag|>",), separator=";", opens_with_call=True)
JSON_ARRAY = ToolCallFormat("json_array", opens=("[",), closes="]", separator=",")

TOOL_CALL_PARSERS = {fmt.name: fmt for fmt in (HERMES, LLAMA3_JSON)}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallDelta:
    """What one tool call gained: its id and name in its first delta, then pieces of its arguments' JSON."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object's text


def join_calls(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """The calls that `deltas` (all of an output's) make up, in order."""
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        if delta.index not in calls:
            calls[delta.index] = ToolCall(delta.id or new_call_id(), delta.name or "", "")
        calls[delta.index].arguments += delta.arguments
    return [calls[index] for index in sorted(calls)]


class _JsonEnd:
    """Where a JSON object or array that starts at `start` ends, found over a text that grows (brackets are
    counted outside strings; whether the JSON is valid is for json.loads to say)."""

    def __init__(self, start: int):
        self._next = start
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self.end: int | None = None

    def scan(self, text: str) -> int | None:
        """The index just after the closing bracket, or None while it has not arrived."""
        if self.end is not None:
            return self.end
        for position in range(self._next, len(text)):
            char = text[position]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    self.end = position + 1
                    return self.end
        self._next = len(text)
        return None


def _arguments_start(text: str, start: int) -> tuple[str, int] | None:
    """When the call object at `start` begins with its name and then an arguments object: the name and where
    the arguments' `{` is."""
    match = _NAME_THEN_ARGUMENTS.match(text, start)
    if match is None or not text.startswith("{", match.end()):
        return None
    try:
        name = json.loads(match.group(1))
    except json.JSONDecodeError:
        return None
    return (name, match.end()) if name else None


def _complete_call(text: str, start: int, end: int) -> tuple[str, str] | None:
    """The name and arguments (JSON text) of the call object text[start:end], or None if it is not one.
    Arguments written as an object right after the name keep the model's own text."""
    try:
        call = json.loads(text[start:end])
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            if not isinstance(json.loads(arguments), dict):
                return None
        except json.JSONDecodeError:
            return None
        return call["name"], arguments
    if not isinstance(arguments, dict):
        return None
    head = _arguments_start(text, start)
    if head is not None:
        arguments_end = _JsonEnd(head[1]).scan(text)
        if arguments_end is not None and arguments_end < end:
            return call["name"], text[head[1]:arguments_end]
    return call["name"], json.dumps(arguments, ensure_ascii=False)


def _held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of text could begin one of markers (kept until the next text says)."""
    for length in range(min(len(text), max(len(marker) for marker in markers) - 1), 0, -1):
        if any(marker.startswith(text[-length:]) for marker in markers):
            return length
    return 0


class _State(Enum):
    CONTENT = 1  # text shown as is, watching for a run's opening
    RUN = 2  # inside a run, between calls
    CALL = 3  # inside a call object
    PLAIN = 4  # after a broken run: the rest is content


class ToolCallStream:
    """One output's text, split into content and tool calls as it arrives (see the module's docstring).

    Whitespace that only separates calls, or trails them, is not content."""

    def __init__(self, fmt: ToolCallFormat):
        self.format = fmt
        self.num_calls = 0
        self._text = ""
        self._pos = 0  # text before it is dealt with
        self._state = _State.CONTENT
        self._at_start = fmt.opens_with_call
        self._run_start = 0
        self._run_sent = False  # some of the current run reached the client
        self._object: _JsonEnd | None = None
        self._call_start = 0
        self._arguments: _JsonEnd | None = None  # set once the call's name was sent and its arguments stream
        self._arguments_sent = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """Takes the output's next text (final: its last); returns the content and tool-call deltas it completes."""
        self._text += text
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        while self._step(final, content, calls):
            pass
        return "".join(content), calls

    def _step(self, final: bool, content: list[str], calls: list[ToolCallDelta]) -> bool:
        """Advances by one piece of the text; False when it must wait for more."""
        if self._state is _State.CONTENT:
            return self._content(final, content)
        if self._state is _State.RUN:
            return self._run(final, content)
        if self._state is _State.CALL:
            return self._call(final, content, calls)
        content.append(self._text[self._pos:])
        self._pos = len(self._text)
        return False

    def _content(self, final: bool, content: list[str]) -> bool:
        text, start = self._text, self._pos
        if self._at_start:
            first = len(text) - len(text[start:].lstrip())
            if first == len(text) and not final:
                return False
            self._at_start = False
            if text.startswith("{", first):
                self._open_run(start, start)
                return True
        found = [(text.find(marker, start), marker) for marker in self.format.opens]
        found = [(index, marker) for index, marker in found if index >= 0]
        if found:
            index, marker = min(found)
            content.append(text[start:index].rstrip() if self.num_calls else text[start:index])
            self._open_run(index, index + len(marker))
            return True
        rest = text[start:]
        if final:
            content.append(rest if rest.strip() or not self.num_calls else "")
            self._pos = len(text)
            return False
        # The start of a marker, or whitespace that may come before one, waits for the text after it.
        keep = _held_back(rest, self.format.opens)
        keep += len(rest) - keep - len(rest[:len(rest) - keep].rstrip())
        content.append(rest[:len(rest) - keep])
        self._pos = len(text) - keep
        return False

    def _open_run(self, run_start: int, calls_start: int) -> None:
        self._state, self._run_start, self._run_sent, self._pos = _State.RUN, run_start, False, calls_start

    def _run(self, final: bool, content: list[str]) -> bool:
        text, fmt = self._text, self.format
        self._pos = len(text) - len(text[self._pos:].lstrip())
        rest = text[self._pos:]
        if not rest:
            if final and not self._run_sent:
                return self._broken()
            return False
        if fmt.closes is not None and rest.startswith(fmt.closes):
            self._pos += len(fmt.closes)
            self._state = _State.CONTENT
            return True
        if fmt.separator is not None and rest.startswith(fmt.separator):
            self._pos += len(fmt.separator)
            return True
        if rest.startswith("{"):
            self._state, self._call_start = _State.CALL, self._pos
            self._object, self._arguments = _JsonEnd(self._pos), None
            return True
        if fmt.closes is not None and fmt.closes.startswith(rest) and not final:
            return False
        if fmt.closes is None and self._run_sent:  # the calls are over; what follows them is content
            self._state = _State.CONTENT
            return True
        return self._broken()

    def _call(self, final: bool, content: list[str], calls: list[ToolCallDelta]) -> bool:
        text, start = self._text, self._call_start
        end = self._object.scan(text)
        if end is not None:
            call = _complete_call(text, start, end)
            if call is None:
                if self._arguments is None:
                    return self._broken()
            elif self._arguments is None:
                calls.append(ToolCallDelta(self.num_calls, call[1], new_call_id(), call[0]))
                self.num_calls += 1
            else:
                self._send_arguments(calls)
            self._state, self._pos, self._run_sent = _State.RUN, end, True
            return True
        if final and self._arguments is None:
            return self._broken()
        if self._arguments is None:
            head = _arguments_start(text, start)
            if head is None:
                return False
            calls.append(ToolCallDelta(self.num_calls, "", new_call_id(), head[0]))
            self.num_calls += 1
            self._run_sent = True
            self._arguments, self._arguments_sent = _JsonEnd(head[1]), head[1]
        self._send_arguments(calls)
        return False

    def _send_arguments(self, calls: list[ToolCallDelta]) -> None:
        """The current call's arguments text that arrived since last sent, up to the end of its object."""
        end = self._arguments.scan(self._text) or len(self._text)
        if end > self._arguments_sent:
            calls.append(ToolCallDelta(self.num_calls - 1, self._text[self._arguments_sent:end]))
            self._arguments_sent = end

    def _broken(self) -> bool:
        """The current run is not well-formed calls: from where nothing of it was sent on, the text is content."""
        self._state = _State.PLAIN
        if not self._run_sent:
            self._pos = self._run_start
        return True


class NamedToolCallStream:
    """The output decoded under one function's parameters schema (tool_choice naming it): all of it is that
    call's arguments."""

    def __init__(self, name: str):
        self.name = name
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        if self.num_calls == 0:
            if not text and not final:
                return "", []
            self.num_calls = 1
            return "", [ToolCallDelta(0, text, new_call_id(), self.name)]
        return "", [ToolCallDelta(0, text)] if text else []
