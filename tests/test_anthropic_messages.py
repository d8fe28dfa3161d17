"""Anthropic's Messages API (/v1/messages) through the real `anthropic` SDK against a real mesh (nats-server,
tokenizer service, an engine-backed decode worker, the gateway with an API key): text, system, streaming
events, stop sequences, tools both ways, usage, and bad input as 4xx."""
from __future__ import annotations

import anthropic
import jsonschema
import pytest

from tests.gateway_harness import one_decoder_mesh

KEY = "sk-ant-test"
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):  # noqa: ANN001, ANN201
    # Tools rendered by the chat template take ~420 tokens: room for them and a whole call.
    with one_decoder_mesh(tmp_path_factory, name="anthropic", api_key=KEY,
                          checkpoint={"max_position_embeddings": 1024}) as m:
        yield m


@pytest.fixture(scope="module")
def client(mesh):  # noqa: ANN001, ANN201
    return anthropic.Anthropic(base_url=mesh.url, api_key=KEY, max_retries=0, timeout=60)


def ask(client, **kw):  # noqa: ANN001, ANN003, ANN201
    # This SDK has no sampling arguments any more; greedy goes in the body, as older clients send it.
    args = dict(model="tiny", max_tokens=12, extra_body={"temperature": 0},
                messages=[{"role": "user", "content": "Once upon a time"}])
    return client.messages.create(**(args | kw))


def test_a_message_with_usage_and_its_stop_reason(client) -> None:  # noqa: ANN001
    m = ask(client, system="You tell stories.")
    assert m.type == "message" and m.role == "assistant" and m.model == "tiny" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.usage.input_tokens > 0 and m.usage.output_tokens <= 12
    assert m.stop_reason == ("max_tokens" if m.usage.output_tokens == 12 else "end_turn")
    assert m.usage.cache_read_input_tokens == 0


def test_the_stream_is_the_same_message(client) -> None:  # noqa: ANN001
    whole = ask(client)
    with client.messages.stream(model="tiny", max_tokens=12, extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": "Once upon a time"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    # Anthropic counts cache reads apart from input_tokens; the second request hits the prefix cache.
    u, w = final.usage, whole.usage
    assert u.input_tokens + u.cache_read_input_tokens == w.input_tokens + w.cache_read_input_tokens


def test_a_stop_sequence_is_reported(client) -> None:  # noqa: ANN001
    text = ask(client, max_tokens=24).content[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), text
    m = ask(client, max_tokens=24, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert stop not in m.content[0].text


# A random model never stops calling when parallel calls are allowed: one call each.
@pytest.mark.parametrize("choice", [{"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "get_weather"}])
def test_forced_tool_use_streamed_and_not(client, choice) -> None:  # noqa: ANN001
    kw = dict(model="tiny", max_tokens=200, extra_body={"temperature": 0}, tools=[WEATHER], tool_choice=choice,
              messages=[{"role": "user", "content": "Weather in Paris?"}])
    m = client.messages.create(**kw)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    assert m.stop_reason == "tool_use"
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(uses[0].name, uses[0].input)]


def test_a_tool_result_turn_continues_the_conversation(client) -> None:  # noqa: ANN001
    m = ask(client, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C, sunny"}]},
    ])
    assert m.content and m.usage.input_tokens > ask(client).usage.input_tokens


def test_bad_input_is_a_4xx_naming_the_problem(client, mesh) -> None:  # noqa: ANN001
    with pytest.raises(anthropic.BadRequestError, match="image"):
        ask(client, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    with pytest.raises(anthropic.BadRequestError, match="temperature"):
        ask(client, extra_body={"temperature": 1.5})
    with pytest.raises(anthropic.BadRequestError, match="messages"):
        ask(client, messages=[])
    with pytest.raises(anthropic.BadRequestError, match="get_time"):
        ask(client, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_time"})
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=mesh.url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert ask(client).content  # and the mesh still serves
