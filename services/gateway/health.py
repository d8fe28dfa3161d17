"""/health: ready when a tokenizer answers and at least one decode worker is beating.

/health is open to anyone (no API key), so it must not be a way to make the gateway work: a tokenizer's answer
is kept for TOKENIZER_TTL_S, and callers arriving while a round trip is out share it (so the tokenizer never
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
    """Whether a tokenizer answers, asked at most once per TOKENIZER_TTL_S however often /health is called."""

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


async def check_health(ctx: GatewayContext, probe: TokenizerProbe) -> tuple[bool, dict[str, object]]:
    missing: list[str] = []
    tokenizer = await probe.ok()
    if not tokenizer:
        missing.append("tokenizer")
    workers = [w.worker_id for w in ctx.router.alive()]
    if not workers:
        missing.append("decode")
    if ctx.draining:
        missing.append("gateway (shutting down)")
    status: dict[str, object] = {"status": "ok" if not missing else "unavailable", "tokenizer": tokenizer,
                                 "decode_workers": sorted(workers)}
    if missing:
        status["missing"] = missing
    return not missing, status
