"""A prefill worker in the pooling runner: embeddings, classification and reranking scores.

Takes PoolRequests on `kvmesh.prefill.pool` (the prefill queue group: any pooling worker serves any request),
runs them through shared/engine/pooling_engine.py (continuous batching by tokens, one forward pass each, no
KV kept, none sent) and answers with the pooled vector. It beats like any prefill worker, so the gateway's
/health and /metrics see it.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os

import torch
from nats.aio.client import Client
from opentelemetry import trace

from shared import bus, subjects
from shared.config import DTYPES
from shared.engine.pooling_engine import PoolingEngine, PoolingThread, PoolJob
from shared.models.pooling_config import PoolerConfig, PoolingConfigError, PoolingSpec, pooling_spec
from shared.protocol import errors as codes
from shared.protocol.events import LoadBeat
from shared.protocol.pooling import PoolReply, PoolRequest
from shared.service_runner import Service

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("kvmesh.prefill")
VERSION = "0.1.0"


@dataclasses.dataclass
class PoolingSettings:
    model: str
    worker_id: str
    spec: PoolingSpec
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    beat_interval_s: float = 1.0


def load_pooling_model(settings: PoolingSettings):  # noqa: ANN201 - a PoolingModel
    device = settings.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if settings.spec.encoder:
        from shared.models.bert_pooling import load_bert_pooling

        return load_bert_pooling(settings.model, settings.spec, dtype=settings.dtype, device=device)
    from shared.models.llama_pooling import load_llama_pooling

    return load_llama_pooling(settings.model, settings.spec, dtype=settings.dtype, device=device,
                              max_positions=settings.max_model_len)


class PoolingService(Service):
    name = "prefill"

    def __init__(self, settings: PoolingSettings) -> None:
        self.settings = settings
        self.thread: PoolingThread | None = None
        self.pending: set[str] = set()
        self.draining = False
        self._beat_task: asyncio.Task | None = None
        self.micro = None
        self.nc: Client | None = None

    async def start(self, nc: Client) -> None:
        self.nc = nc
        s = self.settings
        model = await asyncio.to_thread(load_pooling_model, s)
        self.engine = PoolingEngine(model, s.spec, s.max_num_batched_tokens, s.max_num_seqs)
        self.thread = PoolingThread(self.engine)
        self.thread.start()
        self.micro = await bus.add_micro_service(nc, subjects.SERVICE_PREFILL, VERSION, [
            bus.Endpoint("pool", subjects.PREFILL_POOL, subjects.QUEUE_PREFILL, self._on_pool, PoolRequest)],
            metadata={"runner": "pooling", "task": s.spec.task})
        await nc.flush()
        await self._beat()
        self._beat_task = asyncio.ensure_future(self._beats())
        log.info("pooling worker %s serving %s (%s, pooling %s)", s.worker_id, s.model, s.spec.task,
                 s.spec.pooler.pooling_type)

    async def _beat(self) -> None:
        assert self.nc is not None and self.thread is not None
        stats = self.engine.stats
        beat = LoadBeat(worker_id=self.settings.worker_id, role="prefill", running=stats.running,
                        waiting=self.thread.waiting(), free_blocks=0, total_blocks=0,
                        max_model_len=self.engine.model.max_positions, iteration_tokens_sum=stats.tokens)
        await bus.publish(self.nc, subjects.prefill_load(self.settings.worker_id), beat)

    async def _beats(self) -> None:
        while True:
            await asyncio.sleep(self.settings.beat_interval_s)
            try:
                await self._beat()
            except Exception as e:  # noqa: BLE001 - a missed beat is not the worker's end
                log.warning("load beat failed: %s", e)

    async def _on_pool(self, req: PoolRequest, ctx: bus.RequestContext) -> PoolReply:
        if self.draining:
            raise bus.RemoteError(codes.OVERLOADED, "pooling worker is shutting down")
        assert self.thread is not None
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def done(values: torch.Tensor | None, error: str | None) -> None:
            def settle() -> None:
                if not fut.done():
                    fut.set_result((values, error))
            loop.call_soon_threadsafe(settle)

        job = PoolJob(req.request_id, list(req.token_ids), req.task, req.normalize, req.activation, req.dimensions,
                      done=done)
        problem = self.engine.check(job)
        if problem is not None:
            raise bus.RemoteError(codes.BAD_REQUEST, problem)
        self.pending.add(req.request_id)
        try:
            with _tracer.start_as_current_span("pool.compute", attributes={
                    "kvmesh.request_id": req.request_id, "kvmesh.prompt_tokens": len(req.token_ids),
                    "kvmesh.pool.task": req.task}):
                self.thread.submit(job)
                try:
                    values, error = await fut
                except asyncio.CancelledError:
                    self.thread.cancel(req.request_id)
                    raise
        finally:
            self.pending.discard(req.request_id)
        if error is not None:
            return PoolReply(request_id=req.request_id, error=error)
        arr = values.contiguous().to(torch.float32)
        return PoolReply(request_id=req.request_id, data=arr.numpy().astype("<f4").tobytes(), rows=arr.shape[0],
                         cols=arr.shape[1], num_tokens=len(req.token_ids))

    async def stop_intake(self) -> None:
        self.draining = True

    def in_flight(self) -> int:
        return len(self.pending)

    async def release(self, remaining_s: float) -> None:
        if self._beat_task is not None:
            self._beat_task.cancel()
        if self.micro is not None:
            await self.micro.stop()
        if self.thread is not None:
            await asyncio.to_thread(self.thread.stop)


def build_pooling(args: argparse.Namespace) -> PoolingService:
    """The pooling worker from the prefill worker's flags; a configuration that cannot work stops it here."""
    from shared.engine.errors import ConfigError

    if args.dtype not in ("auto", *DTYPES):
        raise ConfigError(f"unknown dtype {args.dtype}")
    if args.quantization not in ("auto", "none"):
        raise ConfigError(f"--quantization {args.quantization}: the pooling runner serves the checkpoint's float "
                          "weights (in --dtype)")
    if args.tensor_parallel_size > 1 or args.engine != "real":
        raise ConfigError("the pooling runner runs one real engine per worker (no --tensor-parallel-size, no "
                          "--engine sim)")
    try:
        spec = pooling_spec(args.model, args.convert, PoolerConfig.parse(args.pooler_config))
    except PoolingConfigError as e:
        raise ConfigError(str(e)) from None
    from shared.engine.cpu_threads import apply_plan, plan_for_this_process

    log.info(apply_plan(plan_for_this_process(args.threads)))  # this process's share of the cores
    return PoolingService(PoolingSettings(
        model=args.model, worker_id=args.worker_id or os.environ.get("KVMESH_WORKER_ID", "prefill"), spec=spec,
        dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs))
