"""/health: ready when every served model has a tokenizer that answers and at least one decode worker beating.

/health is open to anyone (no API key), so it must not be a way to make the gateway work: a tokenizer's answer
is kept for TOKENIZER_TTL_S, and callers arriving while a round trip is out share it (so a tokenizer never
sees more than one probe at a time). A failure is not kept: the next call asks again, and /health turns ready
as soon as a tokenizer answers.
"""
from __future__ import annotations

import asyncio
import time

from services.gateway.context import GatewayContext
from services.gateway.prepare import encode
from services.gateway.errors import APIError
from shared.protocol.tokenizer import EncodeRequest

TOKENIZER_TTL_S = 1.0


class TokenizerProbe:
    """Whether a model's tokenizer answers, asked at most once per TOKENIZER_TTL_S however often /health is
    called. `ctx` is the model's view of the gateway context (GatewayContext.for_model)."""

    def __init__(self, ctx: GatewayContext, ttl_s: float = TOKENIZER_TTL_S) -> None:
        self.ctx = ctx
        self.ttl_s = ttl_s
        self.rounds = 0  # tokenizer round trips made (tests read it)
        self._answer: tuple[float, bool] | None = None  # (when, True): the last success
        self._pending: asyncio.Future[bool] | None = None

    async def ok(self) -> bool:
        if self._answer is not None and time.monotonic() - self._answer[0] < self.ttl_s:
            return True
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._ask())
        return await asyncio.shield(self._pending)

    async def _ask(self) -> bool:
        self.rounds += 1
        try:
            # A real tiny encode, not just a $SRV.PING: it proves the endpoint itself works.
            await encode(self.ctx, EncodeRequest(prompt="ok", add_special_tokens=False),
                         timeout=self.ctx.config.health_timeout_s)
            ok = True
        except APIError:
            ok = False
        finally:
            self._pending = None
        self._answer = (time.monotonic(), ok) if ok else None
        return ok


class HealthProbes:
    """One TokenizerProbe a served model."""

    def __init__(self, ctx: GatewayContext) -> None:
        self.by_model = {m.name: TokenizerProbe(ctx.for_model(m.name)) for m in ctx.served}

    @property
    def rounds(self) -> int:
        return sum(p.rounds for p in self.by_model.values())

    @property
    def ttl_s(self) -> float:
        return TOKENIZER_TTL_S


async def check_health(ctx: GatewayContext, probes: HealthProbes) -> tuple[bool, dict[str, object]]:
    views = [ctx.for_model(m.name) for m in ctx.served]
    tokenizers = await asyncio.gather(*(probes.by_model[v.served_model_name].ok() for v in views))
    missing: list[str] = []
    several = len(views) > 1
    pooling = ctx.config.pooling is not None  # a pooling model is served by prefill workers alone
    workers: list[str] = []
    per_model: dict[str, object] = {}
    for view, tokenizer in zip(views, tokenizers):
        alive = view.metrics.prefill_workers.alive() if pooling else view.router.alive()
        own = sorted(w.worker_id for w in alive)
        workers += own
        suffix = f" ({view.served_model_name})" if several else ""
        if not tokenizer:
            missing.append("tokenizer" + suffix)
        if not own:
            missing.append(("pooling worker" if pooling else "decode") + suffix)
        per_model[view.served_model_name] = {"tokenizer": tokenizer, "decode_workers": own}
    if ctx.draining:
        missing.append("gateway (shutting down)")
    status: dict[str, object] = {"status": "ok" if not missing else "unavailable", "tokenizer": all(tokenizers),
                                 "pooling_workers" if pooling else "decode_workers": sorted(workers)}
    if several:
        status["models"] = per_model
    if missing:
        status["missing"] = missing
    return not missing, status
