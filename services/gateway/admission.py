"""Admission: the gateway takes at most `max_inflight_requests` generation requests at once.

Every streamed token costs the gateway CPU (routing, detokenizing, stop strings, SSE: ~0.4-0.6 ms per token
measured on a 2-core CPU, issue 25). Admitting more streams than it can carry does not serve more: its event
loop falls behind, workers' load beats are handled late, NATS cuts its connection off as a slow consumer, and
every stream degrades at once. Past the bound a new request gets a fast 429 with Retry-After instead (as TGI
answers past its --max-concurrent-requests), and the streams already admitted keep their pace.
"""
from __future__ import annotations

from services.gateway.context import GatewayContext
from services.gateway.errors import RETRY_AFTER_S, APIError


def admit(ctx: GatewayContext) -> None:
    """Raises a 429 when the gateway already serves its bound. Call after ctx.begin() (which counts this
    request), so the bound is the number of requests served at once."""
    limit = ctx.config.max_inflight_requests
    if limit and ctx.in_flight > limit:
        ctx.metrics.rejected.labels(ctx.metrics.model, "max_inflight_requests").inc()
        raise APIError(429, f"the gateway is serving its limit of {limit} requests at once "
                            "(--max-inflight-requests); retry shortly", code="too_many_requests",
                       headers={"Retry-After": str(RETRY_AFTER_S)})
