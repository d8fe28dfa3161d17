"""Server-sent events: each formatter writes its own events (`data: {json}` per chunk, then `data: [DONE]`
for chat and completions; typed `event:` lines for /v1/responses).

An error after the 200 went out cannot change the status any more, so it travels as a chunk
holding the OpenAI error object, followed by [DONE] as usual.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
import anyio
from opentelemetry.trace import Status, StatusCode

from services.gateway.context import GatewayContext
from services.gateway.generation import Generation, as_api_error
from services.gateway.formatters import Formatter, usage
from services.gateway.schemas import dump


async def stream_events(ctx: GatewayContext, gen: Generation, fmt: Formatter, include_usage: bool,
                        continuous_usage: bool = False) -> AsyncIterator[str]:
    """The SSE body of an opened generation. Owns the request from here: ends its span and in-flight count."""
    try:
        try:
            for c in fmt.start_chunks():
                yield fmt.sse(c)
            async for d in gen.deltas():
                for chunk in fmt.chunks(d, include_usage):
                    if continuous_usage:  # vLLM's continuous_usage_stats: running totals in every chunk
                        chunk["usage"] = dump(usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens))
                    yield fmt.sse(chunk)
            if include_usage:
                yield fmt.sse(fmt.usage_chunk(usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)))
        except Exception as e:  # noqa: BLE001 - every failure becomes an error chunk
            err = as_api_error(e)
            ctx.metrics.error(err.status)
            gen.span.record_exception(e)
            gen.span.set_status(Status(StatusCode.ERROR, err.message))
            gen.abort("error")
            yield fmt.sse(fmt.error_chunk(err.body()))
        yield fmt.done
    except BaseException:
        # Cancelled or closed by the server: the client went away mid-stream.
        gen.abort("client disconnected")
        raise
    finally:
        with anyio.CancelScope(shield=True):
            await gen.close()
        gen.finish()
        gen.span.end()
        ctx.end()

