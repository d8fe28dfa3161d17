"""/health: ready when a tokenizer answers and at least one decode worker is beating."""
from __future__ import annotations

from services.gateway.context import GatewayContext
from services.gateway.prepare import encode
from services.gateway.errors import APIError
from shared.protocol.tokenizer import EncodeRequest


async def check_health(ctx: GatewayContext) -> tuple[bool, dict[str, object]]:
    missing: list[str] = []
    tokenizer = await _tokenizer_ok(ctx)
    if not tokenizer:
        missing.append("tokenizer")
    workers = [w.worker_id for w in ctx.router.alive()]
    if ctx.config.pooling is not None:  # a pooling model is served by prefill workers alone
        workers = [b.worker_id for b in ctx.metrics.prefill_workers.alive()]
    if not workers:
        missing.append("decode" if ctx.config.pooling is None else "pooling worker")
    if ctx.draining:
        missing.append("gateway (shutting down)")
    status: dict[str, object] = {"status": "ok" if not missing else "unavailable", "tokenizer": tokenizer,
                                 "decode_workers" if ctx.config.pooling is None else "pooling_workers": sorted(workers)}
    if missing:
        status["missing"] = missing
    return not missing, status


async def _tokenizer_ok(ctx: GatewayContext) -> bool:
    # A real tiny encode, not just a $SRV.PING: it proves the endpoint itself works.
    try:
        await encode(ctx, EncodeRequest(prompt="ok", add_special_tokens=False), timeout=ctx.config.health_timeout_s)
    except APIError:
        return False
    return True
