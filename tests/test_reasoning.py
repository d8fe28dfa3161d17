"""Reasoning kept apart from the answer (issue 26) through the real openai client against a real mesh: a tiny
checkpoint with a Qwen3-style thinking template (the template opens `<think>` unless enable_thinking is false,
when it writes an empty block), the model's text forced by a regex so it goes through the real engine and
gateway (the mesh runs with --structured-outputs-in-reasoning, so the forcing regex covers the reasoning too;
by default constraints start after it: tests/test_reasoning_constraints.py); reasoning_content in messages
and streamed deltas, reasoning_tokens in usage, tool calls only after the reasoning; and the block-splitting
stream itself fed in random pieces."""
from __future__ import annotations

import json
import random

import openai
import pytest

from services.gateway.reasoning import ReasoningPlan, ReasoningStream, plan_reasoning
from shared.models.demo_tokenizer import DEFAULT_CHAT_TEMPLATE, cached_byte_bpe, write_tokenizer_files
from tests.checkpoints import VOCAB, build_checkpoint
from tests.gateway_harness import Mesh, openai_client
from tests.test_gateway_api import expect_error
from tests.test_tools import TOOLS

# DEFAULT_CHAT_TEMPLATE's generation prompt, then Qwen3's thinking switch.
THINKING = DEFAULT_CHAT_TEMPLATE.replace(
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}",
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and not enable_thinking -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- else -%}{{- '<think>\\n' -}}{%- endif -%}{%- endif -%}")
ASK = [{"role": "user", "content": "Is 7 prime?"}]
THOUGHT = r"Let me check\. 7 has no divisors\.\n</think>\n\nYes, 7 is prime\."


def test_the_template_edit_took() -> None:
    assert THINKING != DEFAULT_CHAT_TEMPLATE and "enable_thinking" in THINKING


@pytest.fixture(scope="module")
def client(tmp_path_factory):  # noqa: ANN001, ANN201
    d = build_checkpoint("qwen3", tmp_path_factory.mktemp("think") / "qwen3", max_position_embeddings=2048).path
    write_tokenizer_files(cached_byte_bpe(VOCAB), d, chat_template=THINKING)
    m = Mesh(tmp_path_factory.mktemp("nats"), d, structured_outputs_in_reasoning=True)
    try:
        m.start_tokenizer()
        m.start_decoder("d0")
        m.wait_until(lambda: m.gateway.ctx.router.alive())
        yield openai_client(m)
    finally:
        m.close()


def chat(client, regex: str, **kw):  # noqa: ANN001, ANN003, ANN201
    return client.chat.completions.create(model="tiny", messages=kw.pop("messages", ASK), max_tokens=kw.pop("max_tokens", 200),
                                          temperature=0, extra_body={"structured_outputs": {"regex": regex},
                                                                     **kw.pop("extra_body", {})}, **kw)


def test_reasoning_is_kept_apart_streamed_and_not(client) -> None:  # noqa: ANN001
    r = chat(client, THOUGHT)
    msg = r.choices[0].message
    assert msg.reasoning_content == "Let me check. 7 has no divisors.\n" and msg.content == "Yes, 7 is prime."
    details = r.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens < r.usage.completion_tokens
    reasoning, content, n_reasoning = "", "", 0
    for c in chat(client, THOUGHT, stream=True, stream_options={"include_usage": True}):
        if not c.choices:
            assert c.usage.completion_tokens_details.reasoning_tokens == details.reasoning_tokens
            continue
        d = c.choices[0].delta
        assert d.role or d.content or getattr(d, "reasoning_content", None) or c.choices[0].finish_reason
        reasoning += getattr(d, "reasoning_content", None) or ""
        content += d.content or ""
        n_reasoning += bool(getattr(d, "reasoning_content", None))
    assert (reasoning, content) == (msg.reasoning_content, msg.content) and n_reasoning > 3


def test_enable_thinking_false_reaches_the_template(client) -> None:  # noqa: ANN001
    on = chat(client, "[a-z]{4}", max_tokens=4)
    off = chat(client, "[a-z]{4}", max_tokens=4, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    # The empty block is in the prompt: longer, and the answer is all content.
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    assert on.choices[0].message.reasoning_content and on.choices[0].message.content == ""
    assert off.choices[0].message.reasoning_content is None and len(off.choices[0].message.content) == 4
    assert off.usage.completion_tokens_details.reasoning_tokens == 0


def test_tool_calls_are_parsed_after_the_reasoning(client) -> None:  # noqa: ANN001
    # A call written inside the reasoning is thinking, not a call; the one after it is.
    text = (r'Maybe <tool_call>\{"name": "get_time", "arguments": \{"zone": 5\}\}</tool_call>\.\n</think>\n\n'
            r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Oslo", "unit": "c"\}\}\n</tool_call>')
    r = chat(client, text, tools=TOOLS, tool_choice="auto").choices[0]
    assert r.finish_reason == "tool_calls" and "get_time" in r.message.reasoning_content
    assert [c.function.name for c in r.message.tool_calls] == ["get_weather"]
    names = [tc.function.name for c in chat(client, text, tools=TOOLS, tool_choice="auto", stream=True)
             for tc in c.choices[0].delta.tool_calls or [] if tc.function.name]
    assert names == ["get_weather"]


def test_bad_chat_template_kwargs_are_400s(client) -> None:  # noqa: ANN001
    for bad in ("on", ["enable_thinking"], 3):
        expect_error(openai.BadRequestError, lambda bad=bad: client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=2, extra_body={"chat_template_kwargs": bad}), 400)


CASES = [(False, "<think>\nhmm </think is> a tag\n</think>\n\nThe answer."), (True, "let me see\n</think>\n\nYes."),
         (False, "No think here."), (True, "cut in the middle </thi"), (False, "  <thin"), (False, "")]


@pytest.mark.parametrize("inside,text", CASES)
def test_the_split_in_pieces_equals_the_whole(inside: bool, text: str) -> None:
    plan = ReasoningPlan(inside)
    whole = plan.split(text)
    for seed in range(20):
        rnd, s, r, c, i = random.Random(seed), ReasoningStream(plan), "", "", 0
        while i < len(text):
            k = rnd.randint(1, 5)
            a, b = s.feed(text[i:i + k], final=i + k >= len(text))
            r, c, i = r + a, c + b, i + k
        assert (r if s.reasoned else None, c) == whole
    assert whole[1] == {"<think>\nhmm </think is> a tag\n</think>\n\nThe answer.": "The answer.",
                        "let me see\n</think>\n\nYes.": "Yes."}.get(text, whole[1])


def test_the_plan_follows_the_template_and_the_flag() -> None:
    assert plan_reasoning("no thinking here", "<|im_start|>assistant\n", None) is None
    assert plan_reasoning(THINKING, "assistant\n<think>\n", None) == ReasoningPlan(starts_inside=True)
    closed = plan_reasoning(THINKING, "<think>\n\n</think>\n\n", None)
    assert closed == ReasoningPlan(starts_inside=False, closed_in_prompt=True) and not closed.may_reason
    assert plan_reasoning(None, "x", "deepseek_r1") == ReasoningPlan(starts_inside=False)
    json.dumps(CASES)


def test_responses_carry_a_reasoning_item(client) -> None:  # noqa: ANN001
    # The template opened the block and the random model never closes it within 8 tokens: all reasoning.
    chat_r = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=8, temperature=0)
    thought = chat_r.choices[0].message.reasoning_content
    assert thought and not chat_r.choices[0].message.content
    r = client.responses.create(model="tiny", input=ASK[0]["content"], max_output_tokens=8, temperature=0)
    assert r.output[0].type == "reasoning" and r.output[0].content[0].text == thought
    assert r.usage.output_tokens_details.reasoning_tokens == 8
    events = list(client.responses.create(model="tiny", input=ASK[0]["content"], max_output_tokens=8, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds.index("response.output_item.added") < kinds.index("response.reasoning_text.delta")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert events[-1].response.output[0].type == "reasoning"


def test_separate_reasoning_false_keeps_the_thinking_in_content(client) -> None:  # noqa: ANN001
    """SGLang's separate_reasoning: false answers the raw text, streamed and not, with no reasoning split."""
    r = chat(client, THOUGHT, extra_body={"separate_reasoning": False})
    msg = r.choices[0].message
    assert msg.content == "Let me check. 7 has no divisors.\n</think>\n\nYes, 7 is prime."
    assert getattr(msg, "reasoning_content", None) is None
    assert r.usage.completion_tokens_details is None or not r.usage.completion_tokens_details.reasoning_tokens
    chunks = list(chat(client, THOUGHT, stream=True, extra_body={"separate_reasoning": False}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert not any((c.choices[0].delta.model_extra or {}).get("reasoning_content") for c in chunks if c.choices)
    for stream in (False, True):
        expect_error(openai.BadRequestError, lambda: chat(client, THOUGHT, stream=stream,
                                                          extra_body={"separate_reasoning": "no"}),
                     400, "separate_reasoning")
