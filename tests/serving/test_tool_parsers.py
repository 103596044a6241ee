"""The tool-call formats read whole and streamed in pieces of every size: calls, their arguments' own JSON text,
the content around them, and broken calls left as content."""

from __future__ import annotations

import json

import pytest

from raylm.serving.tool_parsers import (
    HERMES,
    JSON_ARRAY,
    LLAMA3_JSON,
    NamedToolCallStream,
    ToolCallDelta,
    ToolCallFormat,
    ToolCallStream,
    join_calls,
)

# Outputs in the shapes the models write them (Qwen2.5-Instruct's hermes calls, Llama-3.1-Instruct's JSON calls).
QWEN_ONE_CALL = ('<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
                 '"unit": "celsius"}}\n</tool_call>')
QWEN_TEXT_THEN_TWO_CALLS = (
    'I will look both up.\n<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Paris", "format": "{h}:{m}"}}\n'
    '</tool_call>')
LLAMA_CALL = '{"name": "get_current_weather", "parameters": {"location": "San Francisco, CA", "unit": "fahrenheit"}}'
LLAMA_PYTHON_TAG_TWO_CALLS = ('<|python_tag|>{"name": "search", "parameters": {"query": "a; b \\"quoted\\" }"}}; '
                              '{"name": "add", "parameters": {"a": 1, "b": [2, 3]}}')


def whole(fmt: ToolCallFormat, text: str) -> tuple[str, list[tuple[str, str]]]:
    content, deltas = ToolCallStream(fmt).feed(text, final=True)
    return content, [(call.name, call.arguments) for call in join_calls(deltas)]


def streamed(fmt: ToolCallFormat, text: str, size: int) -> tuple[str, list[tuple[str, str]], list[ToolCallDelta]]:
    stream, content, deltas = ToolCallStream(fmt), [], []
    pieces = [text[start:start + size] for start in range(0, len(text), size)] or [""]
    for position, piece in enumerate(pieces):
        piece_content, piece_deltas = stream.feed(piece, final=position == len(pieces) - 1)
        content.append(piece_content)
        deltas.extend(piece_deltas)
    return "".join(content), [(call.name, call.arguments) for call in join_calls(deltas)], deltas


def assert_streams_like_whole(fmt: ToolCallFormat, text: str) -> None:
    expected = whole(fmt, text)
    for size in range(1, len(text) + 1):
        content, calls, deltas = streamed(fmt, text, size)
        assert (content, calls) == expected, f"pieces of {size} characters"
        firsts = [delta for delta in deltas if delta.id is not None]
        assert [delta.index for delta in firsts] == list(range(len(calls)))  # each call's first delta names it
        assert all(delta.id.startswith("call_") and delta.name for delta in firsts)
        for index in range(len(calls)):
            of_call = [delta for delta in deltas if delta.index == index]
            assert of_call[0].id is not None and all(delta.id is None for delta in of_call[1:])


def test_hermes_one_call_keeps_the_models_argument_text():
    assert whole(HERMES, QWEN_ONE_CALL) == (
        "", [("get_current_weather", '{"location": "Paris, France", "unit": "celsius"}')])
    assert_streams_like_whole(HERMES, QWEN_ONE_CALL)


def test_hermes_text_before_two_calls_stays_content():
    content, calls = whole(HERMES, QWEN_TEXT_THEN_TWO_CALLS)
    assert content == "I will look both up.\n"
    assert calls == [("get_current_weather", '{"location": "Paris"}'),
                     ("get_time", '{"zone": "Europe/Paris", "format": "{h}:{m}"}')]
    assert all(isinstance(json.loads(arguments), dict) for _, arguments in calls)
    assert_streams_like_whole(HERMES, QWEN_TEXT_THEN_TWO_CALLS)


def test_hermes_arguments_stream_as_they_are_written():
    _, _, deltas = streamed(HERMES, QWEN_ONE_CALL, 4)
    assert deltas[0].name == "get_current_weather" and deltas[0].arguments == ""
    pieces = [delta.arguments for delta in deltas[1:]]
    assert len(pieces) > 5 and "".join(pieces) == '{"location": "Paris, France", "unit": "celsius"}'


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',  # the object never closes
    '<tool_call>\nnot json at all\n</tool_call>',
    '<tool_call>\n{"nam": "f", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}}',  # cut before the closing tag: still a call
])
def test_hermes_broken_calls_stay_content_whole(text):
    content, calls = whole(HERMES, "Sure. " + text)
    if text.endswith("}}"):
        assert content == "Sure. " and calls == [("f", '{"a": 1}')]
    else:
        assert content == "Sure. " + text and calls == []


def test_hermes_broken_call_before_its_name_streams_as_content():
    text = 'Sure. <tool_call>\nnot json {"name": 1}\n</tool_call> done'
    assert whole(HERMES, text) == (text, [])
    for size in range(1, len(text) + 1):
        assert streamed(HERMES, text, size)[:2] == (text, [])


def test_text_with_a_partial_marker_is_held_then_shown():
    assert_streams_like_whole(HERMES, "a < b and <tool is not a tag")
    assert whole(HERMES, "a < b and <tool is not a tag") == ("a < b and <tool is not a tag", [])


def test_llama3_json_call_at_the_start_and_python_tag_calls_separated_by_semicolons():
    assert whole(LLAMA3_JSON, LLAMA_CALL) == (
        "", [("get_current_weather", '{"location": "San Francisco, CA", "unit": "fahrenheit"}')])
    assert whole(LLAMA3_JSON, LLAMA_PYTHON_TAG_TWO_CALLS) == (
        "", [("search", '{"query": "a; b \\"quoted\\" }"}'), ("add", '{"a": 1, "b": [2, 3]}')])
    assert_streams_like_whole(LLAMA3_JSON, LLAMA_CALL)
    assert_streams_like_whole(LLAMA3_JSON, LLAMA_PYTHON_TAG_TWO_CALLS)


@pytest.mark.parametrize("text", ['{"answer": 42}', "The answer is {42}.", "<|python_tag|>print('hi')"])
def test_llama3_json_text_that_is_no_call_stays_content(text):
    assert whole(LLAMA3_JSON, text) == (text, [])
    assert streamed(LLAMA3_JSON, text, 3)[:2] == (text, [])


def test_a_call_cut_short_is_content_whole_but_once_its_name_streamed_it_stays_a_call():
    text = '{"name": "f", "parameters": {"a": 1}'  # max_tokens ended it before its last brace
    assert whole(LLAMA3_JSON, text) == (text, [])
    assert streamed(LLAMA3_JSON, text, 3)[:2] == ("", [("f", '{"a": 1}')])


def test_arguments_written_as_a_json_string_are_kept_as_that_text():
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert whole(HERMES, text) == ("", [("f", '{"a": 1}')])
    assert_streams_like_whole(HERMES, text)


def test_json_array_of_required_calls():
    text = '[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]'
    assert whole(JSON_ARRAY, text) == ("", [("f", '{"a": 1}'), ("g", "{}")])
    assert_streams_like_whole(JSON_ARRAY, text)


def test_named_call_is_the_whole_output_as_arguments():
    stream = NamedToolCallStream("get_time")
    first = stream.feed('{"zone":', final=False)
    second = stream.feed(' "UTC"}', final=True)
    calls = join_calls(first[1] + second[1])
    assert first[0] == second[0] == "" and stream.num_calls == 1
    assert [(call.name, call.arguments) for call in calls] == [("get_time", '{"zone": "UTC"}')]
