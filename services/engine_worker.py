"""What decode and prefill workers share: the engine on its own thread, the kvstore client with
write-through offload, the KV transport, and loading a reserved prompt's prefix from the kvstore."""
from __future__ import annotations

import asyncio

from nats.aio.client import Client
from opentelemetry import trace

from shared.config import EngineConfig
from shared.engine.engine_thread import EngineThread
from shared.engine.llm_engine import LLMEngine, Reservation
from shared.engine.offload import Offloader, collect
from shared.kv_transport import NatsKVTransport
from shared.kvstore_client import KVStoreClient
from shared.service_runner import Service

_tracer = trace.get_tracer("kvmesh.worker")


class EngineWorker(Service):
    def __init__(self, engine_config: EngineConfig, use_kvstore: bool) -> None:
        self.engine_config = engine_config
        self.use_kvstore = use_kvstore

    async def start_engine(self, nc: Client) -> None:
        self.nc = nc
        self.engine = await asyncio.to_thread(LLMEngine, self.engine_config)
        self.block_size = self.engine.config.block_size
        self.kvstore = KVStoreClient(nc) if self.use_kvstore else None
        self.offloader = Offloader(self.kvstore) if self.kvstore else None
        self.thread = EngineThread(self.engine, asyncio.get_running_loop(), self._on_step,
                                   self._post_step if self.kvstore else None)
        self.thread.start()
        self.transport = NatsKVTransport(nc)

    async def wait_closed(self) -> None:
        """Ends the service (non-zero exit, so a supervisor restarts it) if the engine thread crashed."""
        await self.thread.crashed.wait()
        await self.on_engine_crash()
        raise RuntimeError(f"engine thread crashed: {self.thread.error!r}")

    async def on_engine_crash(self) -> None:
        """Fail the requests in flight; subclasses know which those are."""

    def _on_step(self, outputs, events, offload) -> None:
        if self.offloader:
            self.offloader.submit(offload)

    def _post_step(self, engine: LLMEngine, outputs, events):
        return collect(engine, events, self.kvstore)

    async def load_from_kvstore(self, rid: str, res: Reservation) -> int:
        """Write the longest stored chain of a held request's uncached blocks; returns its cached tokens."""
        own = res.num_cached_tokens // self.block_size
        if self.kvstore is None or len(res.block_hashes) <= own:
            return res.num_cached_tokens
        with _tracer.start_as_current_span("kvstore.get", attributes={"kvmesh.blocks_wanted": len(res.block_hashes) - own}) as span:
            got = await self.kvstore.get_chain(res.block_hashes[own:])
            if got is None:
                return res.num_cached_tokens
            k, v = got
            def write(e: LLMEngine) -> bool:
                if rid not in e.held:  # cancelled meanwhile
                    return False
                e.write_blocks(rid, own, k, v)
                return True

            if not await self.thread.call(write):
                return res.num_cached_tokens
            span.set_attribute("kvmesh.blocks_loaded", k.shape[1])
        return (own + k.shape[1]) * self.block_size
