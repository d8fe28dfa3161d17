"""OpenAI's /v1/responses, stateless: the request becomes a chat completion (same tokenizer, engine,
structured outputs and tools), the answer is written as a Response object or its typed stream events
(response.created ... response.output_text.delta ... response.completed).

Nothing is stored: `store` is accepted but a response cannot be fetched later, and `previous_response_id`
is a 400 (the conversation must be sent as `input`).
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field, StrictBool

from services.gateway.choice import Delta
from services.gateway.errors import bad_request
from services.gateway.formatters import Formatter
from services.gateway.schemas import (ChatCompletionRequest, JsonSchemaFormat, ResponseFormat, Usage, _Request)
from services.gateway.tools import ParsedCall, ToolPlan, ToolStream

# ------------------------------------------------------------------------------------------- request


class InputText(_Request):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Request):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Request):
    format: TextFormat | None = None


class FunctionTool(_Request):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class FunctionChoice(_Request):
    type: Literal["function"]
    name: str


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[InputMessage | FunctionCallItem | FunctionCallOutputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stream: StrictBool = False
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: StrictBool = True
    store: StrictBool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)  # vLLM's extra


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion that computes this response (400 for what the stateless server cannot do)."""
    if body.previous_response_id is not None:
        raise bad_request("previous_response_id is not supported: kvmesh stores no responses; send the "
                          "conversation as input", param="previous_response_id")
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    items = [InputMessage(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    if not items:
        raise bad_request("input must not be empty", param="input")
    for item in items:
        if isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls") is not None:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    chat: dict[str, Any] = {
        "model": body.model, "messages": messages, "max_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream, "seed": body.seed,
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    if body.stream:
        chat["stream_options"] = {"include_usage": True}  # response.completed carries the usage
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_object":
        chat["response_format"] = ResponseFormat(type="json_object")
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise bad_request("text.format of type json_schema needs a schema", param="text.format")
        chat["response_format"] = ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
            name=fmt.name, schema=fmt.schema_, strict=fmt.strict))
    if body.tools:
        chat["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.parameters, "strict": t.strict}}
                         for t in body.tools]
    choice = body.tool_choice
    if isinstance(choice, FunctionChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        chat["tool_choice"] = choice
    return ChatCompletionRequest.model_validate(chat)


# ------------------------------------------------------------------------------------------- response


class ResponsesFormatter(Formatter):
    """One choice (n = 1) as a Response: a message item with output text, then any function_call items."""

    prefix = "resp"
    done = ""  # the Responses stream ends with response.completed, no [DONE]

    def __init__(self, tokenizer, model: str, request_id: str, n: int, logprobs: int | None,  # noqa: ANN001
                 echo: list[str] | None = None, per_prompt: int = 1, tools: ToolPlan | None = None,
                 prompts: list[list[int]] | None = None, request: ResponsesRequest | None = None) -> None:
        super().__init__(tokenizer, model, request_id, n, logprobs, echo, per_prompt)
        self.request = request
        self.tools = tools if tools is not None and tools.mode != "none" else None
        self._stream = ToolStream(self.tools) if self.tools else None
        self.msg_id = f"msg_{uuid.uuid4().hex}"
        self._seq = 0
        self._text = ""  # text sent as output_text so far
        self._opened = False  # the message item has been announced
        self._closed = False  # ... and completed
        self._calls: list[ParsedCall] = []  # the calls streamed so far, arguments as far as generated
        self.rs_id = f"rs_{uuid.uuid4().hex}"
        self._reasoning = ""  # reasoning text streamed so far
        self._reasoning_state = "none"  # none, open, done: the reasoning item (output 0) when there is one

    # ---- the Response object

    def _response(self, status: str, output: list[dict[str, Any]], u: Usage | None = None,
                  reason: str | None = None) -> dict[str, Any]:
        r = self.request
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if reason == "length" else None,
            "instructions": r.instructions if r else None, "max_output_tokens": r.max_output_tokens if r else None,
            "temperature": r.temperature if r else 1.0, "top_p": r.top_p if r else 1.0,
            "parallel_tool_calls": r.parallel_tool_calls if r else True,
            "tool_choice": (r.tool_choice.model_dump() if isinstance(r.tool_choice, BaseModel) else r.tool_choice or "auto")
            if r else "auto",
            "tools": [t.model_dump(mode="json") for t in r.tools or []] if r else [],
            "text": {"format": r.text.format.model_dump(mode="json", by_alias=True)} if r and r.text and r.text.format
            else {"format": {"type": "text"}},
            "store": r.store if r else False, "metadata": (r.metadata if r else None) or {},
            "previous_response_id": None, "reasoning": None, "truncation": "disabled", "user": r.user if r else None,
            "usage": None if u is None else {
                "input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens, "total_tokens": u.total_tokens,
                "input_tokens_details": {"cached_tokens": (u.prompt_tokens_details or {}).get("cached_tokens", 0)},
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens}},
        }

    def _message_item(self, text: str, status: str) -> dict[str, Any]:
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    @staticmethod
    def _call_item(c: ParsedCall) -> dict[str, Any]:
        return {"type": "function_call", "id": f"fc_{c.id.removeprefix('call_')}", "call_id": c.id, "name": c.name,
                "arguments": c.arguments, "status": "completed"}

    def _split(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        return self.tools.parse(text) if self.tools else (text, [])

    def final(self, u: Usage) -> dict[str, Any]:
        a = self._acc[0]
        reasoning, text = self.reasoning.split(a.text) if self.reasoning is not None else (None, a.text)
        content, calls = self.tools.parse(text) if self.tools else (text, [])
        if self._calls:  # streamed: the items the client saw, same ids and the arguments as generated
            content, calls = (self._text or None), self._calls
        output = [self._reasoning_item(reasoning, "completed")] if reasoning is not None else []
        output += [self._message_item(content, "completed")] if content or not (calls or reasoning) else []
        output += [self._call_item(c) for c in calls]
        status = "incomplete" if a.finish_reason == "length" else "completed"
        return self._response(status, output, u, a.finish_reason)

    # ---- the event stream

    def sse(self, data: dict[str, Any]) -> str:
        return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def _event(self, type_: str, **fields: Any) -> dict[str, Any]:
        self._seq += 1
        return {"type": type_, "sequence_number": self._seq - 1, **fields}

    def start_chunks(self) -> list[dict[str, Any]]:
        shell = self._response("in_progress", [])
        return [self._event("response.created", response=shell), self._event("response.in_progress", response=shell)]

    def _open_message(self) -> list[dict[str, Any]]:
        if self._opened:
            return []
        self._opened = True
        return [self._event("response.output_item.added", output_index=self._msg_index, item={**self._message_item("", "in_progress"),
                                                                                 "content": []}),
                self._event("response.content_part.added", item_id=self.msg_id, output_index=self._msg_index, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []})]

    @property
    def _msg_index(self) -> int:
        return 0 if self._reasoning_state == "none" else 1

    @property
    def _calls_index(self) -> int:
        return self._msg_index + (1 if self._opened else 0)

    def _reasoning_item(self, text: str, status: str) -> dict[str, Any]:
        return {"type": "reasoning", "id": self.rs_id, "status": status, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}] if text else []}

    def _reasoning_events(self, delta: str, done: bool) -> list[dict[str, Any]]:
        """A reasoning model's <think> text as its own output item (reasoning.py), before the answer's items."""
        events = []
        if delta and self._reasoning_state == "none":
            self._reasoning_state = "open"
            events.append(self._event("response.output_item.added", output_index=0,
                                      item=self._reasoning_item("", "in_progress")))
        if delta:
            self._reasoning += delta
            events.append(self._event("response.reasoning_text.delta", item_id=self.rs_id, output_index=0,
                                      content_index=0, delta=delta))
        if done and self._reasoning_state == "open":
            self._reasoning_state = "done"
            events += [self._event("response.reasoning_text.done", item_id=self.rs_id, output_index=0, content_index=0,
                                   text=self._reasoning),
                       self._event("response.output_item.done", output_index=0,
                                   item=self._reasoning_item(self._reasoning, "completed"))]
        return events

    def _close_message(self) -> list[dict[str, Any]]:
        if not self._opened or self._closed:
            return []
        self._closed = True
        return [
            self._event("response.output_text.done", item_id=self.msg_id, output_index=self._msg_index, content_index=0,
                        text=self._text),
            self._event("response.content_part.done", item_id=self.msg_id, output_index=self._msg_index, content_index=0,
                        part={"type": "output_text", "text": self._text, "annotations": []}),
            self._event("response.output_item.done", output_index=self._msg_index,
                        item=self._message_item(self._text, "completed")),
        ]

    def chunks(self, d: Delta, include_usage: bool) -> list[dict[str, Any]]:
        # Function calls stream as they form, as in chat (call_scanner.py): an in-progress function_call item once
        # the name is known, then argument delta events; each item is completed when the response ends.
        reasoning, answer = self.add(d)
        events = self._reasoning_events(reasoning, done=bool(answer or d.finish_reason))
        calls: list = []
        if self._stream is not None:
            text, calls = self._stream.feed_calls(answer)
            if d.finish_reason:
                text += self._stream.finish_calls()
        else:
            text = answer
        if text and not self._calls:
            events += self._open_message()
            self._text += text
            events.append(self._event("response.output_text.delta", item_id=self.msg_id, output_index=self._msg_index,
                                      content_index=0, delta=text))
        for c in calls:
            if c.name is not None:
                events += self._close_message()  # a message before the calls is over when the first call begins
                call = ParsedCall(c.name, "", id=self._stream.ids[c.index])
                self._calls.append(call)
                k = len(self._calls) - 1 + self._calls_index
                events.append(self._event("response.output_item.added", output_index=k,
                                          item={**self._call_item(call), "status": "in_progress"}))
            call = self._calls[c.index]
            if c.arguments:
                self._calls[c.index] = ParsedCall(call.name, call.arguments + c.arguments, id=call.id)
                events.append(self._event("response.function_call_arguments.delta", item_id=self._call_item(call)["id"],
                                          output_index=c.index + self._calls_index, delta=c.arguments))
        if d.finish_reason:
            events += self._close_message()
            for k, c in enumerate(self._calls, start=self._calls_index):
                item = self._call_item(c)
                events += [
                    self._event("response.function_call_arguments.done", item_id=item["id"], output_index=k,
                                arguments=c.arguments),
                    self._event("response.output_item.done", output_index=k, item=item),
                ]
        return events

    def usage_chunk(self, u: Usage) -> dict[str, Any]:
        final = self.final(u)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return self._event(kind, response=final)

    def error_chunk(self, body: dict[str, Any]) -> dict[str, Any]:
        err = body.get("error", {})
        return self._event("error", code=err.get("code"), message=err.get("message"), param=err.get("param"))
