"""Server-sent events: each formatter writes its own events (`data: {json}` per chunk, then `data: [DONE]`
for chat and completions; typed `event:` lines for /v1/responses).

An error after the 200 went out cannot change the status any more, so it travels as a chunk
holding the OpenAI error object, followed by [DONE] as usual.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
import anyio
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from services.gateway.context import GatewayContext
from services.gateway.generation import Generation, as_api_error
from services.gateway.formatters import Formatter, usage
from services.gateway.schemas import dump


async def stream_events(ctx: GatewayContext, gen: Generation, fmt: Formatter, include_usage: bool,
                        continuous_usage: bool = False) -> AsyncIterator[str]:
    """The SSE body of an opened generation. Owns the request from here: ends its span and in-flight count.

    The stream is a child span of the request's ("stream"), with an event per SSE chunk that carries
    tokens or a finish reason (OpenTelemetry keeps the first 128 events of a span; the count attribute
    holds them all), so a trace shows when each chunk left.
    """
    stream_span = ctx.tracer.start_span("stream", context=trace.set_span_in_context(gen.span))
    sent = 0
    try:
        try:
            for c in fmt.start_chunks():
                if continuous_usage:  # the role chunk too: nothing generated yet (vLLM)
                    c["usage"] = dump(usage(gen.prompt_tokens, 0, gen.cached_tokens))
                yield fmt.sse(c)
            async for d in gen.deltas():
                for chunk in fmt.chunks(d, include_usage):
                    if continuous_usage:  # vLLM's continuous_usage_stats: running totals in every chunk
                        chunk["usage"] = dump(usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens))
                    sent += 1
                    stream_span.add_event("chunk", {"gen_ai.choice.index": d.index, "kvmesh.chunk.tokens": len(d.token_ids),
                                                    **({"gen_ai.response.finish_reasons": [d.finish_reason]}
                                                       if d.finish_reason else {})})
                    yield fmt.sse(chunk)
            if include_usage:
                yield fmt.sse(fmt.usage_chunk(usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)))
        except Exception as e:  # noqa: BLE001 - every failure becomes an error chunk
            err = as_api_error(e)
            ctx.metrics.error(err.status)
            gen.span.record_exception(e)
            gen.span.set_status(Status(StatusCode.ERROR, err.message))
            gen.span.set_attribute("error.type", err.code or type(e).__name__)
            gen.abort("error")
            yield fmt.sse(fmt.error_chunk(err.body()))
        yield fmt.done
    except BaseException:
        # Cancelled or closed by the server: the client went away mid-stream.
        gen.abort("client disconnected")
        for s in (gen.span, stream_span):
            s.set_attribute("error.type", "cancelled")  # OTel's error.type: why the operation did not complete
            s.set_status(Status(StatusCode.ERROR, "client disconnected"))
        gen.span.add_event("cancelled", {"reason": "client disconnected"})
        raise
    finally:
        stream_span.set_attribute("kvmesh.stream.chunks", sent)
        stream_span.end()
        with anyio.CancelScope(shield=True):
            await gen.close()
        gen.finish()
        gen.span.end()
        ctx.end()
