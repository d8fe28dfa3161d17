"""The tokenizer service: prompt strings, token-id lists and chat messages to ids; ids back to text.

Stateless (the tokenizer is read-only after loading), so it scales by running more instances in
the same queue group. Tokenization runs in a worker thread: a 200k-token prompt takes long
enough to stall every other request on the event loop otherwise.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
from collections.abc import Sequence

import jinja2
from nats.aio.client import Client
from transformers import PreTrainedTokenizerBase

from services.inflight import InFlight, MicroServiceDrain
from shared import bus, subjects
from services.tokenizer.template_sandbox import SandboxLimits, TemplateRefused, TemplateSandbox
from shared.models.template_args import GATEWAY_ARGUMENTS, template_variables
from shared.models.tokenizer import encode_chat, load_tokenizer
from shared.prompt_check import PromptError, check_token_ids
from shared.protocol import errors as codes
from shared.protocol.tokenizer import DecodeReply, DecodeRequest, EncodeReply, EncodeRequest
from shared.service_runner import Service

log = logging.getLogger(__name__)

VERSION = "0.1.0"
# A tokenizer call cannot be interrupted once it runs (it is native code in a thread), so oversized input
# is refused before it starts: far above any context window, far below what exhausts memory.
DEFAULT_MAX_INPUT_CHARS = 8 << 20


class TokenizerService(MicroServiceDrain, Service):
    name = "tokenizer"

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_input_chars: int = DEFAULT_MAX_INPUT_CHARS,
                 sandbox_limits: SandboxLimits | None = None) -> None:
        self.tokenizer = tokenizer
        # A request's own chat template renders in a limited child process (template_sandbox.py), started on use.
        self.sandbox = TemplateSandbox(str(tokenizer.name_or_path), sandbox_limits or SandboxLimits(
            max_ids=max_input_chars))
        self.max_input_chars = max_input_chars
        # len() counts the added special tokens too; tokenizer.vocab_size does not.
        self.vocab_size = len(tokenizer)
        self._micro: bus.MicroService | None = None
        self._inflight = InFlight()

    async def start(self, nc: Client) -> None:
        track, queue = self._inflight.track, subjects.QUEUE_TOKENIZER
        self._micro = await bus.add_micro_service(
            nc, subjects.SERVICE_TOKENIZER, VERSION,
            [
                bus.Endpoint("encode", subjects.TOKENIZER_ENCODE, queue, track(self.encode), EncodeRequest),
                bus.Endpoint("decode", subjects.TOKENIZER_DECODE, queue, track(self.decode), DecodeRequest),
            ],
            description="prompt <-> token ids",
            metadata={"model": str(self.tokenizer.name_or_path), "vocab_size": str(self.vocab_size)},
        )  # fmt: skip
        await nc.flush()  # the server has our subscriptions once start() returns, so "serving" is true


    # ------------------------------------------------------------------ handlers

    async def encode(self, req: EncodeRequest, ctx: bus.RequestContext) -> EncodeReply:
        if req.token_ids is not None:
            if not req.token_ids:
                raise bus.RemoteError(codes.BAD_REQUEST, "empty prompt: token_ids is an empty list")
            self._check_ids(req.token_ids)
            return EncodeReply(token_ids=req.token_ids)
        if req.prompt is not None and not req.prompt:
            raise bus.RemoteError(codes.BAD_REQUEST, "empty prompt")
        if req.messages is not None and not req.messages:
            raise bus.RemoteError(codes.BAD_REQUEST, "empty prompt: messages is an empty list")
        size = len(req.prompt or "") + len(req.tools_json or "") + len(req.template_kwargs_json or "") + len(req.chat_template or "") + sum(len(m.content) for m in req.messages or [])
        if size > self.max_input_chars:
            raise bus.RemoteError(codes.BAD_REQUEST, f"input of {size} characters exceeds the tokenizer's limit of "
                                                     f"{self.max_input_chars}")
        if req.messages is not None and req.chat_template is not None:
            ids = await self._encode_sandboxed(req)
        else:
            ids = await asyncio.to_thread(self._encode_sync, req)
        if not ids:
            raise bus.RemoteError(codes.BAD_REQUEST, "the prompt encodes to no tokens")
        return EncodeReply(token_ids=ids)

    async def decode(self, req: DecodeRequest, ctx: bus.RequestContext) -> DecodeReply:
        for seq in req.sequences:
            self._check_ids(seq)
        if not req.sequences:
            return DecodeReply(texts=[])
        texts = await asyncio.to_thread(self._decode_sync, req)
        return DecodeReply(texts=texts)

    async def _encode_sandboxed(self, req: EncodeRequest) -> list[int]:
        try:
            return await self.sandbox.encode({
                "messages": [m.model_dump(exclude_none=True) for m in req.messages or []],
                "add_generation_prompt": req.add_generation_prompt, "chat_template": req.chat_template,
                "tools": json.loads(req.tools_json) if req.tools_json else None,
                "kwargs": json.loads(req.template_kwargs_json) if req.template_kwargs_json else None,
                "add_special_tokens": bool(req.add_special_tokens)})
        except (TemplateRefused, ValueError) as e:
            raise bus.RemoteError(codes.BAD_REQUEST, f"chat template: {e}") from None

    async def release(self, remaining_s: float) -> None:
        await super().release(remaining_s)
        await self.sandbox.close()

    # ------------------------------------------------------------------ work (runs in a thread)

    def _encode_sync(self, req: EncodeRequest) -> list[int]:
        if req.messages is not None:
            try:
                tools = json.loads(req.tools_json) if req.tools_json else None
                messages = [m.model_dump(exclude_none=True) for m in req.messages]
                kwargs = json.loads(req.template_kwargs_json) if req.template_kwargs_json else {}
                if not isinstance(kwargs, dict):
                    raise ValueError("template_kwargs_json must be a JSON object")
                # Set by the gateway from the request's own fields; the rest only as the template's variables.
                passthrough = {k: kwargs.pop(k) for k in GATEWAY_ARGUMENTS if k in kwargs}
                kwargs = {**template_variables(self.tokenizer.chat_template, kwargs), **passthrough}
                return encode_chat(self.tokenizer, messages, req.add_generation_prompt, tools, kwargs,
                                   add_special_tokens=bool(req.add_special_tokens))
            except (ValueError, TypeError, jinja2.TemplateError) as e:  # no template, or the template rejects the conversation
                raise bus.RemoteError(codes.BAD_REQUEST, f"chat template: {e}") from None
        return list(self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False))

    def _decode_sync(self, req: DecodeRequest) -> list[str]:
        return list(self.tokenizer.batch_decode(req.sequences, skip_special_tokens=req.skip_special_tokens))

    def _check_ids(self, ids: Sequence[int]) -> None:
        # The fast tokenizer overflows on negative ids and silently drops ids past its vocabulary.
        try:
            check_token_ids(ids, self.vocab_size)
        except PromptError as e:
            raise bus.RemoteError(codes.BAD_REQUEST, e.message) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=os.environ.get("KVMESH_MODEL"), required="KVMESH_MODEL" not in os.environ,
                        help="Hugging Face checkpoint directory with tokenizer.json (env KVMESH_MODEL)")
    parser.add_argument("--max-input-chars", type=int, default=DEFAULT_MAX_INPUT_CHARS,
                        help="longest prompt (characters, chat messages together) the tokenizer takes")


def build(args: argparse.Namespace) -> TokenizerService:
    # Loaded before connecting: a bad model directory fails fast, before the service is announced.
    return TokenizerService(load_tokenizer(args.model), args.max_input_chars)
