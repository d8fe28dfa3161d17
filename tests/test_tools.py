"""Tool calling (issue 11 item 2) through the real openai client against a real mesh: named and required
tool_choice enforced by the grammar, auto parsed from the model's Hermes-style text, tool turns rendered
by the chat template, and the inconsistent requests that are 400s."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.gateway_harness import one_decoder_mesh, openai_client
from tests.test_gateway_api import expect_error

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):  # noqa: ANN001, ANN201
    with one_decoder_mesh(tmp_path_factory, "tools", "qwen3", checkpoint={"max_position_embeddings": 2048}) as m:
        yield m


@pytest.fixture(scope="module")
def client(mesh):  # noqa: ANN001, ANN201
    return openai_client(mesh)


def chat(client, **kw):  # noqa: ANN001, ANN003, ANN201
    return client.chat.completions.create(model="tiny", messages=kw.pop("messages", ASK), tools=TOOLS,
                                          max_tokens=kw.pop("max_tokens", 200), **kw)


def _streamed(chunks) -> tuple[str, list[dict], str | None]:  # noqa: ANN001
    content, calls, reason = "", {}, None
    for c in chunks:
        if not c.choices:
            continue
        d = c.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            slot["name"] += tc.function.name or ""
            slot["arguments"] += tc.function.arguments or ""
        reason = c.choices[0].finish_reason or reason
    return content, [calls[k] for k in sorted(calls)], reason


@pytest.mark.parametrize("seed", range(4))
def test_named_tool_choice_always_gives_valid_arguments(client, seed) -> None:  # noqa: ANN001
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(client, tool_choice=named, temperature=1.0, seed=seed)
    msg = r.choices[0].message
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_") and msg.content is None
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert r.choices[0].finish_reason == "stop"
    content, calls, reason = _streamed(chat(client, tool_choice=named, temperature=1.0, seed=seed, stream=True))
    assert content == "" and [c["name"] for c in calls] == ["get_weather"]
    assert calls[0]["arguments"] == call.function.arguments and reason == "stop"


@pytest.mark.parametrize("seed", range(4))
def test_required_calls_tools_from_the_list_with_valid_arguments(client, seed) -> None:  # noqa: ANN001
    r = chat(client, tool_choice="required", temperature=1.0, seed=seed, max_tokens=800)
    calls, reason = r.choices[0].message.tool_calls, r.choices[0].finish_reason
    assert calls and reason in ("tool_calls", "length"), (r.choices[0].message.content, reason)
    # Parallel calls may go on until max_tokens (a random model need not close the list): then only the last
    # call is cut short, and every call before it is complete and valid.
    complete = calls if reason == "tool_calls" else calls[:-1]
    assert complete
    for c in complete:
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    one = chat(client, tool_choice="required", temperature=1.0, seed=seed, max_tokens=300, parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1


def test_auto_parses_the_models_hermes_tool_calls(client) -> None:  # noqa: ANN001
    # The random model is made to write a tool call the way Qwen does; the parser must find it.
    forced = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "unit": "c"\}\}\n</tool_call>'
    kw = dict(tool_choice="auto", temperature=1.0, seed=2, extra_body={"structured_outputs": {"regex": forced}})
    msg = chat(client, **kw).choices[0]
    assert msg.finish_reason == "tool_calls" and msg.message.content is None
    (call,) = msg.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    content, calls, reason = _streamed(chat(client, stream=True, **kw))
    assert content == "" and reason == "tool_calls" and calls[0]["name"] == "get_weather"
    # Text before the call streams as content; plain text stays content with no calls.
    mixed = r'Sure\. <tool_call>\n\{"name": "get_time", "arguments": \{"zone": 1\}\}\n</tool_call>'
    content, calls, reason = _streamed(chat(client, stream=True, tool_choice="auto", temperature=0,
                                            extra_body={"structured_outputs": {"regex": mixed}}))
    assert content.startswith("Sure.") and calls[0]["name"] == "get_time" and json.loads(calls[0]["arguments"]) == {"zone": 1}
    plain = chat(client, tool_choice="auto", temperature=0, max_tokens=8,
                 extra_body={"structured_outputs": {"regex": "[a-z ]{1,8}"}}).choices[0]
    assert plain.message.tool_calls == [] and plain.message.content and plain.finish_reason != "tool_calls"


def test_tool_turns_render_through_the_template(client) -> None:  # noqa: ANN001
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]
    with_tools = chat(client, messages=history, max_tokens=3, temperature=0)
    without = chat(client, messages=ASK, max_tokens=3, temperature=0)
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens + 20


def test_inconsistent_tool_requests_are_400s(client) -> None:  # noqa: ANN001
    missing = {"type": "function", "function": {"name": "nope"}}
    expect_error(openai.BadRequestError, lambda: chat(client, tool_choice=missing), 400, "tool_choice")
    expect_error(openai.BadRequestError, lambda: client.chat.completions.create(
        model="tiny", messages=ASK, tool_choice="required"), 400, "tool_choice")
    expect_error(openai.BadRequestError, lambda: chat(client, messages=ASK + [{"role": "tool", "content": "x"}]), 400,
                 "messages")
    expect_error(openai.BadRequestError, lambda: client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS + TOOLS[:1]), 400, "tools")
    expect_error(openai.BadRequestError, lambda: client.chat.completions.create(
        model="tiny", messages=ASK, tools=[{"type": "function", "function": {"name": "bad name!"}}]), 400)


# ------------------------------------------------------------------ streamed as generated (issue 26)


def _raw(client, **kw) -> list:  # noqa: ANN001, ANN003
    return [c for c in chat(client, stream=True, **kw)]


def _assert_vllm_shape(chunks: list) -> None:  # noqa: ANN001
    """No chunk without content, a tool-call delta, a finish reason or usage (the role-only opener aside); the
    first delta of each call has index, id, type and name, the later ones only argument fragments."""
    seen: set[int] = set()
    for c in chunks[1:]:
        if not c.choices:
            continue
        ch = c.choices[0]
        assert ch.delta.content or ch.delta.tool_calls or ch.finish_reason or c.usage, c
        for tc in ch.delta.tool_calls or []:
            if tc.index not in seen:
                seen.add(tc.index)
                assert tc.id and tc.type == "function" and tc.function.name, tc
            else:
                assert tc.id is None and tc.function.name is None and tc.function.arguments, tc


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_calls_stream_as_they_are_generated(client, choice) -> None:  # noqa: ANN001
    kw = dict(tool_choice=choice, temperature=1.0, seed=7, max_tokens=400, parallel_tool_calls=False)
    whole = chat(client, **kw)
    chunks = _raw(client, **kw)
    _assert_vllm_shape(chunks)
    content, calls, reason = _streamed(chunks)
    want = whole.choices[0].message.tool_calls
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments) for c in want]
    assert reason == whole.choices[0].finish_reason
    # Many chunks for one call: the arguments arrive as they are generated, not all in the last chunk.
    with_args = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(with_args) >= 5


def test_several_calls_get_indexes_in_order(client) -> None:  # noqa: ANN001
    kw = dict(tool_choice="required", temperature=1.0, seed=3, max_tokens=800)
    whole = chat(client, **kw).choices[0].message.tool_calls
    content, calls, _ = _streamed(_raw(client, **kw))
    assert len(whole) >= 2, "this seed makes the random model call more than once"
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments) for c in whole]


def test_a_call_cut_by_max_tokens_streams_what_was_generated(client) -> None:  # noqa: ANN001
    kw = dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=1.0, seed=1,
              max_tokens=6)
    chunks = _raw(client, **kw)
    content, calls, reason = _streamed(chunks)
    assert reason == "length" and [c["name"] for c in calls] == ["get_weather"] and calls[0]["arguments"]
    whole = chat(client, **kw).choices[0]
    assert whole.finish_reason == "length" and whole.message.tool_calls[0].function.arguments == calls[0]["arguments"]


def test_tool_choice_without_tools_is_a_400(client) -> None:  # noqa: ANN001
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        expect_error(openai.BadRequestError, lambda: client.chat.completions.create(
            model="tiny", messages=ASK, tool_choice=choice), 400, "tool_choice")
    assert client.chat.completions.create(model="tiny", messages=ASK, tool_choice="none", max_tokens=2).choices
