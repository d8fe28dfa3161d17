"""One generation request over HTTP: validate, tokenize, route, generate, answer (whole or SSE).

The client going away at any point cancels the request in the workers: a streamed response
notices through Starlette's disconnect listener (the SSE generator is cancelled), a whole one
through a watcher on the ASGI receive channel.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace

from services.gateway.auth import scoped_to_caller
from services.gateway.pooling_mode import not_generative
from services.gateway.overload import admit
from services.gateway.context import GatewayContext
from services.gateway.errors import unavailable
from services.gateway.beam_search import BeamGeneration
from services.gateway.generation import Generation
from services.gateway.prepare import Prepared
from services.gateway.formatters import Formatter, usage
from services.gateway.request_scope import RequestScope
from services.gateway.schemas import ChatCompletionRequest, _Common
from services.gateway.streaming import BoundedStreamingResponse, stream_events

B = TypeVar("B", bound=_Common)
T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's convention; nobody reads it, but logs and metrics do


class ClientGone(Exception):
    pass


async def serve_generation(ctx: GatewayContext, request: Request, body: B, route: str,
                           prepare: Callable[[GatewayContext, B], Awaitable[Prepared]],
                           formatter: type[Formatter]) -> Response:
    if ctx.config.pooling is not None:
        raise not_generative(ctx, route)
    arrival = time.monotonic()
    ctx = ctx.for_model(body.model)  # the model's own tokenizer and workers; 404 model_not_found for an unknown one
    operation = "text_completion" if route in ("/v1/completions", "/generate") else "chat"
    model = ctx.served_model_name
    # GenAI semantic conventions name the span "{operation} {model}".
    span = ctx.tracer.start_span(f"{operation} {model}", kind=trace.SpanKind.SERVER, attributes={
        "gen_ai.operation.name": operation, "gen_ai.request.model": model, "http.route": route,
        "gen_ai.provider.name": "kvmesh", "gen_ai.request.temperature": body.temperature,
        "gen_ai.request.top_p": body.top_p, "gen_ai.request.choice.count": body.n,
        "gen_ai.request.stream": bool(body.stream),
    })
    if body.seed is not None:
        span.set_attribute("gen_ai.request.seed", body.seed)
    if body.max_tokens is not None:
        span.set_attribute("gen_ai.request.max_tokens", body.max_tokens)
    scope = RequestScope(ctx, span)
    streaming = False
    try:
        if ctx.draining:
            raise unavailable("the gateway is shutting down", code="shutting_down")
        admit(ctx)

        async def start() -> Generation | BeamGeneration:
            with trace.use_span(span, end_on_exit=False):  # tokenizer and decode spans become children
                prepared = scoped_to_caller(await prepare(ctx, body), request)
            span.set_attribute("gen_ai.request.max_tokens", prepared.max_tokens)
            span.set_attribute("kvmesh.request_id", prepared.request_id)
            span.set_attribute("gen_ai.response.model", prepared.model)
            span.set_attribute("gen_ai.response.id", prepared.request_id)
            # use_beam_search: the search runs here, step by step (services/gateway/beam_search.py).
            gen = (BeamGeneration if prepared.beam is not None else Generation)(ctx, prepared, span, arrival)
            scope.gen = gen
            await gen.open()
            return gen

        opened = await _unless_disconnected(request, start())
        p = opened.prepared
        fmt = formatter(ctx.tokenizer, p.model, p.request_id, p.n, p.logprobs, echo=p.echo, per_prompt=len(p.samplings),
                        tools=p.tools, prompts=p.prompts)
        fmt.tokens_as_ids = body.return_tokens_as_token_ids
        fmt.prompt_logprobs = body.prompt_logprobs
        fmt.return_token_ids = body.return_token_ids
        if isinstance(body, ChatCompletionRequest) and body.echo and body.messages[-1].role == "assistant":
            fmt.echo_message = body.messages[-1].text()
        if p.reasoning is not None and getattr(body, "separate_reasoning", True):
            fmt.reason(p.reasoning)
        if body.stream:
            streaming = True  # from here the SSE body owns the request's scope
            return BoundedStreamingResponse(stream_events(scope, opened, fmt, body.include_usage, body.continuous_usage),
                                     ctx.config.stream_write_timeout_s, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        async def collect() -> JSONResponse:
            async for d in opened.deltas():
                fmt.add(d)
            return JSONResponse(fmt.final(usage(opened.prompt_tokens, opened.completion_tokens, opened.cached_tokens)))

        return await _unless_disconnected(request, collect())
    except ClientGone:
        scope.client_gone()
        return Response(status_code=CLIENT_CLOSED)
    except Exception as e:  # noqa: BLE001 - every failure is an OpenAI error object
        return scope.failed(e).response()
    except BaseException:
        scope.abort("request cancelled")
        raise
    finally:
        if not streaming:
            await scope.close()


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Runs `work`, raising ClientGone (and cancelling it) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if not task.done() or task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnected(request: Request) -> None:
    # The body has been read already, so the next ASGI message can only be the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
