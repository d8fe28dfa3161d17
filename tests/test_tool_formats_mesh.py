"""Qwen3-Coder's XML tool calls and pythonic call lists (issue 26) through the real openai client against a real
mesh, streamed and not: a tiny checkpoint whose chat template teaches the XML form (the format is read from the
template), and one served with --tool-call-parser pythonic. The model's text is forced by a regex, so it goes
through the real engine and gateway; the parsers themselves are tested in tests/test_tool_formats.py."""
from __future__ import annotations

import json

import pytest

from shared.models.demo_tokenizer import DEFAULT_CHAT_TEMPLATE, cached_byte_bpe, write_tokenizer_files
from tests.checkpoints import VOCAB, build_checkpoint
from tests.gateway_harness import Mesh, one_decoder_mesh, openai_client
from tests.test_tools import _assert_vllm_shape, _streamed, chat

# The demo template with Qwen3-Coder's instructions for calls instead of Hermes' JSON.
CODER_TEMPLATE = DEFAULT_CHAT_TEMPLATE.replace(
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}',
    "<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>")
CODER = (r"Let me look\.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n(Paris|Rome)\n</parameter>\n"
         r"<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
         r"<parameter=zone>\n-3\n</parameter>\n</function>\n</tool_call>")
PYTHONIC = r'\[get_weather\(city="(Paris|Rome)", unit="c"\), get_time\(zone=-3\)\]'


def test_the_template_edit_took() -> None:
    assert CODER_TEMPLATE != DEFAULT_CHAT_TEMPLATE and "<parameter=" in CODER_TEMPLATE


@pytest.fixture(scope="module")
def coder(tmp_path_factory):  # noqa: ANN001, ANN201
    d = build_checkpoint("qwen3", tmp_path_factory.mktemp("coder") / "qwen3", max_position_embeddings=2048).path
    write_tokenizer_files(cached_byte_bpe(VOCAB), d, chat_template=CODER_TEMPLATE)
    m = Mesh(tmp_path_factory.mktemp("nats"), d)
    try:
        m.start_tokenizer()
        m.start_decoder("d0")
        m.wait_until(lambda: m.gateway.ctx.router.alive())
        yield openai_client(m)
    finally:
        m.close()


@pytest.fixture(scope="module")
def pythonic(tmp_path_factory):  # noqa: ANN001, ANN201
    with one_decoder_mesh(tmp_path_factory, "pythonic", "qwen3", checkpoint={"max_position_embeddings": 2048},
                          tool_call_parser="pythonic") as m:
        yield openai_client(m)


def forced(client, regex: str, **kw):  # noqa: ANN001, ANN003, ANN201
    return chat(client, tool_choice="auto", temperature=1.0, seed=kw.pop("seed", 3), max_tokens=kw.pop("max_tokens", 400),
                extra_body={"structured_outputs": {"regex": regex}}, **kw)


@pytest.mark.parametrize("fixture,regex,content", [("coder", CODER, "Let me look."), ("pythonic", PYTHONIC, None)])
def test_calls_parse_typed_and_stream_as_they_form(request, fixture, regex, content) -> None:  # noqa: ANN001
    client = request.getfixturevalue(fixture)
    whole = forced(client, regex).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == content
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert [n for n, _ in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0][1]) in ({"city": "Paris", "unit": "c"}, {"city": "Rome", "unit": "c"})
    assert json.loads(calls[1][1]) == {"zone": -3}  # typed by the tool's schema (an integer), not "-3"
    chunks = list(forced(client, regex, stream=True))
    _assert_vllm_shape(chunks)
    streamed_content, streamed, reason = _streamed(chunks)
    assert reason == "tool_calls" and (streamed_content.strip() or None) == content
    assert [(c["name"], c["arguments"]) for c in streamed] == calls
    # The first call's arguments arrive in more than one piece: a parameter at a time.
    pieces = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or [] if tc.index == 0]
    assert len(pieces) >= 2


@pytest.mark.parametrize("fixture,regex", [("coder", CODER), ("pythonic", PYTHONIC)])
def test_a_cut_call_streams_what_was_settled(request, fixture, regex) -> None:  # noqa: ANN001
    client = request.getfixturevalue(fixture)
    full = forced(client, regex)
    cut_at = full.usage.completion_tokens - 6
    _, streamed, reason = _streamed(forced(client, regex, stream=True, max_tokens=cut_at))
    want = [(c.function.name, c.function.arguments) for c in full.choices[0].message.tool_calls]
    assert reason == "length" and streamed[0]["name"] == "get_weather" and streamed[0]["arguments"] == want[0][1]
    for got, (name, args) in zip(streamed, want):
        assert got["name"] == name and args.startswith(got["arguments"])


@pytest.mark.parametrize("fixture,text", [("coder", r"No tools needed <b>\."), ("pythonic", r"\[1, 2\] are numbers"),
                                          ("pythonic", r"\[print\(open\(x\)\)\]")])
def test_text_that_is_not_a_call_stays_content(request, fixture, text) -> None:  # noqa: ANN001
    client = request.getfixturevalue(fixture)
    whole = forced(client, text).choices[0]
    assert whole.message.tool_calls == [] and whole.finish_reason == "stop"
    content, calls, reason = _streamed(forced(client, text, stream=True))
    assert calls == [] and content == whole.message.content == text.replace("\\", "") and reason == "stop"
