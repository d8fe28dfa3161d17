"""Running real services in-process on a real nats-server, for tests below the HTTP layer."""
from __future__ import annotations

import asyncio
import contextlib
import itertools

from shared import bus, subjects
from shared.config import EngineConfig
from shared.sampling_params import SamplingParams
from shared.protocol.generate import GenerateRequest, TokenChunk
from services.decode.service import DecodeService, DecodeSettings
from services.kvstore.cpu_tier import CPUTier
from services.kvstore.service import KVStoreService
from tests.faulty_transport import faulty_transport
from services.prefill.service import PrefillService, PrefillSettings


def engine_config(model, **overrides) -> EngineConfig:
    """model: a tests.checkpoints.Checkpoint or a model directory."""
    cfg = dict(model=str(getattr(model, "path", model)), num_kv_blocks=128, max_num_batched_tokens=256, max_num_seqs=32)
    cfg.update(overrides)
    return EngineConfig(**cfg)


def decode_service(model, worker_id="d0", threshold=0, kvstore=True, transfer_timeout=3.0, remote_timeout=10.0,
                   beat_interval_s=0.2, direct_kv=True, **engine) -> DecodeService:
    return DecodeService(engine_config(model, **engine), DecodeSettings(
        worker_id=worker_id, remote_prefill_threshold=threshold, use_kvstore=kvstore,
        remote_prefill_timeout_s=remote_timeout, kv_transfer_timeout_s=transfer_timeout, beat_interval_s=beat_interval_s,
        direct_kv=direct_kv))


_prefill_ids = itertools.count()


def prefill_service(model, fault=None, kvstore=True, worker_id=None, **engine) -> PrefillService:
    """fault: "drop" or "corrupt" the last chunk of every KV push (tests/faulty_transport.py)."""
    service = PrefillService(engine_config(model, **engine), PrefillSettings(
        worker_id=worker_id or f"p{next(_prefill_ids)}", use_kvstore=kvstore, kv_transfer_timeout_s=3.0))
    if fault is not None:
        service.transport_class = faulty_transport(fault)
    return service


def kvstore_service(capacity=64 << 20) -> KVStoreService:
    return KVStoreService(CPUTier(capacity))


@contextlib.asynccontextmanager
async def running(url: str, *services):
    nc = await bus.connect(url)
    conns = []
    try:
        for s in services:
            c = await bus.connect(url)
            conns.append(c)
            await s.start(c)
        for c in conns:
            # Subscriptions travel on the service's own connection and requests on nc: a round trip on each
            # makes the server hold every subscription before the first request (a loaded machine otherwise
            # lets a request overtake them and get "no responders").
            await c.flush()
        yield nc
    finally:
        for s in reversed(services):
            await s.drain(2.0)
        for c in conns + [nc]:
            await c.drain()


async def generate(nc, prompt: list[int], params: SamplingParams, request_id: str, subject: str | None = None
                   ) -> tuple[list[int], list[TokenChunk]]:
    req = GenerateRequest(request_id=request_id, prompt_token_ids=prompt, sampling=params)
    chunks: list[TokenChunk] = []
    async with await bus.request_stream(nc, subject or subjects.DECODE_GENERATE, req, timeout=30,
                                        expect=TokenChunk) as stream:
        async for chunk in stream:
            chunks.append(chunk)
            if chunk.finished:
                break
    return [t for c in chunks for t in c.token_ids], chunks


async def wait_idle(*decode_services, timeout=3.0) -> None:
    """Until every engine holds no request and all its blocks are free again."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        states = [await s.thread.call(lambda e: (e.has_unfinished_requests(), e.block_manager.num_free_blocks,
                                                 e.block_manager.num_blocks)) for s in decode_services]
        if all(not busy and free == total for busy, free, total in states):
            for s in decode_services:
                await s.thread.call(lambda e: e.check_integrity())
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"engines not idle: {states}")
