"""gateway <-> tokenizer: prompt to token ids, token ids back to text."""
from __future__ import annotations

from typing import ClassVar

from pydantic import model_validator

from shared.wire import Message, WireModel


class ToolCallFunction(WireModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(WireModel):
    id: str
    type: str = "function"
    function: ToolCallFunction


class ChatMessage(WireModel):
    role: str  # "system" | "user" | "assistant" | "tool"
    content: str
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers


class EncodeRequest(Message):
    """Exactly one of prompt, token_ids (passed through, validated) or messages (chat template)."""

    KIND: ClassVar[str] = "tokenizer.encode"

    prompt: str | None = None
    token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True  # only with messages
    # The tokenizer's special tokens (BOS) added to the prompt: None is the default of each input, true for a
    # prompt, false for messages (the chat template writes them; true adds them on top, as vLLM's chat does).
    add_special_tokens: bool | None = None
    # Function tools for the chat template, as a JSON array of OpenAI tool objects (JSON schemas are
    # arbitrarily nested; as text they cross the wire without a schema of their own).
    tools_json: str | None = None
    # Extra chat-template variables (chat_template_kwargs), as a JSON object; text for the same reason.
    template_kwargs_json: str | None = None
    # A Jinja chat template for this request instead of the checkpoint's own (vLLM's and SGLang's chat_template).
    chat_template: str | None = None

    @model_validator(mode="after")
    def _one_input(self) -> EncodeRequest:
        given = sum(x is not None for x in (self.prompt, self.token_ids, self.messages))
        if given != 1:
            raise ValueError("exactly one of prompt, token_ids, messages must be set")
        return self


class EncodeReply(Message):
    KIND: ClassVar[str] = "tokenizer.encode.reply"

    token_ids: list[int]


class DecodeRequest(Message):
    """Batch detokenization, one text per sequence."""

    KIND: ClassVar[str] = "tokenizer.decode"

    sequences: list[list[int]]
    skip_special_tokens: bool = True


class DecodeReply(Message):
    KIND: ClassVar[str] = "tokenizer.decode.reply"

    texts: list[str]
