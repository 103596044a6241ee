"""Chat answers read into reasoning_content, content and tool_calls through the openai client, streamed and
whole, over outputs recorded in the forms tool-calling and reasoning models write (RecordedEngine sends them one
token per chunk, so chunks end inside the tags)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from raylm.serving import ServingConfig, build_app
from tests.serving.conftest import MODEL, TOOLS_TEMPLATE, RecordedEngine, openai_client, serve

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris and in Rome?"}]

QWEN_TWO_CALLS = ('<think>\nThe user wants two cities. I call the tool twice.\n</think>\n\n'
                  'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                  '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')


@pytest.fixture(scope="module")
def recorded(llm) -> RecordedEngine:
    return RecordedEngine(llm)


@pytest.fixture(scope="module")
def client(recorded) -> Iterator:
    config = ServingConfig(served_model_name=MODEL, chat_template=TOOLS_TEMPLATE, tool_call_parser="hermes",
                           reasoning_parser="qwen3")
    with serve(build_app(recorded, config)) as url:
        yield openai_client(url)


def streamed_message(client, **kwargs) -> tuple[dict, str | None, list]:
    """The message a stream's deltas add up to, its finish reason, and its chunks."""
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kwargs))
    message: dict = {"reasoning_content": "", "content": "", "tool_calls": {}}
    for chunk in chunks:
        delta = chunk.choices[0].delta
        message["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
        message["content"] += delta.content or ""
        for call in delta.tool_calls or []:
            entry = message["tool_calls"].setdefault(call.index, {"id": None, "name": None, "arguments": ""})
            if call.id is not None:
                assert entry["id"] is None and entry["arguments"] == "", "a call's id and name come first, once"
                entry.update(id=call.id, name=call.function.name)
            entry["arguments"] += call.function.arguments or ""
    return message, chunks[-1].choices[0].finish_reason, chunks


def test_reasoning_content_and_two_hermes_calls_whole_and_streamed(client, recorded):
    recorded.next_output = QWEN_TWO_CALLS
    response = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"] == "\nThe user wants two cities. I call the tool twice.\n"
    assert choice.message.content == "Let me check.\n"
    calls = choice.message.tool_calls
    assert [(call.type, call.function.name, json.loads(call.function.arguments)) for call in calls] == [
        ("function", "get_weather", {"city": "Paris"}), ("function", "get_weather", {"city": "Rome"})]
    assert all(call.id.startswith("call_") for call in calls) and calls[0].id != calls[1].id

    message, finish, chunks = streamed_message(client, messages=ASK, tools=[WEATHER])
    assert finish == "tool_calls" and len(chunks) > 20
    assert message["reasoning_content"] == choice.message.model_extra["reasoning_content"]
    assert message["content"] == choice.message.content
    assert [(call["name"], call["arguments"]) for call in message["tool_calls"].values()] == [
        (call.function.name, call.function.arguments) for call in calls]
    with_arguments = [chunk for chunk in chunks for call in chunk.choices[0].delta.tool_calls or []
                      if call.id is None and call.function.arguments]
    assert len(with_arguments) > 2  # the arguments arrive in pieces, as the model writes them


def test_broken_call_json_is_content_not_an_error(client, recorded):
    recorded.next_output = 'Calling: <tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    choice = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER]).choices[0]
    assert choice.message.content == recorded.next_output and choice.message.tool_calls is None
    assert choice.finish_reason == "stop"


def test_without_tools_a_tool_call_is_text_and_without_think_all_is_content(client, recorded):
    recorded.next_output = 'Plain answer with <tool_call>{"name": "x", "arguments": {}}</tool_call>'
    choice = client.chat.completions.create(model=MODEL, messages=ASK).choices[0]
    assert choice.message.content == recorded.next_output and choice.message.tool_calls is None
    assert choice.message.model_extra["reasoning_content"] is None
    message, finish, _ = streamed_message(client, messages=ASK)
    assert message["content"] == recorded.next_output and message["reasoning_content"] == "" and finish == "stop"


def test_structured_output_begins_after_the_thinking_when_a_reasoning_parser_is_on(client, recorded):
    recorded.next_output = '<think>ok</think>{"a": 1}'
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    response = client.chat.completions.create(model=MODEL, messages=ASK, response_format=response_format)
    guided = recorded.submitted[-1].guided_decoding
    assert guided.json == schema and guided.begin_after == "</think>"
    message = response.choices[0].message
    assert message.content == '{"a": 1}' and message.model_extra["reasoning_content"] == "ok"


def test_tool_choice_required_decodes_an_array_of_the_tools_calls(client, recorded):
    recorded.next_output = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    choice = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                            parallel_tool_calls=False).choices[0]
    schema = recorded.submitted[-1].guided_decoding.json
    assert schema["maxItems"] == 1 and schema["items"]["properties"]["name"] == {"type": "string",
                                                                                "enum": ["get_weather"]}
    assert schema["items"]["properties"]["arguments"] == WEATHER["function"]["parameters"]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(call.function.name, call.function.arguments) for call in choice.message.tool_calls] == [
        ("get_weather", '{"city": "Oslo"}')]


def test_a_named_tool_choice_decodes_its_parameters_and_streams_the_call(client, recorded):
    recorded.next_output = '{"city": "Lima"}'
    named = {"type": "function", "function": {"name": "get_weather"}}
    message, finish, _ = streamed_message(client, messages=ASK, tools=[WEATHER], tool_choice=named)
    assert recorded.submitted[-1].guided_decoding.json == WEATHER["function"]["parameters"]
    assert finish == "tool_calls" and message["content"] == ""
    assert [(call["name"], call["arguments"]) for call in message["tool_calls"].values()] == [
        ("get_weather", '{"city": "Lima"}')]
