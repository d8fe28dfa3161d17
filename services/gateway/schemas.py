"""OpenAI request and response bodies, as small pydantic models.

Requests ignore unknown fields (as OpenAI-compatible servers commonly do) so newer clients keep
working; the ranges here are the HTTP-facing rules, SamplingParams re-checks what reaches the engine.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from services.gateway.wire_safe import check_sendable
from shared.sampling_params import MAX_SCHEMA_DEPTH, MAX_TOP_LOGPROBS, json_depth

MAX_N = 8
MAX_PRIORITY = 1000
MAX_STOP_CHARS = 1024
MAX_CHOICES = 64  # prompts x n in one completions request
MAX_STOPS = 16


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # The outermost model sees the whole raw body first, so nested models never find anything.
    @model_validator(mode="before")
    @classmethod
    def _sendable(cls, data: Any) -> Any:
        return check_sendable(data)


class StreamOptions(_Request):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM: usage in every chunk, not only the last


class JsonSchemaFormat(_Request):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's response_format."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(_Request):
    """vLLM's structured_outputs extension: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _Common(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # absent: the served model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: StrictBool = False  # "yes" is not a boolean
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    min_tokens: int = Field(0, ge=0)
    # Higher first; honoured only under --scheduling-policy priority (vLLM's rule), else any value but 0 is a 400.
    priority: StrictInt = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    user: str | None = None
    # OpenAI's logit_bias: token id (a string key in JSON) -> bias in [-100, 100].
    logit_bias: dict[str, float] | None = None
    # vLLM's sampling extras.
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # SGLang's spelling of the same constraints, as top-level fields (json_schema: the schema as JSON text).
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | None = None
    # vLLM's older spelling of structured_outputs (guided decoding), still what many clients send.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM: add the tokenizer's special tokens (BOS) to the prompt; chat defaults to false (the template writes them).
    add_special_tokens: StrictBool | None = None
    # vLLM: the prompt's and each choice's token ids in the answer (prompt_token_ids, token_ids).
    return_token_ids: StrictBool = False
    # vLLM: logprobs name tokens "token_id:<id>" (text of split characters is ambiguous, ids are not).
    return_tokens_as_token_ids: StrictBool = False
    # vLLM: the logprob of every prompt token after the first, plus the top-n alternatives of each.
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # vLLM: keep the stop string (or stop token's text) in the output; SGLang's no_stop_trim says the same.
    include_stop_str_in_output: StrictBool = False
    no_stop_trim: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    # vLLM: words the output must never contain (tokenized as written and with a leading space).
    bad_words: list[str] | None = Field(None, max_length=64)
    # vLLM: keep only the prompt's last k tokens (-1: as many as the context holds).
    truncate_prompt_tokens: StrictInt | None = Field(None, ge=-1)
    # SGLang: stop when the output matches one of these regular expressions.
    stop_regex: str | list[str] | None = None
    # vLLM: per-request prefix-cache isolation; requests share cached blocks only with the same salt.
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    # vLLM's beam search: width best_of (default n), the n best beams answered, scored with length_penalty.
    use_beam_search: StrictBool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    length_penalty: float = Field(1.0, ge=-10, le=10)

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _Common:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be given when stream is true")
        return self

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        # Every stop string is looked for in every piece of text the answer makes (their count: prepare.py).
        stops = [v] if isinstance(v, str) else v or []
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop: a stop string may have at most {MAX_STOP_CHARS} characters")
        return v

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.include_usage and self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    # An integer (how many alternatives per token), never a boolean, as vLLM and OpenAI take it.
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: StrictBool = False
    suffix: str | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCallIn(_Request):
    name: str
    arguments: str


class ToolCallIn(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(_Request):
    # Any role the chat template knows (vLLM passes custom roles through, e.g. "ipython" or "document");
    # the five standard ones are checked as OpenAI does, the template judges the rest.
    role: str = Field(min_length=1, max_length=64)
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDef(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _bounded_schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        # A tool's schema becomes a grammar (tool_choice required or named) and a template variable: bounded as
        # structured outputs are (shared/sampling_params.py), before anything serializes it.
        depth = json_depth(v)
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the parameters schema nests {depth} levels deep, more than the {MAX_SCHEMA_DEPTH} "
                             "allowed (objects and arrays each count a level)")
        return v


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Common):
    messages: list[ChatMessageIn] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    # Extra variables for the chat template (e.g. Qwen3's {"enable_thinking": false}), as vLLM and SGLang take them.
    chat_template_kwargs: dict[str, Any] | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: StrictBool = False  # chat: a boolean, the alternatives' count is top_logprobs (0..20)
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: StrictBool = True
    # vLLM's chat extras: continue the final (assistant) message instead of opening a new turn, and
    # documents for templates that render them (RAG templates: a list of {"title", "text"}-like objects).
    continue_final_message: StrictBool = False
    documents: list[dict[str, Any]] | None = None
    # SGLang: false leaves a reasoning model's <think> text in content (no reasoning_content split).
    separate_reasoning: StrictBool = True
    # vLLM: the answer starts with the final message's content when that message is the assistant's (with
    # continue_final_message: the whole assistant message, not only its continuation).
    echo: StrictBool = False
    # vLLM/SGLang: a Jinja chat template for this request instead of the model's own.
    chat_template: str | None = Field(None, min_length=1, max_length=65536)


# ------------------------------------------------------------------------------------ responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None  # {"cached_tokens": n}
    completion_tokens_details: dict[str, int] | None = None  # {"reasoning_tokens": n}, with a reasoning parser


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: the echoed first prompt token
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One entry of vLLM's prompt_logprobs: a prompt token or one of the top alternatives at its position."""

    logprob: float
    rank: int | None = None
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token, None for the first, else {token id: entry} holding the prompt
# token and the top-n alternatives.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None
    # vLLM's return_token_ids: the prompt's ids (on a stream's first chunk of the choice) and the output's.
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    # What ended the choice: vLLM's stop_reason (the stop string or stop token id; null for eos and length)
    # and SGLang's matched_stop (the same, and the eos token id when eos ended it; null on length).
    stop_reason: str | int | None = None
    matched_stop: str | int | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None  # a reasoning model's <think> text (reasoning.py)
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    matched_stop: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # vLLM: one list for the (one) prompt
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids: this chunk's
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # on the chunk that finishes the choice
    matched_stop: str | int | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None  # with prompt_logprobs: on the first chunk that has them
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids: on each choice's first chunk


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvmesh"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field); None for a base model
    max_model_len: int


class TokenizeCompletionRequest(_Request):
    """vLLM's POST /tokenize with a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChatRequest(_Request):
    """vLLM's POST /tokenize with chat messages (rendered through the chat template)."""

    model: str | None = None
    messages: list[ChatMessageIn] = Field(min_length=1)
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")
