"""What an external router or dashboard asks of a serving endpoint, as SGLang's /get_load and
/get_server_info give it: waiting and running requests and KV usage, per worker and in total.

Everything comes from the workers' load beats (the same figures the router scores with), so it lags
the engines by at most a beat; a worker is listed while it beats.
"""
from __future__ import annotations

from typing import Any

from services.gateway.context import GatewayContext
from services.gateway.observed_load import ObservedLoad
from services.gateway.tokenize import kvmesh_version
from shared.protocol.events import LoadBeat


def _worker(beat: LoadBeat) -> dict[str, Any]:
    used = beat.total_blocks - beat.free_blocks
    return {
        "worker_id": beat.worker_id, "role": beat.role,
        "num_running_reqs": beat.running, "num_waiting_reqs": beat.waiting,
        # SGLang's num_reqs is running + waiting; num_tokens the KV tokens in use.
        "num_reqs": beat.running + beat.waiting, "num_tokens": used * beat.block_size,
        "kv_usage": used / beat.total_blocks if beat.total_blocks else 0.0,
        "free_blocks": beat.free_blocks, "total_blocks": beat.total_blocks, "block_size": beat.block_size,
    }


def _observed(o: ObservedLoad | None) -> dict[str, Any]:
    """What this gateway itself saw of a decode worker (services/gateway/observed_load.py): what the router weighs."""
    if o is None:
        return {}
    return {"gateway_routed": o.routed, "gateway_in_flight": len(o.flights),
            "observed_ttft_s": o.ttft.value, "observed_token_gap_s": o.gap.value}


def _beats(ctx: GatewayContext) -> tuple[list[LoadBeat], list[LoadBeat]]:
    """Every served model's decode and prefill workers (worker ids are unique in the mesh)."""
    decode = sorted((w.beat for m in ctx.served for w in m.router.alive() if w.beat is not None),
                    key=lambda b: b.worker_id)
    prefill = sorted((b for m in ctx.served for b in m.metrics.prefill_workers.alive()), key=lambda b: b.worker_id)
    return decode, prefill


def get_load(ctx: GatewayContext) -> dict[str, Any]:
    decode, prefill = _beats(ctx)
    observed = {w.worker_id: w.observed for m in ctx.served for w in m.router.alive()}
    return {
        "num_decode_workers": len(decode), "num_prefill_workers": len(prefill),
        # Requests are counted where they generate: the decode workers (a prefill worker's are theirs too).
        "num_running_reqs": sum(b.running for b in decode), "num_waiting_reqs": sum(b.waiting for b in decode),
        "num_reqs": sum(b.running + b.waiting for b in decode),
        "num_tokens": sum((b.total_blocks - b.free_blocks) * b.block_size for b in decode),
        "gateway_requests_in_flight": ctx.in_flight,
        "workers": [_worker(b) | _observed(observed.get(b.worker_id)) for b in decode + prefill],
    }


def server_info(ctx: GatewayContext) -> dict[str, Any]:
    decode, prefill = _beats(ctx)
    internal = [{**_worker(b), "max_model_len": b.max_model_len, "kv_cache_dtype": b.kv_cache_dtype,
                 "num_preemptions": b.num_preemptions} for b in decode + prefill]
    c = ctx.config
    return {
        "version": kvmesh_version(), "served_model_name": c.served_model_name, "max_model_len": ctx.max_model_len(),
        "vocab_size": ctx.vocab_size, "draining": ctx.draining,
        "router": {"expiry_s": ctx.router.config.expiry_s, "max_waiting": ctx.router.config.max_waiting},
        "migration_limit": c.migration_limit,
        "served_models": [{"id": m.name, "max_model_len": m.max_model_len(), "vocab_size": m.vocab_size}
                          for m in ctx.served],
        "load": get_load(ctx),
        "internal_states": internal,  # SGLang's name for the per-worker states
    }
