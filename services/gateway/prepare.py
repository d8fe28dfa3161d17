"""OpenAI request -> what the workers need: prompt token ids and one Sampling per choice.

Everything that can reject a request happens here, before anything is published to a worker.
"""
from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass

from pydantic import ValidationError

from services.gateway.context import GatewayContext
from services.gateway.errors import APIError, bad_request, unavailable
from services.gateway.reasoning import ReasoningPlan, plan_reasoning
from services.gateway.tools import ToolPlan, plan_tools
from services.gateway.schemas import MAX_CHOICES, MAX_STOPS, ChatCompletionRequest, ChatMessageIn, CompletionRequest, _Common
from shared import bus, subjects
from shared.protocol import errors as codes
from shared.protocol.generate import Sampling, StructuredSpec
from shared.protocol.tokenizer import ChatMessage, EncodeReply, EncodeRequest, ToolCall, ToolCallFunction
from shared.prompt_check import PromptError, check_prompt, check_token_ids


@dataclass(frozen=True)
class Prepared:
    request_id: str
    prompts: list[list[int]]  # one or more prompts (completions take a list); each runs every sampling
    samplings: list[Sampling]  # one per choice of each prompt (n)
    priority: int
    stops: list[str]
    logprobs: int | None  # None: no logprobs; else how many alternatives per token
    max_tokens: int
    model: str
    echo: list[str] | None = None  # completions' echo: each prompt's text, put before its choices' text
    tools: ToolPlan | None = None  # chat with tools: how the answer's tool calls are made and found
    reasoning: ReasoningPlan | None = None  # chat with a reasoning model: where its <think> text ends

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.prompts[0]

    @property
    def n(self) -> int:
        """Choices in the answer: n per prompt, indexed prompt by prompt (vLLM's order)."""
        return len(self.prompts) * len(self.samplings)


def check_model(ctx: GatewayContext, model: str | None) -> str:
    served = ctx.config.served_model_name
    if model is not None and model != served:
        raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
    return served


async def prepare_completion(ctx: GatewayContext, body: CompletionRequest) -> Prepared:
    model = check_model(ctx, body.model)
    if body.suffix:
        raise bad_request("suffix is not supported: the served model has no infilling template", param="suffix")
    prompt = body.prompt
    # One prompt (a string or token ids) or a batch of them (strings or token-id lists).
    batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
    if not batch:
        raise bad_request("prompt must not be empty", param="prompt", code="empty_prompt")
    if len(batch) * body.n > MAX_CHOICES:
        raise bad_request(f"at most {MAX_CHOICES} choices per request (prompts x n)", param="prompt")
    prompts = []
    for one in batch:
        if isinstance(one, str):
            if not one:
                raise bad_request("prompt must not be empty", param="prompt", code="empty_prompt")
            prompts.append(await encode(ctx, EncodeRequest(prompt=one)))
        else:
            prompts.append(list(one))  # token ids travel as they are; no round trip to the tokenizer
    echo = None
    if body.echo:
        echo = [one if isinstance(one, str) else ctx.tokenizer.decode(one) for one in batch]
    return _finish(ctx, body, model, prompts, body.max_tokens, body.logprobs, echo=echo)


async def prepare_chat(ctx: GatewayContext, body: ChatCompletionRequest) -> Prepared:
    model = check_model(ctx, body.model)
    template = getattr(ctx.tokenizer, "chat_template", None)
    tools = plan_tools(body, template, ctx.config.tool_call_parser)
    if body.continue_final_message and body.add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true (set "
                          "add_generation_prompt to false to continue the final message)", param="continue_final_message")
    if body.continue_final_message and body.messages[-1].role != "assistant":
        raise bad_request("continue_final_message continues the final message, which must be an assistant message",
                          param="continue_final_message")
    # Both are apply_chat_template arguments: they travel with the template's other variables.
    extra = {**({"continue_final_message": True} if body.continue_final_message else {}),
             **({"documents": body.documents} if body.documents is not None else {})}
    template_vars = {**(body.chat_template_kwargs or {}), **extra}
    kwargs = json.dumps(template_vars, ensure_ascii=False) if template_vars else None
    ids = await encode(ctx, EncodeRequest(messages=chat_messages(body.messages),
                                          add_generation_prompt=body.add_generation_prompt,
                                          tools_json=tools.tools_json if tools is not None else None,
                                          template_kwargs_json=kwargs))
    # Where the prompt ends tells whether the template opened a <think> block the output starts inside.
    reasoning = plan_reasoning(template, ctx.tokenizer.decode(ids[-8:]), ctx.config.reasoning_parser)
    constrained = (tools is not None and tools.mode in ("named", "required")) or (
        body.response_format is not None and body.response_format.type != "text")
    if constrained:
        # Forced calls and JSON answers are constrained from the first token, so they hold no reasoning to split
        # off (starting the constraint where reasoning ends, as vLLM does, is not done yet). A raw
        # structured_outputs pattern covers the whole text, reasoning included, and is split as usual.
        reasoning = None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", param="top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    prepared = _finish(ctx, body, model, [ids], max_tokens, logprobs, max_tokens_param=param, tools=tools)
    return dataclasses.replace(prepared, reasoning=reasoning)


def chat_messages(messages: list[ChatMessageIn]) -> list[ChatMessage]:
    # Templates know system/user/assistant/tool; OpenAI's "developer" is the new name for system.
    out = []
    for m in messages:
        if m.role == "tool" and m.tool_calls:
            raise bad_request("only an assistant message may carry tool_calls", param="messages")
        calls = [ToolCall(id=c.id, function=ToolCallFunction(name=c.function.name, arguments=c.function.arguments))
                 for c in m.tool_calls or []] or None
        if m.role == "tool" and not m.tool_call_id:
            raise bad_request("a message with role tool needs tool_call_id", param="messages")
        out.append(ChatMessage(role="system" if m.role == "developer" else m.role, content=m.text(), tool_calls=calls,
                               tool_call_id=m.tool_call_id))
    return out


async def encode(ctx: GatewayContext, req: EncodeRequest, timeout: float | None = None) -> list[int]:
    try:
        # Asked again if the gateway's connection moved servers meanwhile (tokenizing twice is harmless).
        reply = await bus.request_idempotent(ctx.nc, subjects.TOKENIZER_ENCODE, req,
                                             timeout=timeout or ctx.config.tokenizer_timeout_s, expect=EncodeReply)
    except bus.NoRespondersError:
        raise unavailable("no tokenizer service is available", code="no_tokenizer") from None
    except bus.BusTimeout:
        raise unavailable("the tokenizer service did not answer in time", code="tokenizer_timeout") from None
    except bus.RemoteError as e:
        if e.code == codes.BAD_REQUEST:
            raise bad_request(e.message, param="messages" if req.messages is not None else "prompt") from None
        if e.code == codes.OVERLOADED:
            raise unavailable(f"tokenizer: {e.message}") from None
        raise APIError(500, f"tokenizer failed: {e.message}", code=e.code) from None
    return list(reply.token_ids)


def _finish(ctx: GatewayContext, body: _Common, model: str, prompts: list[list[int]], max_tokens: int | None,
            logprobs: int | None, max_tokens_param: str = "max_tokens", echo: list[str] | None = None,
            tools: ToolPlan | None = None) -> Prepared:
    if len(body.stop_list()) > MAX_STOPS:
        raise bad_request(f"at most {MAX_STOPS} stop strings are supported", param="stop")
    vocab = ctx.vocab_size
    limit = ctx.max_model_len()
    room = limit
    for ids in prompts:
        _checked(check_prompt, ids, vocab)  # the context length is judged below, with max_tokens
        room = min(room, limit - len(ids))
    n_prompt = max(len(ids) for ids in prompts)
    if max_tokens is not None:
        if n_prompt + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} in the completion). "
                f"Please reduce the length of the prompt or {max_tokens_param}.",
                param=max_tokens_param, code="context_length_exceeded",
            )
    else:
        if room < 1:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your prompt has {n_prompt} "
                f"tokens, which leaves no room for the completion.",
                param="prompt", code="context_length_exceeded",
            )
        default = ctx.config.default_max_tokens
        max_tokens = min(default, room) if default else room
    if body.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({body.min_tokens}) must not exceed {max_tokens_param} ({max_tokens})",
                          param="min_tokens")
    logit_bias = _logit_bias(body.logit_bias, vocab)
    for name in ("stop_token_ids", "allowed_token_ids"):
        _checked(check_token_ids, getattr(body, name) or [], vocab, name, name)
    if body.allowed_token_ids is not None and not body.allowed_token_ids:
        raise bad_request("allowed_token_ids must not be empty", param="allowed_token_ids")
    structured = (tools.constraint() if tools is not None else None) or structured_spec(body)
    samplings = []
    for i in range(body.n):
        try:
            samplings.append(Sampling(
                max_tokens=max_tokens, min_tokens=body.min_tokens, temperature=body.temperature, top_k=body.top_k,
                top_p=body.top_p, min_p=body.min_p, seed=None if body.seed is None else body.seed + i,
                repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty, ignore_eos=body.ignore_eos, logprobs=logprobs,
                stop_token_ids=list(body.stop_token_ids or []), logit_bias=logit_bias,
                allowed_token_ids=body.allowed_token_ids, structured=structured,
                # echo with logprobs reports the prompt's tokens too.
                prompt_logprobs=logprobs if echo is not None and logprobs is not None else None,
            ))
        except (ValidationError, ValueError) as e:
            raise bad_request(first_message(e)) from None
    return Prepared(
        request_id=uuid.uuid4().hex, prompts=prompts, samplings=samplings, priority=body.priority,
        stops=body.stop_list(), logprobs=logprobs, max_tokens=max_tokens, model=model, echo=echo, tools=tools,
    )


def structured_spec(body: _Common) -> StructuredSpec | None:
    """response_format / vLLM's structured_outputs -> the engine's constraint (compiled, and judged, there)."""
    rf, so = body.response_format, body.structured_outputs
    spec = None
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            spec = StructuredSpec(kind="json_object")
        else:
            if rf.json_schema is None:
                raise bad_request("response_format of type json_schema needs a json_schema", param="response_format")
            spec = StructuredSpec(kind="json_schema", spec=json.dumps(rf.json_schema.schema_))
    sglang = {k: v for k, v in (("regex", body.regex), ("ebnf", body.ebnf), ("json_schema", body.json_schema))
              if v is not None}
    if sglang:
        ((key, value),) = sglang.items() if len(sglang) == 1 else [(None, None)]
        if key is None or spec is not None or so is not None:
            name = next(iter(sglang))
            raise bad_request(f"{name}: give one constraint, among regex, ebnf, json_schema, response_format and "
                              "structured_outputs", param=name)
        if key == "json_schema":
            try:
                json.loads(value)
            except ValueError as e:
                raise bad_request(f"json_schema is not JSON: {e}", param="json_schema") from None
        # ebnf is xgrammar's grammar text (GBNF-style EBNF), what structured_outputs.grammar takes.
        return StructuredSpec(kind={"regex": "regex", "ebnf": "grammar", "json_schema": "json_schema"}[key], spec=value)
    if so is not None:
        given = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                   ("grammar", so.grammar)) if v is not None}
        if len(given) != 1 or spec is not None:
            raise bad_request("structured_outputs takes exactly one of json, regex, choice, grammar, and not "
                              "together with response_format", param="structured_outputs")
        ((key, value),) = given.items()
        if key == "json":
            spec = StructuredSpec(kind="json_schema", spec=value if isinstance(value, str) else json.dumps(value))
        elif key == "choice":
            if not value:
                raise bad_request("structured_outputs.choice must not be empty", param="structured_outputs")
            spec = StructuredSpec(kind="choice", spec=json.dumps(value))
        else:
            spec = StructuredSpec(kind=key, spec=value)
    return spec


def _checked(check, *args) -> None:  # noqa: ANN001
    """A shared/prompt_check.py rule, its PromptError as the OpenAI 400."""
    try:
        check(*args)
    except PromptError as e:
        raise bad_request(e.message, param=e.param, code=e.code) from None


def _logit_bias(raw: dict[str, float] | None, vocab: int) -> dict[int, float] | None:
    """OpenAI's logit_bias: JSON object keys are token ids as strings; values in [-100, 100].

    Every bad key is named in one error (a client fixing them one 400 at a time would need as many calls)."""
    if not raw:
        return None
    out: dict[int, float] = {}
    not_ids, outside, out_of_range = [], [], []
    for key, value in raw.items():
        try:
            token = int(key)
        except ValueError:
            not_ids.append(key)
            continue
        if not 0 <= token < vocab:
            outside.append(token)
        elif not -100 <= value <= 100:
            out_of_range.append(f"{token} ({value:g})")
        else:
            out[token] = float(value)
    problems = []
    if not_ids:
        problems.append("keys that are not token ids: " + ", ".join(repr(k) for k in not_ids))
    if outside:
        problems.append(f"token ids outside the vocabulary [0, {vocab}): " + ", ".join(map(str, outside)))
    if out_of_range:
        problems.append("biases outside [-100, 100] for tokens " + ", ".join(out_of_range))
    if problems:
        code = "invalid_token_id" if outside and not not_ids and not out_of_range else "invalid_value"
        raise bad_request("logit_bias: " + "; ".join(problems), param="logit_bias", code=code)
    return out


def first_message(e: Exception) -> str:
    if isinstance(e, ValidationError) and e.errors():
        return str(e.errors()[0].get("msg", e)).removeprefix("Value error, ")
    return str(e)
