"""Decode worker: runs the engine with continuous batching and streams tokens to the gateway.

Admission of a request: this worker's prefix cache, then the kvstore's longest chain of the
prompt's blocks, then the uncached tail is prefilled here (short tails) or by a prefill worker
that pushes the KV back (long tails). Any failure on the remote path (no prefill worker, timeout,
bad transfer) falls back to computing locally, so the output never changes.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from nats.aio.client import Client
from opentelemetry import trace

from shared import bus, subjects
from shared.bus.stream import StreamReply
from shared.config import EngineConfig
from shared.engine.llm_engine import LLMEngine, Reservation
from shared.engine.outputs import RequestOutput
from shared.kv_transport import TransferError
from shared.protocol import errors as codes
from shared.protocol.errors import ErrorReply
from shared.protocol.generate import CancelRequest, GenerateRequest, TokenChunk, TokenLogprob
from shared.protocol.prefill import RemotePrefillReply, RemotePrefillRequest
from services.decode.events import to_wire
from services.engine_worker import EngineWorker, default_worker_id, request_timings
from services.engine_args import add_engine_arguments, engine_config_from_args

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("kvmesh.decode")
VERSION = "0.1.0"
EARLY_CANCELS_KEPT = 10_000


@dataclass
class DecodeSettings:
    worker_id: str
    remote_prefill_threshold: int = 512  # uncached prompt tokens at which prefill goes remote; 0 = always
    use_kvstore: bool = True
    remote_prefill_timeout_s: float = 60.0
    kv_transfer_timeout_s: float = 30.0
    beat_interval_s: float = 1.0


@dataclass
class Active:
    """A request this worker is serving."""

    req: GenerateRequest
    stream: StreamReply
    span: trace.Span
    next_seq: int = 0
    num_cached_tokens: int = 0
    transfer_id: str | None = None
    first_token_at: float | None = None
    tasks: list[asyncio.Task] = field(default_factory=list)


class DecodeService(EngineWorker):
    name = "decode"
    role = "decode"

    def __init__(self, engine_config: EngineConfig, settings: DecodeSettings) -> None:
        super().__init__(engine_config, settings.use_kvstore, settings.worker_id, settings.beat_interval_s)
        self.settings = settings
        self.active: dict[str, Active] = {}
        self.draining = False
        self.num_received = 0  # generate requests that reached this worker
        self.num_cancels = 0  # cancel messages seen (for any request)
        self.remote_prefills = 0  # prompts whose KV came from a prefill worker
        self.remote_fallbacks = 0  # remote attempts that ended in a local recompute
        self.queued_local = 0  # admitted while the KV pool was full: prefilled here once blocks free up
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        # Cancels for requests not (yet) here: generate and cancel are handled by separate tasks, so a
        # client that gives up at once can have its cancel processed before its request.
        self._early_cancels: OrderedDict[str, None] = OrderedDict()

    # --- lifecycle --------------------------------------------------------------------------------

    async def start(self, nc: Client) -> None:
        await self.start_engine(nc)
        await self.transport.start(self.settings.worker_id)
        wid = self.settings.worker_id
        self.cancel_sub = await bus.subscribe(nc, subjects.DECODE_CANCEL, self._on_cancel, CancelRequest)
        self.micro = await bus.add_micro_service(nc, subjects.SERVICE_DECODE, VERSION, [
            bus.Endpoint("generate", subjects.DECODE_GENERATE, subjects.QUEUE_DECODE, self._on_generate,
                         GenerateRequest),
            bus.Endpoint("generate_worker", subjects.decode_generate(wid), f"{subjects.QUEUE_DECODE}.{wid}",
                         self._on_generate, GenerateRequest),
        ], metadata={"worker_id": wid})
        await nc.flush()  # registration must reach the server before anyone is told we are up
        self._tasks = [asyncio.ensure_future(self._send_loop())]
        await self.beats.beat()
        self.beats.start()

    async def drain(self, grace_s: float) -> None:
        self.draining = True
        await self.micro.stop()
        deadline = time.monotonic() + grace_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self.active):
            await self._abort(rid, "worker shutting down", error=True)
        await self._outbox.join()
        if self.offloader:
            await self.offloader.flush(max(0.0, deadline - time.monotonic()))
        for t in self._tasks:
            t.cancel()
        self.beats.stop()
        await self.cancel_sub.unsubscribe()
        await self.transport.stop()
        self.thread.stop()

    # --- requests -----------------------------------------------------------------------------

    async def _on_generate(self, req: GenerateRequest, ctx: bus.RequestContext) -> None:
        self.num_received += 1
        if self.draining:
            raise bus.RemoteError(codes.OVERLOADED, "decode worker is shutting down")
        if req.request_id in self.active:
            raise bus.RemoteError(codes.BAD_REQUEST, f"request id {req.request_id!r} is already running")
        if self._early_cancels.pop(req.request_id, "missing") is None:
            stream = ctx.stream()
            await stream.send(TokenChunk(request_id=req.request_id, seq=0, finish_reason="abort"))
            await stream.end()
            return
        span = _tracer.start_span("decode.request", attributes={
            "kvmesh.request_id": req.request_id, "kvmesh.worker_id": self.settings.worker_id,
            "gen_ai.usage.input_tokens": len(req.prompt_token_ids)})
        active = Active(req, ctx.stream(), span)
        self.active[req.request_id] = active
        active.tasks.append(asyncio.ensure_future(self._admit(active)))
        self.beats.changed()

    async def _admit(self, a: Active) -> None:
        req, rid = a.req, a.req.request_id
        params = req.sampling.to_params()
        ctx = trace.set_span_in_context(a.span)
        with _tracer.start_as_current_span("decode.admit", context=ctx) as span:
            try:
                res = await self.thread.call(lambda e: e.reserve(rid, req.prompt_token_ids, params, req.priority))
            except ValueError as e:
                await self._fail(rid, codes.BAD_REQUEST, str(e))
                return
            if rid not in self.active:  # cancelled meanwhile
                await self.thread.call(lambda e: e.abort(rid))
                return
            if res is None:  # the pool is full right now: queue it like any local request
                await self.thread.call(lambda e: e.add_request(rid, req.prompt_token_ids, params, req.priority))
                span.set_attribute("kvmesh.prefill", "local-queued")
                self.queued_local += 1
                return
            # Prompt logprobs need the logits of every prompt position: computed here, nothing fetched.
            here = params.prompt_logprobs is not None
            cached = 0 if here else await self.load_from_kvstore(rid, res)
            a.num_cached_tokens = cached
            span.set_attribute("kvmesh.cached_tokens", cached)
            tail = len(req.prompt_token_ids) - cached
            remote = tail >= self.settings.remote_prefill_threshold and not here
            span.set_attribute("kvmesh.prefill", "remote" if remote else "local")
        if remote and await self._remote_prefill(a, res, cached):
            return
        if rid in self.active:
            await self.thread.call(lambda e: e.commit_held(rid, cached) if rid in e.held else None)

    async def _remote_prefill(self, a: Active, res: Reservation, cached: int) -> bool:
        """True when the prompt's KV arrived and the first token was emitted; False to compute locally."""
        rid, req = a.req.request_id, a.req
        first_block = cached // self.block_size
        transfer_id = uuid.uuid4().hex
        a.transfer_id = transfer_id

        async def write(block_start: int, k, v, first_layer: int) -> None:
            def do(e: LLMEngine) -> None:
                if rid not in e.held:
                    raise TransferError("request is no longer waiting for KV")
                e.write_blocks(rid, block_start, k, v, first_layer)
            await self.thread.call(do)

        done = self.transport.expect(transfer_id, res.num_blocks, write, self.settings.kv_transfer_timeout_s)
        msg = RemotePrefillRequest(request_id=rid, transfer_id=transfer_id, prompt_token_ids=req.prompt_token_ids,
                                   num_cached_tokens=cached, decode_worker_id=self.settings.worker_id,
                                   num_dest_blocks=res.num_blocks - first_block, block_size=self.block_size,
                                   sampling=req.sampling)
        with _tracer.start_as_current_span("decode.remote_prefill", context=trace.set_span_in_context(a.span),
                                           attributes={"kvmesh.transfer_id": transfer_id}) as span:
            try:
                reply = await bus.request(self.nc, subjects.PREFILL_PREFILL, msg,
                                          timeout=self.settings.remote_prefill_timeout_s, expect=RemotePrefillReply)
                if reply.error is not None or reply.first_token_id is None:
                    raise TransferError(f"prefill worker failed: {reply.error}")
                await asyncio.wait_for(done, timeout=self.settings.kv_transfer_timeout_s)
            except (bus.BusError, TransferError, asyncio.TimeoutError, asyncio.CancelledError) as e:
                self.transport.forget(transfer_id)
                if not done.done():
                    done.cancel()
                a.transfer_id = None
                span.set_attribute("kvmesh.fallback", str(e) or type(e).__name__)
                log.warning("remote prefill of %s failed (%s); computing locally", rid, e or type(e).__name__)
                self.remote_fallbacks += 1
                await bus.publish(self.nc, subjects.PREFILL_CANCEL, CancelRequest(request_id=rid, reason="fallback"))
                if isinstance(e, asyncio.CancelledError):
                    raise
                return False
        a.transfer_id = None
        self.remote_prefills += 1
        if rid not in self.active:
            return True
        lp = reply.logprobs.to_engine() if reply.logprobs is not None else None
        loop = asyncio.get_running_loop()

        def commit(e: LLMEngine) -> None:
            if rid in e.held:
                out = e.commit_held(rid, len(req.prompt_token_ids), reply.first_token_id, lp)
                # Scheduled from the engine thread, so it reaches the loop before any later step's tokens.
                loop.call_soon_threadsafe(self._on_step, [out], [], None)
        await self.thread.call(commit)
        return True

    # --- outputs --------------------------------------------------------------------------------

    def _on_step(self, outputs: list[RequestOutput], events, offload) -> None:
        for out in outputs:
            self._emit(out)
        for msg in to_wire(self.settings.worker_id, events):
            self._outbox.put_nowait((None, msg, False))
        super()._on_step(outputs, events, offload)

    def _emit(self, out: RequestOutput) -> None:
        a = self.active.get(out.request_id)
        if a is None:
            return
        lps = None
        if a.req.sampling.logprobs is not None and out.logprobs:
            lps = [TokenLogprob.from_engine(lp) for lp in out.logprobs[-len(out.new_token_ids):]]
        plps = None
        if a.next_seq == 0 and out.prompt_logprobs is not None:
            plps = [None if lp is None else TokenLogprob.from_engine(lp) for lp in out.prompt_logprobs]
        chunk = TokenChunk(request_id=out.request_id, seq=a.next_seq, token_ids=out.new_token_ids, logprobs=lps,
                           prompt_logprobs=plps,
                           finish_reason=out.finish_reason if out.finished else None,
                           num_cached_tokens=max(a.num_cached_tokens, out.num_cached_tokens) if a.next_seq == 0 else None,
                           timings=request_timings(out) if out.finished else None)
        if a.next_seq == 0:
            a.span.add_event("first_token")
        a.next_seq += 1
        if out.finished:
            del self.active[out.request_id]
            a.span.set_attribute("gen_ai.usage.output_tokens", len(out.output_token_ids))
            a.span.set_attribute("gen_ai.response.finish_reasons", [out.finish_reason])
        self._outbox.put_nowait((a, chunk, out.finished))

    async def _send_loop(self) -> None:
        """One ordered outbox for token chunks and events: per-request order is the send order."""
        while True:
            a, msg, last = await self._outbox.get()
            try:
                if a is None:
                    await bus.publish(self.nc, subjects.decode_events(self.settings.worker_id), msg)
                    continue
                with trace.use_span(a.span, end_on_exit=False):
                    await a.stream.send(msg)
                    if last:
                        await a.stream.end()
                if last:
                    a.span.end()
            except Exception:  # noqa: BLE001 - one broken reply subject must not stop the others
                log.exception("could not deliver to %s", getattr(msg, "request_id", "events"))
            finally:
                self._outbox.task_done()

    async def _fail(self, rid: str, code: str, message: str) -> None:
        a = self.active.pop(rid, None)
        if a is None:
            return
        a.span.set_status(trace.StatusCode.ERROR, message)
        await a.stream.end(error=ErrorReply(code=code, message=message))
        a.span.end()

    async def on_engine_crash(self) -> None:
        self.draining = True
        for rid, a in list(self.active.items()):
            self.active.pop(rid, None)
            self._outbox.put_nowait((a, TokenChunk(request_id=rid, seq=a.next_seq, finish_reason="error",
                                                   error="decode worker failed"), True))
        await asyncio.wait_for(self._outbox.join(), timeout=5)

    # --- cancellation ---------------------------------------------------------------------------

    async def _on_cancel(self, msg: CancelRequest, ctx: bus.RequestContext) -> None:
        self.num_cancels += 1
        if msg.request_id in self.active:
            await self._abort(msg.request_id, msg.reason or "cancelled")
        else:
            self._early_cancels[msg.request_id] = None
            while len(self._early_cancels) > EARLY_CANCELS_KEPT:
                self._early_cancels.popitem(last=False)

    async def _abort(self, rid: str, reason: str, error: bool = False) -> None:
        a = self.active.pop(rid, None)
        if a is None:
            return
        await self.thread.call(lambda e: e.abort(rid))
        self.beats.changed()
        if a.transfer_id is not None:
            self.transport.forget(a.transfer_id)
            await bus.publish(self.nc, subjects.PREFILL_CANCEL, CancelRequest(request_id=rid, reason=reason))
        for t in a.tasks:
            t.cancel()
        a.span.add_event("cancelled", {"reason": reason})
        chunk = TokenChunk(request_id=rid, seq=a.next_seq, finish_reason="error" if error else "abort",
                           error=reason if error else None)
        self._outbox.put_nowait((a, chunk, True))

    def load_subject(self) -> str:
        return subjects.decode_load(self.settings.worker_id)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--worker-id", default=os.environ.get("KVMESH_WORKER_ID") or default_worker_id("decode"))
    parser.add_argument("--remote-prefill-threshold", type=int,
                        default=int(os.environ.get("KVMESH_REMOTE_PREFILL_THRESHOLD", 512)),
                        help="uncached prompt tokens at which prefill goes to a prefill worker (0: always, "
                             "a huge number: never)")
    parser.add_argument("--no-kvstore", action="store_true", help="neither fetch from nor offload to the kvstore")
    parser.add_argument("--remote-prefill-timeout", type=float, default=60.0)
    parser.add_argument("--kv-transfer-timeout", type=float, default=30.0)


def build(args: argparse.Namespace) -> DecodeService:
    return DecodeService(engine_config_from_args(args), DecodeSettings(
        worker_id=args.worker_id, remote_prefill_threshold=args.remote_prefill_threshold,
        use_kvstore=not args.no_kvstore, remote_prefill_timeout_s=args.remote_prefill_timeout,
        kv_transfer_timeout_s=args.kv_transfer_timeout))
