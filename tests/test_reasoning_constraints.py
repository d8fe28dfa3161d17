"""Constraints start after the reasoning (issue 26), as vLLM's reasoning-aware structured outputs: a reasoning
model thinks freely inside `<think>`, and its JSON answer (response_format) or forced tool call (tool_choice
required / named) is constrained from the token after `</think>`; with enable_thinking false the constraint
holds from the first token. And the same reasoning as `thinking` blocks in /v1/messages through the real
`anthropic` SDK.

A tiny checkpoint with Qwen3's thinking template and, as Qwen3's tokenizer has them, `<think>` / `</think>` as
tokens of their own; the random model is made to end its reasoning by a logit_bias on `</think>` (which the
grammar masks once the answer is constrained), or for the Anthropic SDK, which has no logit_bias, by a
checkpoint whose greedy decoding closes the block after a few tokens (end_thinking_early), so every token
goes through the real engine and gateway."""
from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from services.gateway.anthropic_messages import MessagesFormatter
from services.gateway.choice import Delta
from services.gateway.reasoning import ReasoningPlan
from services.gateway.schemas import Usage
from shared.models.demo_tokenizer import cached_byte_bpe, write_tokenizer_files
from tests.checkpoints import VOCAB, Checkpoint, build_checkpoint
from tests.gateway_harness import Mesh, openai_client
from tests.test_reasoning import ASK, THINKING
from tests.test_tools import SCHEMAS, TOOLS, WEATHER, _streamed

ANSWER = {"type": "object", "properties": {"prime": {"enum": ["yes", "no"]}, "digit": {"type": "integer", "minimum": 0,
                                                                                     "maximum": 9}},
          "required": ["prime", "digit"], "additionalProperties": False}
JSON_ANSWER = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
BIAS = 4.0  # on </think>: the random model writes a few tokens of reasoning, then ends it


def thinking_tokenizer() -> Tokenizer:
    """The demo tokenizer with `<think>` and `</think>` placed before the special tokens, so the special tokens keep
    their ids (the checkpoint's EOS among them)."""
    spec = json.loads(cached_byte_bpe(VOCAB - 2).to_str())
    first = min(t["id"] for t in spec["added_tokens"])
    for t in spec["added_tokens"]:
        t["id"] += 2
    for t in spec["post_processor"]["special_tokens"].values():
        t["ids"] = [i + 2 for i in t["ids"]]
    spec["added_tokens"][:0] = [{"id": first + k, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                                 "normalized": False, "special": False} for k, c in enumerate(("<think>", "</think>"))]
    tok = Tokenizer.from_str(json.dumps(spec))
    assert tok.get_vocab_size() == VOCAB and tok.token_to_id("<|pad|>") == VOCAB - 1
    return tok


def end_thinking_early(ckpt: Checkpoint) -> None:
    """Make greedy decoding of ASK close its reasoning after a few tokens: `</think>`'s output row becomes the
    hidden state at one step, scaled so it wins there by a margin and loses at every step before. The Anthropic
    SDK has no logit_bias; this is how a greedy request there reasons and then answers."""
    tok = AutoTokenizer.from_pretrained(ckpt.path)
    ids = tok.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True, return_dict=False)
    model, n = ckpt.hf_model, len(ids)
    seen: dict[str, torch.Tensor] = {}
    hook = model.lm_head.register_forward_hook(lambda _m, args, _out: seen.__setitem__("h", args[0][0]))
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
        logits = model(out).logits[0]
    hook.remove()
    hidden, best = seen["h"], logits.max(-1).values
    for k in range(3, 10):  # the k-th generated token becomes </think>
        h = hidden[n - 1 + k]
        row = h * (best[n - 1 + k] + 1.0) / h.dot(h)
        if bool((hidden[n - 1:n - 1 + k] @ row < best[n - 1:n - 1 + k] - 0.5).all()):
            with torch.no_grad():
                model.lm_head.weight[tok.convert_tokens_to_ids("</think>")] = row
            model.save_pretrained(ckpt.path, max_shard_size="200KB")
            return
    raise AssertionError("no step to end the reasoning at")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):  # noqa: ANN001, ANN201
    ckpt = build_checkpoint("qwen3", tmp_path_factory.mktemp("think") / "qwen3", max_position_embeddings=2048)
    d = ckpt.path
    write_tokenizer_files(thinking_tokenizer(), d, chat_template=THINKING)
    end_thinking_early(ckpt)
    m = Mesh(tmp_path_factory.mktemp("nats"), d)
    try:
        m.start_tokenizer()
        m.start_decoder("d0")
        m.wait_until(lambda: m.gateway.ctx.router.alive())
        yield m
    finally:
        m.close()


@pytest.fixture(scope="module")
def client(mesh):  # noqa: ANN001, ANN201
    return openai_client(mesh)


@pytest.fixture(scope="module")
def end_id(mesh) -> int:  # noqa: ANN001
    (token,) = mesh.gateway.ctx.tokenizer.encode("</think>", add_special_tokens=False)
    return token


def chat(client, end_id: int, seed: int, **kw):  # noqa: ANN001, ANN003, ANN201
    return client.chat.completions.create(model="tiny", messages=ASK, max_tokens=kw.pop("max_tokens", 300),
                                          temperature=1.0, seed=seed, logit_bias={str(end_id): BIAS}, **kw)


def streamed(chunks) -> tuple[str, str]:  # noqa: ANN001
    reasoning, content = "", ""
    for c in chunks:
        if c.choices:
            reasoning += getattr(c.choices[0].delta, "reasoning_content", None) or ""
            content += c.choices[0].delta.content or ""
    return reasoning, content


def test_a_json_answer_is_constrained_after_free_reasoning(client, end_id) -> None:  # noqa: ANN001
    reasoned = 0
    for seed in range(3):
        r = chat(client, end_id, seed, response_format=JSON_ANSWER)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "stop", (msg.reasoning_content, msg.content)
        jsonschema.validate(json.loads(msg.content), ANSWER)
        assert msg.reasoning_content is not None and "</think>" not in msg.reasoning_content
        reasoned += bool(msg.reasoning_content)
        assert 0 < r.usage.completion_tokens_details.reasoning_tokens < r.usage.completion_tokens  # </think> at least
        # Streamed, the same tokens: the same reasoning, then the same answer.
        assert streamed(chat(client, end_id, seed, response_format=JSON_ANSWER, stream=True)) == (
            msg.reasoning_content, msg.content)
    assert reasoned, "some seed reasons before it answers"


def test_without_thinking_the_answer_is_constrained_from_the_start(client, end_id) -> None:  # noqa: ANN001
    r = chat(client, end_id, 0, response_format=JSON_ANSWER, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    msg = r.choices[0].message
    jsonschema.validate(json.loads(msg.content), ANSWER)
    assert msg.reasoning_content is None and r.usage.completion_tokens_details.reasoning_tokens == 0


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_comes_after_the_reasoning(client, end_id, choice) -> None:  # noqa: ANN001
    reasoned = 0
    for seed in range(3):
        kw = dict(tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, max_tokens=400)
        r = chat(client, end_id, seed, **kw).choices[0]
        calls = r.message.tool_calls
        assert len(calls) == 1 and r.message.content is None, (r.message.reasoning_content, r.message.content)
        schema = SCHEMAS[calls[0].function.name] if choice == "required" else WEATHER
        jsonschema.validate(json.loads(calls[0].function.arguments), schema)
        assert r.finish_reason == ("tool_calls" if choice == "required" else "stop")
        reasoned += bool(r.message.reasoning_content)
        chunks = list(chat(client, end_id, seed, stream=True, **kw))
        content, got, reason = _streamed(chunks)
        assert streamed(chunks)[0] == (r.message.reasoning_content or "") and content == ""
        assert [(c["name"], c["arguments"]) for c in got] == [(calls[0].function.name, calls[0].function.arguments)]
        assert reason == r.finish_reason
    assert reasoned, "some seed reasons before it calls"


def test_a_forced_call_cut_while_reasoning_is_no_call(client) -> None:  # noqa: ANN001
    kw = dict(model="tiny", messages=ASK, max_tokens=3, temperature=0, tools=TOOLS,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    r = client.chat.completions.create(**kw).choices[0]  # greedy closes the reasoning later (end_thinking_early)
    assert r.finish_reason == "length" and r.message.reasoning_content and not r.message.tool_calls
    content, calls, reason = _streamed(client.chat.completions.create(stream=True, **kw))
    assert (content, calls, reason) == ("", [], "length")


# ------------------------------------------------------------------ thinking blocks in /v1/messages


@pytest.fixture(scope="module")
def claude(mesh):  # noqa: ANN001, ANN201
    return anthropic.Anthropic(base_url=mesh.url, api_key="unused", max_retries=0, timeout=60)


def ask(claude, **kw):  # noqa: ANN001, ANN003, ANN201
    return claude.messages.create(**(dict(model="tiny", max_tokens=12, extra_body={"temperature": 0},
                                          messages=[{"role": "user", "content": ASK[0]["content"]}]) | kw))


def test_reasoning_is_a_thinking_block_then_text(claude, client) -> None:  # noqa: ANN001
    # Greedy, the model reasons for a few tokens and closes the block (end_thinking_early), then answers.
    chat_r = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=24, temperature=0).choices[0].message
    assert chat_r.reasoning_content and chat_r.content
    for kw in ({}, {"thinking": {"type": "enabled", "budget_tokens": 2048}}):
        m = ask(claude, max_tokens=24, **kw)
        assert [b.type for b in m.content] == ["thinking", "text"]
        assert (m.content[0].thinking, m.content[1].text) == (chat_r.reasoning_content, chat_r.content)
        assert m.content[0].signature == "" and m.stop_reason == "max_tokens" and m.usage.output_tokens == 24
    with claude.messages.stream(model="tiny", max_tokens=24, extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": ASK[0]["content"]}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [(e.index, e.content_block.type) for e in events if e.type == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text")]
    thinking = [e.delta.thinking for e in events if e.type == "content_block_delta" and e.delta.type == "thinking_delta"]
    assert "".join(thinking) == chat_r.reasoning_content and len(thinking) > 1
    stops = [e.index for e in events if e.type == "content_block_stop"]
    assert stops == [0, 1] and events.index(next(e for e in events if e.type == "content_block_stop")) < \
        events.index(next(e for e in events if e.type == "content_block_start" and e.index == 1))
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == [
        ("thinking", chat_r.reasoning_content), ("text", chat_r.content)]


def test_thinking_disabled_reaches_the_template(claude) -> None:  # noqa: ANN001
    on, off = ask(claude), ask(claude, thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"] and off.content[0].text
    assert off.usage.input_tokens > on.usage.input_tokens  # the empty block is in the prompt


@pytest.mark.parametrize("bad", [{"type": "enabled"}, {"type": "enabled", "budget_tokens": 100}, {"type": "sometimes"}])
def test_a_bad_thinking_param_is_a_400(claude, bad) -> None:  # noqa: ANN001
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        ask(claude, thinking=bad)


def test_thinking_then_text_then_tool_use_stream_in_block_order() -> None:
    """The formatter's events for a model that reasons, says something and calls a tool (text given here: the
    mesh's model is only steered to close its reasoning, not to call)."""
    from services.gateway.tools import HermesParser, ToolPlan

    def run(pieces: list[str]) -> tuple[list[dict], dict]:
        plan = ToolPlan("auto", [], parser=HermesParser())
        fmt = MessagesFormatter(None, "tiny", "r", 1, None, tools=plan, prompts=[[1, 2]])
        fmt.reason(ReasoningPlan(starts_inside=True))
        events = []
        for i, p in enumerate(pieces):
            d = Delta(0, text=p, token_ids=[7], finish_reason="stop" if i == len(pieces) - 1 else None)
            events += fmt.chunks(d, True)
        return events, fmt.final(Usage(prompt_tokens=2, completion_tokens=len(pieces), total_tokens=2 + len(pieces)))

    text = 'Hmm, the weather.\n</think>\n\nLet me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    events, final = run([text[i:i + 5] for i in range(0, len(text), 5)])
    starts = [(e["index"], e["content_block"]["type"]) for e in events if e["type"] == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text"), (2, "tool_use")]
    thinking = "".join(e["delta"]["thinking"] for e in events if e["type"] == "content_block_delta"
                       and e["delta"]["type"] == "thinking_delta")
    assert thinking == "Hmm, the weather.\n"
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert stops == [0, 1, 2]
    assert [b["type"] for b in final["content"]] == ["thinking", "text", "tool_use"]
    assert final["content"][0]["thinking"] == thinking and final["content"][1]["text"] == "Let me check."
    assert final["content"][2]["input"] == {"city": "Oslo"} and final["stop_reason"] == "tool_use"
