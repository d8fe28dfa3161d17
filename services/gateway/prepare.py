"""OpenAI request -> what the workers need: prompt token ids and one Sampling per choice.

Everything that can reject a request happens here, before anything is published to a worker.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass

from pydantic import ValidationError

from services.gateway.context import GatewayContext
from services.gateway.errors import APIError, bad_request, unavailable
from services.gateway.schemas import MAX_STOPS, ChatCompletionRequest, CompletionRequest, _Common
from shared import bus, subjects
from shared.protocol import errors as codes
from shared.protocol.generate import Sampling
from shared.protocol.tokenizer import ChatMessage, EncodeReply, EncodeRequest


@dataclass(frozen=True)
class Prepared:
    request_id: str
    prompt_token_ids: list[int]
    samplings: list[Sampling]  # one per choice
    priority: int
    stops: list[str]
    logprobs: int | None  # None: no logprobs; else how many alternatives per token
    max_tokens: int
    model: str

    @property
    def n(self) -> int:
        return len(self.samplings)


def check_model(ctx: GatewayContext, model: str | None) -> str:
    served = ctx.config.served_model_name
    if model is not None and model != served:
        raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
    return served


async def prepare_completion(ctx: GatewayContext, body: CompletionRequest) -> Prepared:
    model = check_model(ctx, body.model)
    if body.echo:
        raise bad_request("echo is not supported", param="echo")
    if body.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request("batched prompts are not supported: send one prompt per request", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt must not be empty", param="prompt", code="empty_prompt")
        ids = await encode(ctx, EncodeRequest(prompt=prompt))
    else:
        ids = list(prompt)  # token ids travel as they are; no round trip to the tokenizer
    return _finish(ctx, body, model, ids, body.max_tokens, body.logprobs)


async def prepare_chat(ctx: GatewayContext, body: ChatCompletionRequest) -> Prepared:
    model = check_model(ctx, body.model)
    # Templates know system/user/assistant/tool; OpenAI's "developer" is the new name for system.
    messages = [ChatMessage(role="system" if m.role == "developer" else m.role, content=m.text()) for m in body.messages]
    ids = await encode(ctx, EncodeRequest(messages=messages, add_generation_prompt=body.add_generation_prompt))
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", param="top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return _finish(ctx, body, model, ids, max_tokens, logprobs, max_tokens_param=param)


async def encode(ctx: GatewayContext, req: EncodeRequest, timeout: float | None = None) -> list[int]:
    try:
        reply = await bus.request(ctx.nc, subjects.TOKENIZER_ENCODE, req, timeout=timeout or ctx.config.tokenizer_timeout_s,
                                  expect=EncodeReply)
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


def _finish(ctx: GatewayContext, body: _Common, model: str, ids: list[int], max_tokens: int | None,
            logprobs: int | None, max_tokens_param: str = "max_tokens") -> Prepared:
    if len(body.stop_list()) > MAX_STOPS:
        raise bad_request(f"at most {MAX_STOPS} stop strings are supported", param="stop")
    if not ids:
        raise bad_request("prompt must contain at least one token", param="prompt", code="empty_prompt")
    vocab = ctx.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", param="prompt", code="invalid_token_id")
    limit = ctx.max_model_len()
    n_prompt = len(ids)
    if max_tokens is not None:
        if n_prompt + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} in the completion). "
                f"Please reduce the length of the prompt or {max_tokens_param}.",
                param=max_tokens_param, code="context_length_exceeded",
            )
    else:
        room = limit - n_prompt
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
    samplings = []
    for i in range(body.n):
        try:
            samplings.append(Sampling(
                max_tokens=max_tokens, min_tokens=body.min_tokens, temperature=body.temperature, top_k=body.top_k,
                top_p=body.top_p, min_p=body.min_p, seed=None if body.seed is None else body.seed + i,
                repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty, ignore_eos=body.ignore_eos, logprobs=logprobs,
            ))
        except (ValidationError, ValueError) as e:
            raise bad_request(_first_message(e)) from None
    return Prepared(
        request_id=uuid.uuid4().hex, prompt_token_ids=ids, samplings=samplings, priority=body.priority,
        stops=body.stop_list(), logprobs=logprobs, max_tokens=max_tokens, model=model,
    )


def _first_message(e: Exception) -> str:
    if isinstance(e, ValidationError) and e.errors():
        return str(e.errors()[0].get("msg", e)).removeprefix("Value error, ")
    return str(e)
