"""Server-sent events: each formatter writes its own events (`data: {json}` per chunk, then `data: [DONE]`
for chat and completions; typed `event:` lines for /v1/responses).

An error after the 200 went out cannot change the status any more, so it travels as a chunk
holding the OpenAI error object, followed by [DONE] as usual.

A client that stops reading (or reads slower than tokens come) must not hold the gateway's memory and a place
among the requests in flight for as long as the worker keeps generating: while a write to it waits, the stream's
tokens queue in its reply inbox, which holds a finite number (GatewayConfig.stream_pending_msgs; past it the
stream fails), and a write that waits longer than GatewayConfig.stream_write_timeout_s ends the stream: the
worker is told to drop the request (the SSE body's client_gone) and its place is given back.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from opentelemetry import trace

from services.gateway.choice import IDLE, Delta
from services.gateway.generation import Generation
from services.gateway.formatters import Formatter, usage
from services.gateway.request_scope import RequestScope
from services.gateway.schemas import dump


log = logging.getLogger(__name__)
# A write's time limit: asyncio.timeout (Python 3.11+) arms a timer; wait_for wraps every write in a task of its
# own on 3.11, about twice the event loop's work for a write (5 vs 10 us measured).
_timeout = getattr(asyncio, "timeout", None)


class BoundedStreamingResponse(StreamingResponse):
    """A StreamingResponse whose every write must complete within write_timeout_s; past it the body is closed
    (its generator sees the client as gone) and the response ends unfinished, which closes the connection."""

    def __init__(self, content: AsyncIterator[str], write_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.write_timeout_s = write_timeout_s
        self.stalled = False

    async def stream_response(self, send: Any) -> None:
        async def bounded(message: dict[str, Any]) -> None:
            try:
                if _timeout is None:
                    await asyncio.wait_for(send(message), self.write_timeout_s)
                else:
                    async with _timeout(self.write_timeout_s):
                        await send(message)
            except asyncio.TimeoutError:
                self.stalled = True
                raise
        try:
            await super().stream_response(bounded)
        except asyncio.TimeoutError:
            log.info("ending a stream whose client read nothing for %.0f s", self.write_timeout_s)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()  # at once, not when collected: the worker is told now


# Chunk events recorded on a request's "stream" span: the first ones (time to first tokens, the early rhythm),
# then only the finishing one; the span's attributes count them all. An event per chunk of a long answer cost
# more gateway CPU than anything else tracing does, and OpenTelemetry keeps only 128 per span anyway.
CHUNK_EVENTS = 16
# At most this many SSE chunks in one write (a stream far behind still goes out in pieces).
MAX_COALESCED = 64


async def stream_events(scope: RequestScope, gen: Generation, fmt: Formatter, include_usage: bool,
                        continuous_usage: bool = False) -> AsyncIterator[str]:
    """The SSE body of an opened generation. Owns the request's scope from here, and closes it at the end.

    Chunks that are ready together (the gateway fell behind a stream, or a worker sent several at once) go out in
    one write: the body is yielded whenever the next delta would need a wait (Generation.deltas' IDLE marks), so
    a lone chunk is never held back, and under load the per-write cost (the ASGI server's send, a syscall) is
    paid once for all of them.

    The stream is a child span of the request's ("stream"), with an event for each of the first CHUNK_EVENTS SSE
    chunks that carry tokens or a finish reason, and for the finishing one (attributes: kvmesh.stream.chunks, all
    of them, and kvmesh.stream.writes, the writes they took), so a trace shows when chunks left.
    """
    stream_span = scope.ctx.tracer.start_span("stream", context=trace.set_span_in_context(gen.span))
    sent = writes = 0
    held: list[str] = []
    try:
        try:
            for c in fmt.start_chunks():
                if continuous_usage:  # the role chunk too: nothing generated yet (vLLM)
                    c["usage"] = dump(usage(gen.prompt_tokens, 0, gen.cached_tokens))
                held.append(fmt.sse(c))
            async for d in gen.deltas(idle_marks=True):
                if d is IDLE or len(held) >= MAX_COALESCED:
                    if held:
                        writes += 1
                        yield "".join(held)
                        held.clear()
                    if d is IDLE:
                        continue
                assert isinstance(d, Delta)
                if continuous_usage:  # vLLM's continuous_usage_stats: running totals in every chunk
                    out = []
                    for chunk in fmt.chunks(d, include_usage):
                        chunk["usage"] = dump(usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens))
                        out.append(fmt.sse(chunk))
                else:
                    out = fmt.sse_chunks(d, include_usage)
                for _ in out:
                    sent += 1
                    if sent <= CHUNK_EVENTS or d.finish_reason:
                        stream_span.add_event("chunk", {"gen_ai.choice.index": d.index,
                                                        "kvmesh.chunk.tokens": len(d.token_ids),
                                                        **({"gen_ai.response.finish_reasons": [d.finish_reason]}
                                                           if d.finish_reason else {})})
                held += out
            if include_usage:
                held.append(fmt.sse(fmt.usage_chunk(usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens))))
        except Exception as e:  # noqa: BLE001 - every failure becomes an error chunk
            err = scope.failed(e)
            held.append(fmt.sse(fmt.error_chunk(err.body())))
        held.append(fmt.done)
        writes += 1
        yield "".join(held)
        held.clear()
    except BaseException:
        # Cancelled or closed by the server: the client went away mid-stream.
        scope.client_gone(stream_span)
        raise
    finally:
        stream_span.set_attributes({"kvmesh.stream.chunks": sent, "kvmesh.stream.writes": writes})
        stream_span.end()
        await scope.close()
