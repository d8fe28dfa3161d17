"""/health: ready when every served model has a tokenizer that answers and at least one decode worker beating."""
from __future__ import annotations

import asyncio

from services.gateway.context import GatewayContext
from services.gateway.prepare import encode
from services.gateway.errors import APIError
from shared.protocol.tokenizer import EncodeRequest


async def check_health(ctx: GatewayContext) -> tuple[bool, dict[str, object]]:
    views = [ctx.for_model(m.name) for m in ctx.served]
    tokenizers = await asyncio.gather(*(_tokenizer_ok(v) for v in views))
    missing: list[str] = []
    several = len(views) > 1
    workers: list[str] = []
    per_model: dict[str, object] = {}
    for view, tokenizer in zip(views, tokenizers):
        own = sorted(w.worker_id for w in view.router.alive())
        workers += own
        suffix = f" ({view.served_model_name})" if several else ""
        if not tokenizer:
            missing.append("tokenizer" + suffix)
        if not own:
            missing.append("decode" + suffix)
        per_model[view.served_model_name] = {"tokenizer": tokenizer, "decode_workers": own}
    if ctx.draining:
        missing.append("gateway (shutting down)")
    status: dict[str, object] = {"status": "ok" if not missing else "unavailable", "tokenizer": all(tokenizers),
                                 "decode_workers": sorted(workers)}
    if several:
        status["models"] = per_model
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
