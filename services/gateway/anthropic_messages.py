"""Anthropic's Messages API (`POST /v1/messages`), as SGLang's compatibility layer serves it, so Anthropic SDK
clients work unchanged: text and system prompts, tools (tool_use / tool_result blocks), stop sequences,
streaming events, stop reasons and usage (cache reads included), and a reasoning model's <think> text as
`thinking` blocks (`thinking_delta` events while it streams; the request's `thinking` switches the chat
template's enable_thinking).

Like /v1/responses, a request is translated into the chat completion that computes it (`to_chat`) and runs
through the same path (tokenizer, router, workers); only the request and the output's shape differ here.
Images and documents are refused with 400 (text models only).
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import Field, StrictBool, model_validator

from services.gateway.choice import Delta
from services.gateway.errors import bad_request
from services.gateway.formatters import Formatter
from services.gateway.schemas import ChatCompletionRequest, Usage, _Request
from services.gateway.tools import ParsedCall, ToolPlan, ToolStream

STOP_REASONS = {"length": "max_tokens"}
INT32_MAX = 2**31 - 1


class TextBlock(_Request):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Request):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Request):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: StrictBool = False

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class MediaBlock(_Request):
    """Accepted by the schema only to be refused by name: this is a text model."""
    type: Literal["image", "document"]


class MessageIn(_Request):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock | ToolUseBlock | ToolResultBlock | MediaBlock] = Field(min_length=1)


class ToolDef(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool = False


class ThinkingParam(_Request):
    """Anthropic's extended thinking switch. budget_tokens is checked as Anthropic checks it (at least 1024) but
    bounds nothing here beyond max_tokens: the engine has no thinking budget of its own."""
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(None, ge=1024, le=INT32_MAX)

    @model_validator(mode="after")
    def _budget(self) -> ThinkingParam:
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("thinking of type enabled needs budget_tokens")
        return self


class MessagesRequest(_Request):
    model: str | None = None
    max_tokens: int = Field(ge=1, le=INT32_MAX)  # required, as in Anthropic's API
    messages: list[MessageIn] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: StrictBool = False
    temperature: float = Field(1.0, ge=0, le=1)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, le=INT32_MAX)
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingParam | None = None
    metadata: dict[str, Any] | None = None


def to_chat(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat completion that computes this message."""
    messages: list[dict[str, Any]] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "".join(b.text for b in body.system)
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(body.messages):
        blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        for j, b in enumerate(blocks):
            if isinstance(b, MediaBlock):
                raise bad_request(f"messages[{i}].content[{j}]: {b.type} blocks are not supported by this text model",
                                  param=f"messages[{i}].content[{j}]")
        text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
        if m.role == "assistant":
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in blocks if isinstance(b, ToolUseBlock)]
            messages.append({"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})})
            continue
        # A user turn: its tool results answer the previous assistant's calls, then any text it adds.
        for b in blocks:
            if isinstance(b, ToolResultBlock):
                content = b.text()
                messages.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                 "content": f"Error: {content}" if b.is_error else content})
        if text or not any(isinstance(b, ToolResultBlock) for b in blocks):
            messages.append({"role": "user", "content": text})
    chat: dict[str, Any] = {
        "model": body.model, "messages": messages, "max_tokens": body.max_tokens, "temperature": body.temperature,
        "top_p": body.top_p, "top_k": body.top_k or 0, "stop": body.stop_sequences, "stream": body.stream,
    }
    if body.thinking is not None:
        # Reasoning templates (Qwen3's) switch their <think> block on this; others ignore it, as with vLLM.
        chat["chat_template_kwargs"] = {"enable_thinking": body.thinking.type == "enabled"}
    if body.stream:
        chat["stream_options"] = {"include_usage": True}  # message_delta carries the output tokens
    if body.tools:
        chat["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}} for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise bad_request("tool_choice of type tool needs a name", param="tool_choice.name")
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        chat["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return ChatCompletionRequest.model_validate(chat)


class MessagesFormatter(Formatter):
    """One choice as an Anthropic message: a thinking block when the model reasoned, a text block, then tool_use
    blocks; streamed, each block's index is its place in that order."""

    prefix = "msg"

    def __init__(self, tokenizer, model: str, request_id: str, n: int, logprobs: int | None,  # noqa: ANN001
                 echo: list[str] | None = None, per_prompt: int = 1, tools: ToolPlan | None = None,
                 prompts: list[list[int]] | None = None) -> None:
        super().__init__(tokenizer, model, request_id, n, logprobs, echo, per_prompt, tools, prompts)
        self.id = f"msg_{uuid.uuid4().hex}"
        self._stream = ToolStream(self.tools) if self.tools else None
        self._prompt_tokens = len(prompts[0]) if prompts else 0
        self._text_open = False
        self._text_index = 0
        self._thinking = "none"  # none, open, done: the thinking block, when the model reasons
        self._blocks = 0  # content blocks started so far
        self._calls = False
        self._errored = False

    @staticmethod
    def _tool_block(c: ParsedCall) -> dict[str, Any]:
        try:
            args = json.loads(c.arguments) if c.arguments.strip() else {}
        except json.JSONDecodeError:
            args = {}
        return {"type": "tool_use", "id": f"toolu_{c.id.removeprefix('call_')}", "name": c.name,
                "input": args if isinstance(args, dict) else {"value": args}}

    def _stop(self, finish_reason: str | None, stop_reason: str | None, calls: bool) -> tuple[str, str | None]:
        if calls:
            return "tool_use", None
        if finish_reason == "stop" and isinstance(stop_reason, str):
            return "stop_sequence", stop_reason
        return STOP_REASONS.get(finish_reason or "", "end_turn"), None

    @staticmethod
    def _usage(u: Usage) -> dict[str, int]:
        cached = (u.prompt_tokens_details or {}).get("cached_tokens", 0)
        return {"input_tokens": u.prompt_tokens - cached, "output_tokens": u.completion_tokens,
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}

    def final(self, u: Usage) -> dict[str, Any]:
        a = self._acc[0]
        reasoning, text = self.reasoning.split(a.text) if self.reasoning is not None else (None, a.text)
        content, calls = self.tools.parse(text) if self.tools else (text, [])
        # No signature: nothing here signs thinking (a client passing the block back is not checked either).
        blocks: list[dict[str, Any]] = [{"type": "thinking", "thinking": reasoning, "signature": ""}] if reasoning else []
        blocks += [{"type": "text", "text": content}] if content or not (calls or blocks) else []
        blocks += [self._tool_block(c) for c in calls]
        reason, sequence = self._stop(a.finish_reason, a.stop_reason, bool(calls))
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": blocks,
                "stop_reason": reason, "stop_sequence": sequence, "usage": self._usage(u)}

    # ---- the event stream

    def sse(self, data: dict[str, Any]) -> str:
        return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    @property
    def done(self) -> str:  # type: ignore[override]
        return "" if self._errored else self.sse({"type": "message_stop"})

    def start_chunks(self) -> list[dict[str, Any]]:
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self._prompt_tokens, "output_tokens": 0}}
        return [{"type": "message_start", "message": message}]

    def _thinking_events(self, delta: str, done: bool) -> list[dict[str, Any]]:
        """The reasoning as a thinking block (block 0), closed before the answer's blocks begin."""
        events: list[dict[str, Any]] = []
        if delta and self._thinking == "none":
            self._thinking = "open"
            self._blocks += 1
            events.append({"type": "content_block_start", "index": 0,
                           "content_block": {"type": "thinking", "thinking": "", "signature": ""}})
        if delta:
            events.append({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": delta}})
        if done and self._thinking == "open":
            self._thinking = "done"
            events.append({"type": "content_block_stop", "index": 0})
        return events

    def chunks(self, d: Delta, include_usage: bool) -> list[dict[str, Any]]:
        reasoning, answer = self.add(d)
        text = self._stream.feed(answer) if self._stream else answer
        calls: list[ParsedCall] = []
        if d.finish_reason and self._stream:
            rest, calls = self._stream.finish()
            text += rest
        events = self._thinking_events(reasoning, done=bool(answer or d.finish_reason))
        if text:
            if not self._text_open:
                self._text_open, self._text_index = True, self._blocks
                self._blocks += 1
                events.append({"type": "content_block_start", "index": self._text_index,
                               "content_block": {"type": "text", "text": ""}})
            events.append({"type": "content_block_delta", "index": self._text_index,
                           "delta": {"type": "text_delta", "text": text}})
        if d.finish_reason:
            if self._text_open:
                events.append({"type": "content_block_stop", "index": self._text_index})
            for c in calls:
                block = self._tool_block(c)
                index = self._blocks
                self._blocks += 1
                events += [
                    {"type": "content_block_start", "index": index, "content_block": {**block, "input": {}}},
                    {"type": "content_block_delta", "index": index,
                     "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}},
                    {"type": "content_block_stop", "index": index},
                ]
            self._calls = bool(calls)
        return events

    def usage_chunk(self, u: Usage) -> dict[str, Any]:
        a = self._acc[0]
        reason, sequence = self._stop(a.finish_reason, a.stop_reason, self._calls)
        return {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": self._usage(u)}

    def error_chunk(self, body: dict[str, Any]) -> dict[str, Any]:
        self._errored = True
        err = body.get("error", {})
        kind = "invalid_request_error" if err.get("type") == "invalid_request_error" else "api_error"
        return {"type": "error", "error": {"type": kind, "message": err.get("message", "")}}
