"""One generation request's scope in the gateway: its span, its place in the in-flight count and its
generation, ended exactly once however the request ends (a whole answer, the last SSE event, an error, the
client leaving). The endpoint opens it; a streamed answer hands it to its SSE body, which then ends it."""
from __future__ import annotations

import anyio
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from services.gateway.beam_search import BeamGeneration
from services.gateway.context import GatewayContext
from services.gateway.errors import APIError
from services.gateway.generation import Generation, as_api_error


class RequestScope:
    def __init__(self, ctx: GatewayContext, span: trace.Span) -> None:
        self.ctx, self.span = ctx, span
        self.gen: Generation | BeamGeneration | None = None  # once the request is routed
        self._closed = False
        ctx.begin()

    def abort(self, reason: str) -> None:
        """Tell the workers to drop whatever of the request still runs."""
        if self.gen is not None:
            self.gen.abort(reason)

    def failed(self, e: BaseException) -> APIError:
        """The request failed: the workers drop it, the span and the metrics record it; the error to answer."""
        err = as_api_error(e)
        self.abort("error")
        self.ctx.metrics.error(err.status)
        self.span.record_exception(e)
        self.span.set_status(Status(StatusCode.ERROR, err.message))
        self.span.set_attribute("error.type", err.code or type(e).__name__)
        return err

    def client_gone(self, *spans: trace.Span) -> None:
        """The client went away: the workers drop the request; it and spans are marked cancelled."""
        self.abort("client disconnected")
        for s in (self.span, *spans):
            s.set_attribute("error.type", "cancelled")  # OTel's error.type: why the operation did not complete
            s.set_status(Status(StatusCode.ERROR, "client disconnected"))
        self.span.add_event("cancelled", {"reason": "client disconnected"})

    async def close(self) -> None:
        """Release the reply inboxes, record the usage, end the span and the in-flight count (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.gen is not None:
            with anyio.CancelScope(shield=True):  # runs to the end even when the request was cancelled
                await self.gen.close()
            self.gen.finish()
        self.span.end()
        self.ctx.end()
