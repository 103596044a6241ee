"""Structured output over HTTP through the openai client: response_format, the guided_* fields and the Responses
API's text.format reach the engine as guided_decoding, malformed or competing ones are 400s naming the field, and
(with the engine's token masks) the outputs validate."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.serving.conftest import MODEL

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema", "not valid"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}}, "response_format.json_schema.schema",
     "required"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema is required"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", ""),
    ({"guided_regex": "(unclosed"}, "guided_regex", "not valid"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar", "not valid"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_json": PERSON, "guided_regex": "[a-z]+"}, "guided_regex", "both constrain"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["yes", "no"]}, "guided_choice", "both constrain"),
])
def test_bad_or_competing_constraints_are_400_naming_the_field(client, body, param, says):
    for create, base in ((client.chat.completions.create, {"messages": ASK}),
                         (client.completions.create, {"prompt": "JSON:"})):
        with pytest.raises(openai.BadRequestError) as caught:
            create(model=MODEL, max_tokens=2, extra_body=body, **base)
        error = caught.value.body
        assert error["param"] == param and says in error["message"], error


def test_text_response_format_changes_nothing(client):
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=6, temperature=0)
    plain = client.chat.completions.create(**kwargs).choices[0].message.content
    text_format = client.chat.completions.create(response_format={"type": "text"}, **kwargs)
    assert text_format.choices[0].message.content == plain


def test_responses_text_format_with_a_bad_schema_is_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="JSON please", max_output_tokens=4,
                                text={"format": {"type": "json_schema", "name": "p", "schema": {"type": "objekt"}}})
    assert caught.value.body["param"] == "text.format.schema"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_json_schema_outputs_validate(client, stream):
    kwargs = dict(model=MODEL, messages=ASK, response_format=JSON_SCHEMA_FORMAT, max_tokens=120, temperature=1.0)
    for seed in range(2):
        if stream:
            text = "".join(chunk.choices[0].delta.content or ""
                           for chunk in client.chat.completions.create(stream=True, seed=seed, **kwargs))
        else:
            text = client.chat.completions.create(seed=seed, **kwargs).choices[0].message.content
        jsonschema.validate(json.loads(text), PERSON)


def test_completions_guided_fields_constrain_the_text(client):
    text = client.completions.create(model=MODEL, prompt="A person:", max_tokens=120, temperature=1.0, seed=1,
                                     extra_body={"guided_json": PERSON}).choices[0].text
    jsonschema.validate(json.loads(text), PERSON)
    choice = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=8, temperature=1.0, seed=2,
                                       extra_body={"guided_choice": ["red", "green", "blue"]}).choices[0].text
    assert choice in ("red", "green", "blue")
    regex = r"[0-9]{3}-[a-z]{2}"
    text = client.completions.create(model=MODEL, prompt="Code:", max_tokens=12, temperature=1.0, seed=3,
                                     extra_body={"guided_regex": regex}).choices[0].text
    assert re.fullmatch(regex, text)


def test_responses_text_format_json_schema_validates(client):
    response = client.responses.create(model=MODEL, input="Describe a person.", max_output_tokens=120,
                                       temperature=1.0, text={"format": {"type": "json_schema", "name": "person",
                                                                         "schema": PERSON}})
    jsonschema.validate(json.loads(response.output_text), PERSON)
    assert response.text.format.type == "json_schema"
