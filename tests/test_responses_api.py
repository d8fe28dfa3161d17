"""/v1/responses (issue 11 item 3) through the real openai client against a real mesh: text and message
input, instructions, max_output_tokens, the typed stream events, structured output through text.format,
function tools, and the 400s of a stateless server."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.gateway_harness import one_decoder_mesh, openai_client
from tests.test_gateway_api import expect_error

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer", "minimum": 0,
                                                                                         "maximum": 9}},
          "required": ["answer", "score"], "additionalProperties": False}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):  # noqa: ANN001, ANN201
    with one_decoder_mesh(tmp_path_factory, "resp", "qwen3", checkpoint={"max_position_embeddings": 2048}) as m:
        yield m


@pytest.fixture(scope="module")
def client(mesh):  # noqa: ANN001, ANN201
    return openai_client(mesh)


def test_text_input_matches_the_equivalent_chat(client) -> None:  # noqa: ANN001
    r = client.responses.create(model="tiny", input="Tell me a story", instructions="Be brief.", max_output_tokens=12,
                                temperature=0)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "Be brief."},
                                                                  {"role": "user", "content": "Tell me a story"}],
                                          max_tokens=12, temperature=0)
    assert r.object == "response" and r.id.startswith("resp")
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    msgs = client.responses.create(model="tiny", input=[{"role": "user", "content": "Tell me a story"}],
                                   instructions="Be brief.", max_output_tokens=12, temperature=0)
    assert msgs.output_text == r.output_text


def test_stream_events_in_order_and_text_equal_to_the_whole(client) -> None:  # noqa: ANN001
    kw = dict(model="tiny", input="Hello", max_output_tokens=10, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == text and events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_structured_output_through_text_format(client) -> None:  # noqa: ANN001
    for seed in range(3):
        r = client.responses.create(model="tiny", input="Rate it", max_output_tokens=100, temperature=1.0,
                                    extra_body={"seed": seed},
                                    text={"format": {"type": "json_schema", "name": "rating", "schema": SCHEMA,
                                                     "strict": True}})
        jsonschema.validate(json.loads(r.output_text), SCHEMA)


def test_function_tools(client) -> None:  # noqa: ANN001
    tools = [{"type": "function", "name": "lookup", "description": "Look a word up",
              "parameters": {"type": "object", "properties": {"word": {"type": "string", "maxLength": 8}},
                             "required": ["word"], "additionalProperties": False}}]
    r = client.responses.create(model="tiny", input="Define cat", tools=tools, tool_choice="required",
                                max_output_tokens=400, temperature=1.0, extra_body={"seed": 1}, parallel_tool_calls=False)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "lookup" and set(json.loads(call.arguments)) == {"word"}
    follow = client.responses.create(model="tiny", max_output_tokens=5, temperature=0, input=[
        {"role": "user", "content": "Define cat"},
        {"type": "function_call", "call_id": call.call_id, "name": "lookup", "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "a small feline"}], tools=tools)
    assert follow.status in ("completed", "incomplete") and follow.usage.input_tokens > 0
    events = list(client.responses.create(model="tiny", input="Define cat", tools=tools, stream=True, temperature=1.0,
                                          tool_choice={"type": "function", "name": "lookup"}, max_output_tokens=100))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and "word" in json.loads(done[0].arguments)
    # Issue 26: the call streams as it forms: the item first, then argument deltas adding up to the arguments.
    kinds = [e.type for e in events]
    added = kinds.index("response.output_item.added")
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert added < kinds.index("response.function_call_arguments.delta") and len(deltas) > 3
    assert "".join(deltas) == done[0].arguments
    (item,) = [o for o in events[-1].response.output if o.type == "function_call"]
    assert item.arguments == done[0].arguments and item.call_id == events[added].item.call_id
    cut = list(client.responses.create(model="tiny", input="Define cat", tools=tools, stream=True, temperature=1.0,
                                       tool_choice={"type": "function", "name": "lookup"}, max_output_tokens=6))
    assert cut[-1].type == "response.incomplete"
    assert "".join(e.delta for e in cut if e.type == "response.function_call_arguments.delta")


def test_stateless_limits_and_bad_input_are_400s(client) -> None:  # noqa: ANN001
    expect_error(openai.BadRequestError, lambda: client.responses.create(
        model="tiny", input="x", previous_response_id="resp_123"), 400, "previous_response_id")
    expect_error(openai.BadRequestError, lambda: client.responses.create(model="tiny", input=[]), 400, "input")
    expect_error(openai.BadRequestError, lambda: client.responses.create(
        model="tiny", input="x", text={"format": {"type": "json_schema", "name": "x"}}), 400, "text.format")
    expect_error(openai.NotFoundError, lambda: client.responses.create(model="gpt-4", input="x"), 404, "model")
