"""OpenAI request -> what the workers need: prompt token ids and one SamplingParams per choice.

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
from services.gateway.overload import check_beam_cost, check_cost
from services.gateway.sampling import StopRegex, first_message, sampling_params, stop_regexes
from services.gateway.reasoning import END as REASONING_END, ReasoningPlan, plan_reasoning
from services.gateway.tools import ToolPlan, plan_tools
from services.gateway.served_models import model_not_found
from services.gateway.schemas import MAX_CHOICES, MAX_STOPS, ChatCompletionRequest, ChatMessageIn, CompletionRequest, _Common
from shared import bus
from shared.protocol import errors as codes
from shared.sampling_params import SamplingParams
from shared.protocol.tokenizer import ChatMessage, EncodeReply, EncodeRequest, ToolCall, ToolCallFunction
from shared.prompt_check import PromptError, check_prompt
from shared.models.template_args import refused_names


@dataclass(frozen=True)
class BeamSettings:
    width: int  # beams kept each step (best_of, else n); the answer holds the n best
    length_penalty: float


# Fields that steer sampling, which beam search does not do: given with use_beam_search they are a 400
# rather than silently left out.
BEAM_CONFLICTS = ("logit_bias", "bad_words", "allowed_token_ids", "stop", "stop_regex", "response_format",
                  "structured_outputs", "regex", "ebnf", "json_schema", "prompt_logprobs", "tools")


@dataclass(frozen=True)
class Prepared:
    request_id: str
    prompts: list[list[int]]  # one or more prompts (completions take a list); each runs every sampling
    samplings: list[SamplingParams]  # one per choice of each prompt (n)
    priority: int
    stops: list[str]
    logprobs: int | None  # None: no logprobs; else how many alternatives per token
    max_tokens: int
    model: str
    echo: list[str] | None = None  # completions' echo: each prompt's text, put before its choices' text
    tools: ToolPlan | None = None  # chat with tools: how the answer's tool calls are made and found
    reasoning: ReasoningPlan | None = None  # chat with a reasoning model: where its <think> text ends
    stop_regex: list[StopRegex] = dataclasses.field(default_factory=list)  # SGLang's stop_regex
    stream: bool = False  # streamed answer (the stop matcher holds back less)
    beam: BeamSettings | None = None  # use_beam_search (services/gateway/beam_search.py)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.prompts[0]

    @property
    def n(self) -> int:
        """Choices in the answer: n per prompt, indexed prompt by prompt (vLLM's order)."""
        return len(self.prompts) * len(self.samplings)


def check_model(ctx: GatewayContext, model: str | None) -> str:
    """The name the request asked for: the model the request's view serves (GatewayContext.for_model chose it
    from `model`), or one of its LoRA adapters (an adapter's name is a model, as in vLLM)."""
    served = ctx.served_model_name
    if model is not None and model != served and ctx.loras.resolve(model) is None:
        raise model_not_found(model)
    return served if model is None else model


async def prepare_completion(ctx: GatewayContext, body: CompletionRequest) -> Prepared:
    model = check_model(ctx, body.model)
    if body.suffix:
        raise bad_request("suffix is not supported: the served model has no infilling template", param="suffix")
    prompt = body.prompt
    # One prompt (a string or token ids) or a batch of them (strings or token-id lists).
    batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
    if not batch:
        raise bad_request("prompt must not be empty", param="prompt", code="empty_prompt")
    width = max(body.n, body.best_of or 0)  # best_of sequences are computed, n are returned
    if len(batch) * width > MAX_CHOICES:
        raise bad_request(f"at most {MAX_CHOICES} choices per request (prompts x max(n, best_of))", param="prompt")
    prompts = []
    for one in batch:
        if isinstance(one, str):
            if not one:
                raise bad_request("prompt must not be empty", param="prompt", code="empty_prompt")
            prompts.append(await encode(ctx, EncodeRequest(prompt=one, add_special_tokens=body.add_special_tokens)))
        else:
            prompts.append(list(one))  # token ids travel as they are; no round trip to the tokenizer
    echo = None
    if body.echo:
        echo = [one if isinstance(one, str) else ctx.tokenizer.decode(one) for one in batch]
    return _finish(ctx, body, model, prompts, body.max_tokens, body.logprobs, echo=echo)


async def prepare_chat(ctx: GatewayContext, body: ChatCompletionRequest) -> Prepared:
    model = check_model(ctx, body.model)
    if body.chat_template is not None and not ctx.config.trust_request_chat_template:
        raise bad_request("a request's own chat_template is served only when the gateway runs with "
                          "--trust-request-chat-template", param="chat_template", code="chat_template_not_trusted")
    if refused := refused_names(body.chat_template_kwargs or {}):
        raise bad_request(f"chat_template_kwargs may not set {', '.join(refused)}: these are tokenizer arguments, "
                          "not chat template variables", param="chat_template_kwargs")
    template = body.chat_template or getattr(ctx.tokenizer, "chat_template", None)
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
                                          template_kwargs_json=kwargs, chat_template=body.chat_template,
                                          add_special_tokens=body.add_special_tokens),
                     param="chat_template" if body.chat_template else "messages")
    # Where the prompt ends tells whether the template opened a <think> block the output starts inside.
    reasoning = plan_reasoning(template, ctx.tokenizer.decode(ids[-8:]), ctx.config.reasoning_parser)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", param="top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    prepared = _finish(ctx, body, model, [ids], max_tokens, logprobs, max_tokens_param=param, tools=tools)
    samplings = prepared.samplings
    if reasoning is not None and samplings[0].structured is not None:
        if ctx.config.structured_outputs_in_reasoning:
            # The constraint covers the whole output, reasoning included. A forced call or a JSON answer then
            # leaves no room for a <think> block: there is none to split off. A raw structured_outputs
            # pattern may write one itself, and is split as usual.
            if tools is not None and tools.mode in ("named", "required") or (
                    body.response_format is not None and body.response_format.type != "text"):
                reasoning = None
        elif reasoning.may_reason:
            # As vLLM: the model reasons freely; forced calls and structured outputs start after </think>.
            end = ctx.tokenizer.encode(REASONING_END, add_special_tokens=False)
            samplings = [s.model_copy(update={"reasoning_end_ids": end}) for s in samplings]
    return dataclasses.replace(prepared, reasoning=reasoning, samplings=samplings)


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


async def encode(ctx: GatewayContext, req: EncodeRequest, timeout: float | None = None,
                 param: str | None = None) -> list[int]:
    try:
        # Asked again if the gateway's connection moved servers meanwhile (tokenizing twice is harmless).
        reply = await bus.request_idempotent(ctx.nc, ctx.subjects.tokenizer_encode, req,
                                             timeout=timeout or ctx.config.tokenizer_timeout_s, expect=EncodeReply)
    except bus.NoRespondersError:
        raise unavailable("no tokenizer service is available", code="no_tokenizer") from None
    except bus.BusTimeout:
        raise unavailable("the tokenizer service did not answer in time", code="tokenizer_timeout") from None
    except bus.RemoteError as e:
        if e.code == codes.BAD_REQUEST:
            raise bad_request(e.message, param=param or ("messages" if req.messages is not None else "prompt")) from None
        if e.code == codes.OVERLOADED:
            raise unavailable(f"tokenizer: {e.message}") from None
        raise APIError(500, f"tokenizer failed: {e.message}", code=e.code) from None
    return list(reply.token_ids)


def _finish(ctx: GatewayContext, body: _Common, model: str, prompts: list[list[int]], max_tokens: int | None,
            logprobs: int | None, max_tokens_param: str = "max_tokens", echo: list[str] | None = None,
            tools: ToolPlan | None = None) -> Prepared:
    if body.priority != 0 and ctx.config.scheduling_policy != "priority":
        # Any client could otherwise put itself ahead of every other (and stay there): vLLM's rule.
        raise bad_request("priority other than 0 is served only under --scheduling-policy priority",
                          param="priority", code="priority_not_enabled")
    if len(body.stop_list()) > MAX_STOPS:
        raise bad_request(f"at most {MAX_STOPS} stop strings are supported", param="stop")
    vocab = ctx.vocab_size
    limit = ctx.max_model_len()
    if body.truncate_prompt_tokens is not None:
        # vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: the context's length), from the left.
        keep = limit if body.truncate_prompt_tokens == -1 else body.truncate_prompt_tokens
        if keep == 0:
            raise bad_request("truncate_prompt_tokens must be -1 or at least 1", param="truncate_prompt_tokens")
        if keep > limit:
            raise bad_request(f"truncate_prompt_tokens ({keep}) must not exceed the model's maximum context length "
                              f"({limit})", param="truncate_prompt_tokens")
        if any(len(ids) > keep for ids in prompts):
            prompts = [ids[-keep:] for ids in prompts]
            if echo is not None:  # echo shows the prompt the model saw
                echo = [ctx.tokenizer.decode(ids) for ids in prompts]
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
    beam = beam_settings(body)
    check_cost(ctx, prompts, beam.width if beam is not None else body.n, max_tokens, param=max_tokens_param)
    if beam is not None:
        check_beam_cost(ctx, prompts, beam.width, max_tokens)
    try:
        structured = tools.constraint() if tools is not None else None
    except (ValidationError, ValueError) as e:  # a tool's parameters schema too large or too deep
        raise bad_request(first_message(e), param="tools", code="structured_output_too_large") from None
    adapter = ctx.loras.resolve(model)  # a LoRA adapter's name: its requests compute with it (and hash with it)
    samplings = sampling_params(body, max_tokens=max_tokens, logprobs=logprobs, vocab=vocab, echo=echo is not None,
                                structured=structured,
                                encode=lambda text: ctx.tokenizer.encode(text, add_special_tokens=False))
    if adapter is not None:
        samplings = [s.model_copy(update={"lora_name": adapter.name}) for s in samplings]
    return Prepared(
        request_id=uuid.uuid4().hex, prompts=prompts, samplings=samplings, priority=body.priority,
        stops=body.stop_list(), stop_regex=stop_regexes(body), stream=body.stream, beam=beam, logprobs=logprobs, max_tokens=max_tokens, model=model, echo=echo, tools=tools,
    )


def beam_settings(body: _Common) -> BeamSettings | None:
    if body.best_of is not None and body.best_of < body.n:
        raise bad_request(f"best_of ({body.best_of}) must be at least n ({body.n})", param="best_of")
    if not body.use_beam_search:
        if body.best_of is not None and body.best_of != body.n:
            raise bad_request("best_of other than n is served with use_beam_search only", param="best_of")
        if body.length_penalty != 1.0:
            raise bad_request("length_penalty applies to beam search: set use_beam_search", param="length_penalty")
        return None
    for name in BEAM_CONFLICTS:
        value = getattr(body, name, None)
        if value not in (None, [], {}, ""):
            raise bad_request(f"{name} does not apply to beam search (use_beam_search picks by likelihood alone)",
                              param=name)
    return BeamSettings(width=body.best_of or body.n, length_penalty=body.length_penalty)


def _checked(check, *args) -> None:  # noqa: ANN001
    """A shared/prompt_check.py rule, its PromptError as the OpenAI 400."""
    try:
        check(*args)
    except PromptError as e:
        raise bad_request(e.message, param=e.param, code=e.code) from None


