"""Tools on /v1/chat/completions over the real SmolLM2 through the openai client: the chat template renders the
tools and a history of calls and results; bad tools and choices are 400s naming the field; required and named
choices, decoded under structured output, give calls whose arguments parse (streamed and not)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from raylm.serving import ServingConfig, build_app
from tests.serving.conftest import MODEL, TOOLS_TEMPLATE, LocalEngine, openai_client, serve

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"hours_ahead": {"type": "integer"}},
                                       "required": ["hours_ahead"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"},
]


@pytest.fixture(scope="module")
def base_url(llm) -> Iterator[str]:
    config = ServingConfig(served_model_name=MODEL, chat_template=TOOLS_TEMPLATE, tool_call_parser="hermes")
    with serve(build_app(LocalEngine(llm), config)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai_client(base_url)


def template_tokens(llm, messages: list[dict], tools: list[dict] | None = None) -> int:
    return len(llm.tokenizer.apply_chat_template(messages, tools=tools, chat_template=TOOLS_TEMPLATE,
                                                 add_generation_prompt=True, tokenize=True, return_dict=False))


def test_the_template_renders_the_tools_and_none_leaves_them_out(client, llm):
    offered = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=1)
    assert offered.usage.prompt_tokens == template_tokens(llm, ASK, [WEATHER, TIME])
    declined = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="none",
                                              max_tokens=1)
    assert declined.usage.prompt_tokens == template_tokens(llm, ASK) < offered.usage.prompt_tokens


def test_a_history_of_tool_calls_and_results_is_rendered(client, llm):
    response = client.chat.completions.create(model=MODEL, messages=HISTORY, tools=[WEATHER], max_tokens=4,
                                              temperature=0)
    as_template_takes_it = [*ASK, {**HISTORY[1], "tool_calls": [{**HISTORY[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]}, HISTORY[2]]
    assert response.usage.prompt_tokens == template_tokens(llm, as_template_takes_it, [WEATHER])
    assert response.choices[0].message.role == "assistant"


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": [{"type": "retrieval", "function": WEATHER["function"]}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "object"}}]},
     "tools.0.function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
      "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "21 degrees"}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": HISTORY[1]["tool_calls"]}]}, "messages.0"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "{not json"}}]}]}, "messages.0.tool_calls.0.function.arguments"),
])
def test_bad_tools_and_choices_are_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**{"model": MODEL, "messages": ASK, "max_tokens": 1, **body})
    error = caught.value.body
    assert caught.value.status_code == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == param, error


def test_auto_needs_a_server_with_a_tool_call_parser(llm):
    with serve(build_app(LocalEngine(llm), ServingConfig(served_model_name=MODEL))) as url:
        with pytest.raises(openai.BadRequestError, match="tool_call_parser"):
            openai_client(url).chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=1)


def _check_call(name: str, arguments: str, tools: list[dict]) -> None:
    by_name = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
    jsonschema.validate(json.loads(arguments), by_name[name])


@pytest.mark.parametrize("stream", [False, True])
def test_required_gives_calls_whose_arguments_validate(client, stream):
    tools = [WEATHER, TIME]
    kwargs = dict(model=MODEL, messages=ASK, tools=tools, tool_choice="required", max_tokens=120, temperature=1.0,
                  seed=11)
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [(call.function.name, call.function.arguments) for call in choice.message.tool_calls]
        finish = choice.finish_reason
    else:
        entries: dict[int, list[str]] = {}
        finish = None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for call in chunk.choices[0].delta.tool_calls or []:
                entry = entries.setdefault(call.index, ["", ""])
                entry[0] += call.function.name or ""
                entry[1] += call.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        calls = [tuple(entries[index]) for index in sorted(entries)]
    assert finish == "tool_calls" and calls
    for name, arguments in calls:
        _check_call(name, arguments, tools)


def test_a_named_choice_calls_that_function_with_valid_arguments(client):
    choice = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=60, temperature=1.0, seed=3,
        tool_choice={"type": "function", "function": {"name": "get_time"}}).choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time" and choice.finish_reason == "tool_calls"
    _check_call("get_time", call.function.arguments, [TIME])


def test_auto_reads_a_hermes_call_out_of_the_text(client):
    """The model is steered into a Hermes call with a regex (structured output), the hermes parser reads it."""
    regex = (r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
             r'"unit": "celsius"\}\}</tool_call>')
    choice = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=60,
                                            temperature=0, extra_body={"guided_regex": regex}).choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and choice.finish_reason == "tool_calls"
    _check_call("get_weather", call.function.arguments, [WEATHER])
