"""vLLM's runtime LoRA API: POST /v1/load_lora_adapter {"lora_name", "lora_path"} and POST /v1/unload_lora_adapter
{"lora_name"}, served with --allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True).

A load is checked here first (the files, torch-free), then asked of every engine worker alive (decode and
prefill), each checking it against its model and reading it between steps; any refusal is the client's 400 with
that worker's reason, and the workers that had loaded it unload it again, so a bad adapter leaves the mesh as it
was. Only then does /v1/models list it and requests may name it. An unload stops new requests at once (they get
404); requests already running with the adapter finish with it.
"""
from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.gateway.context import GatewayContext
from services.gateway.errors import APIError, bad_request, unavailable
from services.gateway.lora_adapters import AdapterEntry
from shared import bus, subjects
from shared.models.lora_files import AdapterError, inspect_adapter
from shared.protocol.lora import LoRAUpdate, LoRAUpdateReply

UPDATE_TIMEOUT_S = 60.0  # a worker reads the adapter between two steps (a long prefill step on a CPU: seconds)


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM's; names identify adapters here


def engine_workers(ctx: GatewayContext) -> list[str]:
    """Every engine worker alive: decode (the router's) and prefill (the metrics' beats)."""
    return sorted({w.worker_id for w in ctx.router.alive()} | {b.worker_id for b in ctx.metrics.prefill_workers.alive()})


async def send_update(ctx: GatewayContext, worker_id: str, update: LoRAUpdate) -> LoRAUpdateReply:
    return await bus.request(ctx.nc, subjects.lora_update(worker_id), update, UPDATE_TIMEOUT_S, expect=LoRAUpdateReply)


async def _everywhere(ctx: GatewayContext, workers: list[str], update: LoRAUpdate) -> list[LoRAUpdateReply]:
    async def one(w: str) -> LoRAUpdateReply:
        try:
            return await send_update(ctx, w, update)
        except Exception as e:  # noqa: BLE001 - a worker that cannot answer refuses
            return LoRAUpdateReply(worker_id=w, ok=False, error=f"worker {w} did not answer: {e}")

    return list(await asyncio.gather(*(one(w) for w in workers)))


async def _body(request: Request, schema: type[BaseModel]) -> BaseModel:
    try:
        return schema.model_validate(await request.json())
    except ValueError as e:  # a JSON error or a ValidationError
        if isinstance(e, ValidationError):
            first = e.errors()[0]
            param = ".".join(str(p) for p in first.get("loc", ())) or None
            raise bad_request(f"{param}: {first.get('msg')}" if param else str(first.get("msg")), param=param) from None
        raise bad_request("invalid JSON body", code="invalid_json") from None


def _check_enabled(ctx: GatewayContext) -> None:
    loras = ctx.loras
    if not (loras.enabled and loras.runtime_updates):
        raise APIError(404, "runtime LoRA updating is off: start the mesh with --enable-lora and "
                            "--allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)",
                       code="lora_updates_disabled")


def install_lora_routes(app: FastAPI, ctx: GatewayContext) -> None:
    loras = ctx.loras

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        _check_enabled(ctx)
        body = await _body(request, LoadLoRARequest)
        name = body.lora_name
        if name == loras.base or name in loras.entries or name in loras.pending:
            raise bad_request(f"The lora adapter '{name}' has already been loaded"
                              if name in loras.entries or name in loras.pending else f"'{name}' is the base model's name",
                              param="lora_name", code="lora_name_taken")
        try:
            files = inspect_adapter(body.lora_path)
        except AdapterError as e:
            raise bad_request(str(e), param="lora_path", code="invalid_lora_adapter") from None
        workers = engine_workers(ctx)
        if not workers:
            raise unavailable("no engine worker is alive to load the adapter", code="no_decode_worker")
        update = LoRAUpdate(action="load", lora_name=name, lora_path=body.lora_path)
        loras.pending.add(name)
        try:
            replies = await _everywhere(ctx, workers, update)
            refused = [r for r in replies if not r.ok]
            if refused:
                loaded = [r.worker_id for r in replies if r.ok]
                await _everywhere(ctx, loaded, LoRAUpdate(action="unload", lora_name=name))
                raise bad_request(refused[0].error, param="lora_path", code="invalid_lora_adapter")
            loras.add(AdapterEntry(name, files.path, loras.base, files.digest, int(time.time()), runtime=True))
        finally:
            loras.pending.discard(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        _check_enabled(ctx)
        body = await _body(request, UnloadLoRARequest)
        name = body.lora_name
        entry = loras.remove(name)
        if entry is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name", code="lora_not_found")
        # Workers that miss this (gone, slow) are unloaded by LoRAAdapters.on_beat from their next beat on.
        await _everywhere(ctx, engine_workers(ctx), LoRAUpdate(action="unload", lora_name=name))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
