"""Reasoning kept apart from the answer (issue 26): the <think> block as reasoning_content, streamed as its own
deltas, counted as reasoning_tokens, honouring chat_template_kwargs enable_thinking, a template that opens the
block itself, and tool calls looked for in the answer only. Tiny checkpoints with Qwen3- and DeepSeek-R1-style
templates, their output forced through structured outputs, through the real engine, gateway and openai client."""
from __future__ import annotations

import openai
import pytest

from services.gateway.reasoning import ReasoningStream, split_reasoning
from shared.models.demo_tokenizer import DEFAULT_CHAT_TEMPLATE, cached_byte_bpe, write_tokenizer_files
from tests.checkpoints import VOCAB, build_checkpoint
from tests.gateway_harness import one_decoder_mesh, openai_client
from tests.test_gateway_api import expect_error

GEN = "{{- '<|im_start|>assistant\\n' -}}"
QWEN3 = DEFAULT_CHAT_TEMPLATE.replace(GEN, GEN + "{%- if enable_thinking is defined and enable_thinking is false -%}"
                                      "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}")
DEEPSEEK = DEFAULT_CHAT_TEMPLATE.replace(GEN, GEN + "{{- '<think>\\n' -}}")
ASK = [{"role": "user", "content": "Say hello."}]


def _mesh(tmp_path_factory, name: str, template: str):  # noqa: ANN001, ANN202
    path = build_checkpoint("qwen3", tmp_path_factory.mktemp(name) / "qwen3", max_position_embeddings=2048).path
    write_tokenizer_files(cached_byte_bpe(VOCAB), path, chat_template=template)
    return one_decoder_mesh(tmp_path_factory, name, model_dir=path)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):  # noqa: ANN001, ANN201
    with _mesh(tmp_path_factory, "qwen3-think", QWEN3) as m:
        yield openai_client(m)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):  # noqa: ANN001, ANN201
    with _mesh(tmp_path_factory, "r1-think", DEEPSEEK) as m:
        yield openai_client(m)


def forced(client, regex: str, **kw):  # noqa: ANN001, ANN003, ANN201
    extra = {"structured_outputs": {"regex": regex}, **kw.pop("extra_body", {})}
    return client.chat.completions.create(model="tiny", messages=kw.pop("messages", ASK), temperature=0,
                                          max_tokens=kw.pop("max_tokens", 120), extra_body=extra, **kw)


def streamed(client, regex: str, **kw):  # noqa: ANN001, ANN003, ANN201
    thought, content, usage = "", "", None
    for c in forced(client, regex, stream=True, stream_options={"include_usage": True}, **kw):
        if c.usage:
            usage = c.usage
        for ch in c.choices:
            thought += getattr(ch.delta, "reasoning_content", None) or ""
            content += ch.delta.content or ""
    return thought, content, usage


THINK = r"<think>\nI should greet\.\n</think>\n\nHello there"


def test_the_think_block_is_reasoning_content(qwen3) -> None:  # noqa: ANN001
    r = forced(qwen3, THINK)
    msg = r.choices[0].message
    assert msg.content == "Hello there" and msg.model_extra["reasoning_content"] == "\nI should greet.\n"
    details = r.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens < r.usage.completion_tokens
    thought, content, usage = streamed(qwen3, THINK)
    assert (thought, content) == ("\nI should greet.\n", "Hello there")
    assert usage.completion_tokens_details.reasoning_tokens > 0


def test_enable_thinking_false_through_chat_template_kwargs(qwen3) -> None:  # noqa: ANN001
    on = forced(qwen3, "Hello there")
    off = forced(qwen3, "Hello there", extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens > on.usage.prompt_tokens  # the template wrote the empty block
    assert off.choices[0].message.content == "Hello there"
    assert off.choices[0].message.model_extra["reasoning_content"] is None
    expect_error(openai.BadRequestError, lambda: forced(qwen3, "Hi", extra_body={"chat_template_kwargs": {"tokenize": True}}),
                 400, "chat_template_kwargs")


def test_a_template_that_opens_the_block_starts_inside_it(deepseek) -> None:  # noqa: ANN001
    r = forced(deepseek, r"Thinking\.\n</think>\n\nHello")
    msg = r.choices[0].message
    assert (msg.model_extra["reasoning_content"], msg.content) == ("Thinking.\n", "Hello")
    assert streamed(deepseek, r"Thinking\.\n</think>\n\nHello")[:2] == ("Thinking.\n", "Hello")


def test_tool_calls_are_looked_for_in_the_answer_only(qwen3) -> None:  # noqa: ANN001
    tools = [{"type": "function", "function": {"name": "greet", "parameters": {"type": "object", "properties": {}}}}]
    inside = r'<think>\n<tool_call>\n\{"name": "greet", "arguments": \{\}\}\n</tool_call>\n</think>\n\nHello'
    r = forced(qwen3, inside, tools=tools, tool_choice="auto")
    assert r.choices[0].message.tool_calls == [] and r.choices[0].message.content == "Hello"
    after = r'<think>\nok\n</think>\n\n<tool_call>\n\{"name": "greet", "arguments": \{\}\}\n</tool_call>'
    r = forced(qwen3, after, tools=tools, tool_choice="auto")
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["greet"]
    assert r.choices[0].message.model_extra["reasoning_content"] == "\nok\n"


@pytest.mark.parametrize("starts_inside", [False, True])
def test_the_split_is_the_same_in_any_pieces(starts_inside) -> None:  # noqa: ANN001
    text = ("" if starts_inside else "<think>") + "a < b </thin k>\n</think>\n\nanswer </think> stays"
    whole = split_reasoning(text, starts_inside)
    assert (whole.reasoning, whole.content) == ("a < b </thin k>\n", "answer </think> stays")
    for size in (1, 2, 3, 5):
        s = ReasoningStream(starts_inside)
        parts = [s.feed(text[i:i + size]) for i in range(0, len(text), size)] + [s.finish()]
        assert "".join(p.reasoning for p in parts) == whole.reasoning
        assert "".join(p.content for p in parts) == whole.content
    assert split_reasoning("no block at all", False).content == "no block at all"
