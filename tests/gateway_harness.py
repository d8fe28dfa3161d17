"""A real mesh for gateway tests, in a background thread: nats-server, the tokenizer service, the
gateway on a free port, and minimal decode responders that run the real engine on a tiny checkpoint.

The responder here exists only so the gateway can be tested before and apart from the decode
service: it speaks the same contract (GenerateRequest in, TokenChunks out, cancels, events, beats)
with none of decode's features (no kvstore, no remote prefill). Tests talk to the gateway over HTTP
from the main thread with the official openai client.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from nats.aio.client import Client

from services.gateway.config import GatewayConfig
from services.gateway.service import GatewayService
from services.tokenizer.service import TokenizerService
from shared import bus, subjects
from shared.bus.natsd import NatsServer
from shared.config import EngineConfig
from shared.engine.block_events import BlockRemoved as EngineRemoved
from shared.engine.block_events import BlockStored as EngineStored
from shared.engine.llm_engine import LLMEngine
from shared.models.tokenizer import load_tokenizer
from shared.protocol import errors as codes
from shared.protocol.events import BlockRemoved, BlockStored, LoadBeat
from shared.protocol.generate import CancelRequest, GenerateRequest, TokenChunk, TokenLogprob

T = TypeVar("T")


@dataclass
class EngineResponder:
    """Serves decode.generate (queue group and per-worker subject) with a real LLMEngine."""

    model_dir: str
    worker_id: str
    num_kv_blocks: int = 96
    beat_interval_s: float = 0.2
    engine: LLMEngine = field(init=False)
    cancelled: list[str] = field(default_factory=list)
    received: list[str] = field(default_factory=list)
    beating: bool = True  # tests stop the beats to make the worker look dead

    def __post_init__(self) -> None:
        self.engine = LLMEngine(EngineConfig(model=self.model_dir, num_kv_blocks=self.num_kv_blocks, max_num_seqs=16,
                                             max_num_batched_tokens=256))
        self._queues: dict[str, asyncio.Queue[TokenChunk]] = {}
        self._seqs: dict[str, int] = {}
        self._lock = asyncio.Lock()  # the engine is single-threaded; steps run in a worker thread

    async def start(self, nc: Client) -> None:
        self.nc = nc
        self._served = [
            await bus.serve(nc, subjects.DECODE_GENERATE, subjects.QUEUE_DECODE, self.generate, GenerateRequest),
            await bus.serve(nc, subjects.decode_generate(self.worker_id), None, self.generate, GenerateRequest),
        ]
        self._cancel_sub = await bus.subscribe(nc, subjects.DECODE_CANCEL, self.on_cancel, CancelRequest)
        self._tasks = [asyncio.ensure_future(self._loop()), asyncio.ensure_future(self._beats())]
        await nc.flush()

    async def stop(self) -> None:
        """Like a crash as far as callers can tell: streams in progress just go silent. Idempotent."""
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        served, self._served = self._served, []
        for s in served:
            await s.stop()
        if served:
            await self._cancel_sub.unsubscribe()

    async def generate(self, req: GenerateRequest, ctx: bus.RequestContext):  # noqa: ANN201
        self.received.append(req.request_id)
        params = req.sampling.to_params()
        try:
            self.engine.validate(req.prompt_token_ids, params)
        except ValueError as e:
            raise bus.RemoteError(codes.BAD_REQUEST, str(e)) from None
        queue: asyncio.Queue[TokenChunk] = asyncio.Queue()
        async with self._lock:
            self._queues[req.request_id] = queue
            self._seqs[req.request_id] = 0
            self.engine.add_request(req.request_id, req.prompt_token_ids, params, req.priority)
        return self._drain(req.request_id, queue)

    async def _drain(self, request_id: str, queue: asyncio.Queue[TokenChunk]):  # noqa: ANN202
        while True:
            chunk = await queue.get()
            yield chunk
            if chunk.finished:
                return

    async def on_cancel(self, msg: CancelRequest, ctx: bus.RequestContext) -> None:
        self.cancelled.append(msg.request_id)
        async with self._lock:
            out = self.engine.abort(msg.request_id)
        if out is not None:
            self._emit(out.request_id, [], None, "abort", 0)

    def held(self) -> int:
        return len(self.engine.seqs)

    def _emit(self, rid: str, tokens: list[int], lps: list[TokenLogprob] | None, reason: str | None, cached: int) -> None:
        queue = self._queues.get(rid)
        if queue is None:
            return
        seq = self._seqs[rid]
        self._seqs[rid] = seq + 1
        queue.put_nowait(TokenChunk(request_id=rid, seq=seq, token_ids=tokens, logprobs=lps, finish_reason=reason,
                                    num_cached_tokens=cached if seq == 0 else None))
        if reason is not None:
            del self._queues[rid], self._seqs[rid]

    async def _loop(self) -> None:
        while True:
            if not self.engine.has_unfinished_requests():
                await asyncio.sleep(0.005)
                continue
            async with self._lock:
                outs = await asyncio.to_thread(self.engine.step)
                events = self.engine.block_manager.drain_events()
            for out in outs:
                lps = None
                if out.logprobs is not None:
                    lps = [TokenLogprob.from_engine(lp) for lp in out.logprobs[-len(out.new_token_ids):]]
                self._emit(out.request_id, out.new_token_ids, lps, out.finish_reason if out.finished else None,
                           out.num_cached_tokens)
            await self._publish_events(events)
            await asyncio.sleep(0)

    async def _publish_events(self, events: list) -> None:  # noqa: ANN001
        stored = [e.block_hash for e in events if isinstance(e, EngineStored)]
        removed = [e.block_hash for e in events if isinstance(e, EngineRemoved)]
        if removed:
            await bus.publish(self.nc, subjects.decode_events(self.worker_id), BlockRemoved(worker_id=self.worker_id, hashes=removed))
        if stored:
            await bus.publish(self.nc, subjects.decode_events(self.worker_id), BlockStored(worker_id=self.worker_id, hashes=stored))

    async def _beats(self) -> None:
        while True:
            if self.beating:
                s = self.engine.stats()
                bm = self.engine.block_manager
                await bus.publish(self.nc, subjects.decode_load(self.worker_id), LoadBeat(
                    worker_id=self.worker_id, running=s.running, waiting=s.waiting, free_blocks=s.free_blocks,
                    total_blocks=s.total_blocks, ts=time.time(), block_size=bm.block_size, hash_root=bm.root,
                    max_model_len=self.engine.max_model_len))
            await asyncio.sleep(self.beat_interval_s)


class Mesh:
    """Owns a background event loop; `call(coro)` runs a coroutine there and returns its result."""

    def __init__(self, workdir: Path, model_dir: Path, api_key: str | None = None, **gateway: Any) -> None:
        self.model_dir = model_dir
        self.nats = NatsServer(workdir=workdir).start()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mesh", daemon=True)
        self._thread.start()
        self.gateway = GatewayService(GatewayConfig(model_dir=str(model_dir), served_model_name="tiny", port=0,
                                                    api_key=api_key, health_timeout_s=0.5, worker_expiry_s=1.0, **gateway))
        self.tokenizer: TokenizerService | None = None
        self.decoders: dict[str, EngineResponder] = {}
        self.conns: list[Client] = []
        self.call(self._start_gateway())

    @property
    def url(self) -> str:
        return self.gateway.url

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        fut: Future[T] = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), self._loop)
        return fut.result(timeout + 5)

    async def _connect(self) -> Client:
        nc = await bus.connect(self.nats.url)
        self.conns.append(nc)
        return nc

    async def _start_gateway(self) -> None:
        self.nc = await self._connect()
        await self.gateway.start(await self._connect())

    def start_tokenizer(self) -> None:
        async def go() -> None:
            self.tokenizer = TokenizerService(load_tokenizer(self.model_dir))
            await self.tokenizer.start(await self._connect())
        self.call(go())

    def start_decoder(self, worker_id: str, **kw: Any) -> EngineResponder:
        async def go() -> EngineResponder:
            d = EngineResponder(str(self.model_dir), worker_id, **kw)
            await d.start(await self._connect())
            self.decoders[worker_id] = d
            return d
        return self.call(go(), timeout=60)

    def wait_until(self, predicate, timeout: float = 5.0) -> None:  # noqa: ANN001
        end = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > end:
                raise AssertionError("condition not reached in time")
            time.sleep(0.02)

    def close(self) -> None:
        async def go() -> None:
            await self.gateway.drain(1.0)
            for d in self.decoders.values():
                await d.stop()
            if self.tokenizer is not None:
                await self.tokenizer.drain(1.0)
            for nc in self.conns:
                await nc.close()
        try:
            self.call(go())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            self.nats.stop()
