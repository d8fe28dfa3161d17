"""vLLM's /tokenize and /detokenize, and /version: small endpoints clients use to count and inspect tokens."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from services.gateway.context import GatewayContext
from services.gateway.errors import bad_request
from services.gateway.prepare import chat_messages, encode
from services.gateway.schemas import (DetokenizeRequest, DetokenizeResponse, TokenizeChatRequest,
                                      TokenizeCompletionRequest, TokenizeResponse)
from shared.prompt_check import PromptError, check_token_ids
from shared.protocol.tokenizer import EncodeRequest


async def tokenize_body(ctx: GatewayContext, body: TokenizeChatRequest | TokenizeCompletionRequest) -> TokenizeResponse:
    ctx = ctx.for_model(body.model)
    if isinstance(body, TokenizeChatRequest):
        req = EncodeRequest(messages=chat_messages(body.messages), add_generation_prompt=body.add_generation_prompt)
    else:
        req = EncodeRequest(prompt=body.prompt, add_special_tokens=body.add_special_tokens)
    ids = await encode(ctx, req)
    strs = ctx.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len(), tokens=ids, token_strs=strs)


def detokenize_body(ctx: GatewayContext, body: DetokenizeRequest) -> DetokenizeResponse:
    ctx = ctx.for_model(body.model)
    try:
        check_token_ids(body.tokens, ctx.vocab_size, param="tokens")
    except PromptError as e:
        raise bad_request(e.message, param=e.param, code=e.code) from None
    return DetokenizeResponse(prompt=ctx.tokenizer.decode(body.tokens))


def kvmesh_version() -> str:
    try:
        return version("kvmesh")
    except PackageNotFoundError:  # running from a checkout that was never installed
        return "0+unknown"
