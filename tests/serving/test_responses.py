"""/v1/responses through the official openai client: text and message input, instructions, usage, status,
and the streamed event sequence."""

from __future__ import annotations

from tests.serving.conftest import MODEL

QUESTION = "What is the capital of France?"


def test_response_equals_the_chat_completion_of_the_same_conversation(client):
    response = client.responses.create(model=MODEL, input=QUESTION, instructions="Answer in one word.",
                                       max_output_tokens=6, temperature=0)
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=6, temperature=0,
        messages=[{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": QUESTION}])
    assert response.output_text == chat.choices[0].message.content
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.output[0].type == "message" and response.output[0].role == "assistant"
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens
    expected = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert response.status == expected


def test_cut_short_response_is_incomplete_and_message_list_input_works(client):
    response = client.responses.create(
        model=MODEL, max_output_tokens=3, temperature=0,
        input=[{"role": "user", "content": "Count from one to twenty."},
               {"role": "assistant", "content": [{"type": "output_text", "text": "One, two,"}]},
               {"role": "user", "content": [{"type": "input_text", "text": "Go on."}]}])
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output_text


def test_streamed_events_arrive_in_order_and_deltas_build_the_final_text(client):
    whole = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=8, temperature=0)
    with client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=8, temperature=0,
                                 stream=True) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response
    assert text == whole.output_text == final.output_text
    assert events[0].response.status == "in_progress" and final.id == events[0].response.id
    assert final.usage.output_tokens == whole.usage.output_tokens
