"""Prefill worker: computes the KV of a prompt tail a decode worker lacks, pushes it to that
worker's reserved blocks, and answers with the first sampled token.

It runs the same engine (chunked prefill, batching across requests, its own prefix cache, the
kvstore) with every request limited to one output token.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import time

from nats.aio.client import Client
from opentelemetry import trace

from shared import bus, subjects
from shared.config import EngineConfig
from shared.engine.commands import Abort, Commit, Enqueue, Reserve, RouteKVByRank
from shared.engine.engine_thread import EngineStopped
from shared.engine.outputs import RequestOutput
from shared.engine.tp.launch import TPRankError
from shared.engine.tp.shard_link import ShardTarget
from shared.kv_transport import TransferError
from shared.kv_transport.outgoing import OutgoingTransfer
from shared.protocol import errors as codes
from shared.protocol.generate import CancelRequest, TokenLogprob
from shared.protocol.prefill import RemotePrefillReply, RemotePrefillRequest
from services.engine_args import (PREFILL_CHUNK_TOKENS, add_engine_arguments, add_pooling_arguments,
                                  engine_config_from_args, engine_factory_from_args)
from services.early_cancels import EarlyCancels
from services.engine_worker import EngineWorker, default_worker_id

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("kvmesh.prefill")
VERSION = "0.1.0"


@dataclasses.dataclass
class PrefillSettings:
    worker_id: str = dataclasses.field(default_factory=lambda: default_worker_id("prefill"))
    use_kvstore: bool = True
    beat_interval_s: float = 1.0
    kv_transfer_timeout_s: float = 30.0


class _RankLost(Exception):
    """A pending request's engine lost a tensor-parallel rank (set on its future by on_engine_crash)."""


class PrefillService(EngineWorker):
    name = "prefill"
    role = "prefill"

    def __init__(self, engine_config: EngineConfig, settings: PrefillSettings) -> None:
        super().__init__(engine_config, settings.use_kvstore, settings.worker_id, settings.beat_interval_s)
        self.settings = settings
        self.pending: dict[str, asyncio.Future] = {}
        self.outgoing: dict[str, OutgoingTransfer] = {}  # each request's KV push, open while it computes
        self.early_cancels = EarlyCancels()  # cancels that overtook their request (refused when it comes)
        self._cancelling: set[asyncio.Task] = set()  # cancels on their way to the engine
        self.refused_cancelled = 0  # requests refused because their cancel came first
        self.kv_pieces = 0  # blocks of a chunk pushed while the prompt's next chunk computed
        self.draining = False
        self.moved = 0  # requests answered MOVE_ELSEWHERE after a rank was lost
        self.by_rank_pushes = 0  # KV pushes sent rank to rank (a decode worker of this tensor-parallel degree)

    async def start(self, nc: Client) -> None:
        await self.start_engine(nc)
        await self.transport.start(None)
        self.cancel_sub = await bus.subscribe(nc, subjects.PREFILL_CANCEL, self._on_cancel, CancelRequest)
        self.micro = await bus.add_micro_service(nc, subjects.SERVICE_PREFILL, VERSION, [
            bus.Endpoint("prefill", subjects.PREFILL_PREFILL, subjects.QUEUE_PREFILL, self._on_prefill,
                         RemotePrefillRequest)])
        await nc.flush()  # registration must reach the server before anyone is told we are up
        await self.beats.beat()
        self.beats.start()

    def load_subject(self) -> str:
        return subjects.prefill_load(self.settings.worker_id)

    async def stop_intake(self) -> None:
        # Refuse new work; stopping the endpoint now would cancel handlers still answering.
        self.draining = True

    def in_flight(self) -> int:
        return len(self.pending)

    async def abort_in_flight(self) -> None:
        if self.thread.error is None:
            for rid in list(self.pending):
                await self._cancel(rid)
        await asyncio.sleep(0.05)  # let cancelled handlers send their replies

    async def release(self, remaining_s: float) -> None:
        await self.micro.stop()
        self.beats.stop()
        await self.offload_before_leaving(remaining_s)
        await self.cancel_sub.unsubscribe()
        await self.transport.stop()
        self.thread.stop()

    async def _on_prefill(self, req: RemotePrefillRequest, ctx: bus.RequestContext) -> RemotePrefillReply:
        if self.draining:
            raise bus.RemoteError(codes.OVERLOADED, "prefill worker is shutting down")
        if req.block_size != self.block_size:
            raise bus.RemoteError(codes.BAD_REQUEST, f"block_size {req.block_size} != this worker's {self.block_size}")
        rid = req.request_id
        if self.early_cancels.take(rid):
            # Its decode worker gave it up (fell back to computing it, or the request was cancelled) before it got here.
            self.refused_cancelled += 1
            return RemotePrefillReply(request_id=rid, transfer_id=req.transfer_id, error="cancelled")
        if rid in self.pending:
            raise bus.RemoteError(codes.BAD_REQUEST, f"request {rid!r} is already being prefilled")
        first_block = req.num_cached_tokens // self.block_size
        sampling = req.sampling
        params = sampling.model_copy(update={"max_tokens": 1, "min_tokens": min(sampling.min_tokens, 1)})
        fut = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        # Opened before the prefill starts: the blocks of each chunk go out while the next one computes.
        tx = self.outgoing[rid] = self.transport.open_transfer(
            req.decode_worker_id, req.transfer_id, self.settings.kv_transfer_timeout_s, endpoint=req.kv_endpoint,
            token=req.kv_token)
        try:
            with _tracer.start_as_current_span("prefill.compute", attributes={
                    "kvmesh.request_id": rid, "kvmesh.prompt_tokens": len(req.prompt_token_ids),
                    "kvmesh.decode_cached_tokens": req.num_cached_tokens}) as span:
                try:
                    if req.kv_rank_endpoints and tx.direct_offered:
                        by_rank = await self.thread.run(RouteKVByRank(rid, ShardTarget(
                            req.transfer_id, req.kv_token, tuple(req.kv_rank_endpoints),
                            self.settings.kv_transfer_timeout_s)))
                        span.set_attribute("kvmesh.kv.by_rank", by_rank)
                        self.by_rank_pushes += by_rank
                    cached = await self._admit(rid, req.prompt_token_ids, params, first_block)
                    self.beats.changed()
                    span.set_attribute("kvmesh.cached_tokens", cached)
                    out: RequestOutput = await fut
                except (_RankLost, EngineStopped):
                    if not isinstance(self.thread.error, TPRankError):
                        raise
                    self.moved += 1
                    return RemotePrefillReply(request_id=rid, transfer_id=req.transfer_id, error=codes.MOVE_ELSEWHERE)
                span.set_attribute("kvmesh.kv.pieces", tx.pieces + 1)
            if out.finish_reason == "abort" or out.kv_blocks is None:
                return RemotePrefillReply(request_id=rid, transfer_id=req.transfer_id, error="cancelled")
            computed = out.kv_blocks.end_block - first_block
            if computed != req.num_dest_blocks:
                return RemotePrefillReply(request_id=rid, transfer_id=req.transfer_id,
                                          error=f"computed {computed} blocks, decode reserved {req.num_dest_blocks}")
            t0 = time.perf_counter()
            sent = await tx.finish(out.kv_blocks)
            self.kv_push.record(sent, time.perf_counter() - t0)
        except ValueError as e:
            raise bus.RemoteError(codes.BAD_REQUEST, str(e)) from None
        except (bus.BusError, TransferError, asyncio.TimeoutError) as e:
            return RemotePrefillReply(request_id=rid, transfer_id=req.transfer_id, error=f"KV push failed: {e}")
        finally:
            self.outgoing.pop(rid, None)
            await tx.cancel()  # a no-op once finished; stops pieces still going out otherwise
            if self.pending.pop(rid, None) is not None and not fut.done():
                await self.thread.run(Abort(rid))
        lp = TokenLogprob.from_engine(out.logprobs[0]) if out.logprobs else None
        return RemotePrefillReply(request_id=rid, transfer_id=req.transfer_id, first_token_id=out.output_token_ids[0],
                                  logprobs=lp, num_cached_tokens=cached)

    async def _admit(self, rid: str, prompt: list[int], params, first_block: int) -> int:
        """Queue the request, reusing this worker's prefix cache and the kvstore; returns cached tokens."""
        res = await self.thread.run(Reserve(rid, prompt, params, capture_kv_from_block=first_block))
        if res is None:
            await self.thread.run(Enqueue(rid, prompt, params, capture_kv_from_block=first_block))
            return 0
        cached = await self.load_prefix(rid, res)
        await self.thread.run(Commit(rid, cached))
        return cached

    def _on_step(self, outputs: list[RequestOutput], events, offload) -> None:
        for out in outputs:
            fut = self.pending.get(out.request_id)
            if out.finished and fut is not None and not fut.done():
                fut.set_result(out)
            elif not out.finished and out.kv_blocks is not None and out.request_id in self.outgoing:
                self.outgoing[out.request_id].push(out.kv_blocks)
                self.kv_pieces += 1
        super()._on_step(outputs, events, offload)

    async def on_engine_crash(self) -> None:
        self.draining = True
        # A lost tensor-parallel rank is this worker failing, not its requests: each is answered MOVE_ELSEWHERE
        # at once and its decode worker asks another prefill worker (services/decode/admission.py), as a decode
        # worker's streams move; the worker then exits non-zero for its supervisor. Any other engine error may
        # be a request's doing: those are only cancelled (their decode workers compute them after the timeout).
        lost_rank = isinstance(self.thread.error, TPRankError)
        if lost_rank:
            log.error("prefill worker lost a tensor-parallel rank; moving %d request(s) to other workers",
                      len(self.pending))
        for fut in self.pending.values():
            if fut.done():
                continue
            if lost_rank:
                fut.set_exception(_RankLost())
            else:
                fut.cancel()

    async def _on_cancel(self, msg: CancelRequest, ctx: bus.RequestContext) -> None:
        if msg.request_id not in self.pending:
            self.early_cancels.remember(msg.request_id)
            return
        # Not awaited (cancels are handled one at a time and each abort waits for the engine's step in progress):
        # a burst of cancels reaches the engine together instead of costing a step each.
        task = asyncio.ensure_future(self._cancel(msg.request_id))
        self._cancelling.add(task)
        task.add_done_callback(self._cancelling.discard)

    async def _cancel(self, rid: str) -> None:
        fut = self.pending.get(rid)
        if fut is None:
            return
        out = await self.thread.run(Abort(rid))
        if not fut.done():
            if out is not None:
                fut.set_result(out)
            else:
                fut.cancel()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    add_pooling_arguments(parser)
    parser.set_defaults(long_prefill_token_threshold=PREFILL_CHUNK_TOKENS)
    parser.add_argument("--worker-id", default=os.environ.get("KVMESH_WORKER_ID") or default_worker_id("prefill"))
    parser.add_argument("--no-kvstore", action="store_true")
    parser.add_argument("--kv-transfer-timeout", type=float, default=30.0)


def build(args: argparse.Namespace) -> PrefillService:
    if getattr(args, "runner", "generate") == "pooling":
        from services.prefill.pooling_service import build_pooling

        return build_pooling(args)  # type: ignore[return-value]
    service = PrefillService(engine_config_from_args(args), PrefillSettings(
        worker_id=args.worker_id, use_kvstore=not args.no_kvstore, kv_transfer_timeout_s=args.kv_transfer_timeout))
    service.engine_factory = engine_factory_from_args(args)
    return service
