"""Admission: the gateway takes at most `max_inflight_requests` generation requests at once.

Every streamed token costs the gateway CPU (routing, detokenizing, stop strings, SSE: ~0.4-0.6 ms per token
measured on a 2-core CPU). Admitting more streams than it can carry does not serve more: its event
loop falls behind, workers' load beats are handled late, NATS cuts its connection off as a slow consumer, and
every stream degrades at once. Past the bound a new request gets a fast 429 with Retry-After instead (as TGI
answers past its --max-concurrent-requests), and the streams already admitted keep their pace. Retry-After
follows the measured backlog, with jitter, so the refused do not all come back at once
(services/gateway/retry_after.py).

Past a second bound too: while the gateway's own NATS input lags (services/gateway/input_lag.py), which
follows what this machine carries for this workload where a count of streams cannot.

The count is checked twice: before the body is read (services/gateway/intake.py), so a refusal costs next to nothing even
when clients retry in a tight loop, and again once the request is counted (ctx.begin()), which is exact.
"""
from __future__ import annotations

from collections.abc import Sequence

from services.gateway.context import GatewayContext
from services.gateway.errors import APIError, bad_request
from services.gateway.input_lag import FLOOR_FACTOR

# Default bound on one request's work, in context lengths: n=8 full-length choices fit, 64 do not.
REQUEST_COST_CONTEXTS = 16
# Beam search's own bound, in request budgets of context tokens sent (check_beam_cost).
BEAM_RESEND_BUDGETS = 32

# The routes that generate (each one is counted in ctx.in_flight while it runs).
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/generate", "/invocations", "/v1/responses",
                              "/v1/messages", "/v1/score", "/health_generate"})


def admit(ctx: GatewayContext) -> None:
    """Raises a 429 when the gateway already serves its bound. Call after ctx.begin() (which counts this
    request), so the bound is the number of requests served at once."""
    _count_bound(ctx, ctx.in_flight - 1)  # the others: this request is already counted
    _wait_bound(ctx)


def admit_early(ctx: GatewayContext, path: str) -> None:
    """Before the request is parsed or counted (the Intake middleware): the same bound, and the gateway's input
    lag (services/gateway/input_lag.py). The lag is checked here only: a request that passed it is served."""
    if path not in GENERATION_PATHS:
        return
    _count_bound(ctx, ctx.in_flight)  # not counted yet: every request in flight is another
    bound = ctx.config.max_input_lag_s
    if bound and (lag := ctx.input_lag_s()) > bound and lag > (limit := ctx.input_lag_limit_s(bound)):
        # (limit: the bound, or a few times what this machine's scheduling costs the gateway anyway: input_lag.py)
        raise _refused(ctx, "input_lag", f"the gateway is {lag:.2f}s behind its input, more than its bound of "
                                         f"{limit:.2g}s (--max-input-lag {bound:g}, or {FLOOR_FACTOR:g}x the "
                                         f"machine's recent floor)", ctx.retry.for_lag(lag))


def request_cost(prompts: Sequence[Sequence[int]], width: int, max_tokens: int) -> int:
    """Tokens of work one request may ask of the engines: each prompt computed once (its width's sequences
    share its KV through the prefix cache), and each of its `width` sequences (n, best_of or beams) generating up
    to max_tokens."""
    return sum(len(p) + width * max_tokens for p in prompts)


def cost_budget(ctx: GatewayContext) -> int:
    """The most tokens of work one request may ask (--max-request-tokens; default REQUEST_COST_CONTEXTS contexts)."""
    return ctx.config.max_request_tokens or REQUEST_COST_CONTEXTS * ctx.max_model_len()


def check_cost(ctx: GatewayContext, prompts: Sequence[Sequence[int]], width: int, max_tokens: int,
               param: str = "max_tokens") -> None:
    """A 400 naming the figures when one request asks more work than the budget: admitted by what it costs
    (tokens x width), not by counting it as one request among others."""
    cost, budget = request_cost(prompts, width, max_tokens), cost_budget(ctx)
    if cost > budget:
        raise bad_request(f"this request asks for {cost} tokens of work ({len(prompts)} prompt(s) of up to "
                          f"{max(map(len, prompts), default=0)} tokens, {width} sequence(s) each of up to {max_tokens} "
                          f"tokens), more than one request may ({budget}, --max-request-tokens): send fewer prompts, "
                          f"a smaller n/best_of or {param}", param=param, code="request_too_costly")


def check_beam_cost(ctx: GatewayContext, prompts: Sequence[Sequence[int]], width: int, max_tokens: int) -> None:
    """Beam search runs here, one engine step at a time, each step sending every live beam's whole context
    (services/gateway/beam_search.py): tokens sent grow with width x max_tokens x context. A 400 past
    BEAM_RESEND_BUDGETS request budgets of them."""
    sent = sum(width * max_tokens * (len(p) + max_tokens) for p in prompts)
    limit = BEAM_RESEND_BUDGETS * cost_budget(ctx)
    if sent > limit:
        raise bad_request(f"beam search of width {width} over {max_tokens} tokens would send {sent} tokens of "
                          f"context to the engines, more than {limit}: a smaller best_of/n, max_tokens or prompt",
                          param="max_tokens", code="request_too_costly")


def _count_bound(ctx: GatewayContext, others: int) -> None:
    """A 429 when `others` requests in flight already fill --max-inflight-requests (0: no bound)."""
    limit = ctx.config.max_inflight_requests
    if limit and others >= limit:
        raise _refused(ctx, "max_inflight_requests", f"the gateway is serving its limit of {limit} requests at once "
                                                     "(--max-inflight-requests)", ctx.retry.for_count(others))


def _wait_bound(ctx: GatewayContext) -> None:
    """A 429 when the mesh is expected to start this request later than --max-queue-wait
    (services/gateway/queue_wait.py: its requests waiting for a first token / the rate it starts them)."""
    bound = ctx.config.max_queue_wait_s
    if not bound:
        return
    queue = ctx.model.queue
    if (wait := queue.expected_wait_s()) > bound:
        raise _refused(ctx, "queue_wait", f"the mesh is expected to start this request in {wait:.0f}s ({queue.waiting} "
                                          f"requests wait for their first token), more than the bound of {bound:g}s "
                                          "(--max-queue-wait)", ctx.retry.for_wait(wait - bound),
                       code="server_overloaded")


def _refused(ctx: GatewayContext, reason: str, why: str, retry_s: float, code: str = "too_many_requests") -> APIError:
    """A 429 whose Retry-After (and retry-after-ms) follows the backlog, with jitter (services/gateway/retry_after.py)."""
    ctx.metrics.rejected.labels(ctx.metrics.model, reason).inc()
    return APIError(429, f"{why}; retry in {retry_s:.1f}s", code=code, headers=ctx.retry.headers(retry_s))
