"""What decode and prefill workers share: the engine on its own thread, the kvstore client and the
offloader (what to send is the engine's KV tiers' call: shared/engine/kv_tiers.py), the KV transport,
load beats; a reserved prompt's prefix is loaded by the tiers' lookup chain (shared/engine/kv_lookup.py)."""
from __future__ import annotations

import asyncio
import os
import secrets
import socket
from collections.abc import Callable
from functools import partial

from nats.aio.client import Client

from shared import bus
from shared.config import EngineConfig
from shared.engine.commands import EvictAll, Stats
from shared.engine.engine_thread import EngineThread
from shared.engine.executor import ModelExecutor
from shared.engine.kv_lookup import KVLookup
from shared.engine.llm_engine import EngineStats, LLMEngine, Reservation
from shared.engine.offload import Offloader
from shared.kv_transport import MeshKVTransport, NatsKVTransport
from shared.kv_transport.outgoing import PushStats
from services.kvstore_client import KVStoreClient, mac_key
from shared.engine.block_events import BlockEvent, BlocksStored
from shared.protocol.events import BlockRemoved, BlockStored, LoadBeat
from shared.protocol.generate import RequestTimings
from shared.service_runner import Service
from services import tp_rank
from services.load_beats import LoadBeats, load_beat
from services.lora_updates import serve_lora_updates

STATS_WAIT_S = 0.2  # how long a beat waits for the engine to be between steps


def mesh_engine(config: EngineConfig) -> LLMEngine:
    """The real engine of a mesh worker: its follower ranks (tensor parallelism) get the data plane that moves
    KV rank to rank (services/tp_rank.py)."""
    return LLMEngine(config, partial(ModelExecutor, follower_main=tp_rank.__name__))


class EngineWorker(Service):
    role: str  # "decode" | "prefill": the label of this worker's metrics
    transport_class: type[NatsKVTransport] | None = None  # tests swap in a network test double
    kv_host: str | None = None  # where the direct KV channel listens (decode); None: the address NATS is reached from
    direct_kv: bool = True  # False: KV pushes to this worker go over NATS only
    # Builds the engine from the config; None: the real LLMEngine. The simulated engine (--engine sim,
    # shared/engine/sim_engine.py) comes in here and nowhere else.
    engine_factory: Callable[[EngineConfig], LLMEngine] | None = None

    def __init__(self, engine_config: EngineConfig, use_kvstore: bool, worker_id: str,
                 beat_interval_s: float = 1.0) -> None:
        self.engine_config = engine_config
        self.use_kvstore = use_kvstore
        self.worker_id = worker_id
        self.incarnation = secrets.token_hex(8)  # this process's life under worker_id (LoadBeat.incarnation)
        self.beat_interval_s = beat_interval_s
        self.kv_push = PushStats()  # KV this worker pushed to others (a prefill worker's)
        self._stats_pending: asyncio.Future | None = None
        self._last_stats: EngineStats | None = None

    async def start_engine(self, nc: Client) -> None:
        self.nc = nc
        self.kvstore = KVStoreClient(nc, key=mac_key(self.engine_config.cache_salt)) if self.use_kvstore else None
        self.offloader = Offloader(self.kvstore) if self.kvstore else None
        self.thread = EngineThread(asyncio.get_running_loop(), self._on_step, self._post_step if self.kvstore else None)
        # The engine is built on the thread that will step it: no torch op of this worker runs elsewhere.
        self.engine = await self.thread.start(self._build_engine)
        self.block_size = self.engine.config.block_size
        self.lookup = KVLookup(self.engine.tiers, self.thread.run, self.block_size,
                               self.kvstore.get_chain if self.kvstore else None)
        if self.transport_class is not None:
            self.transport = self.transport_class(nc)
        elif self.direct_kv:
            self.transport = MeshKVTransport(nc, kv_host=self.kv_host)
        else:
            self.transport = NatsKVTransport(nc)
        self.beats = LoadBeats(self.beat_interval_s, self._load_snapshot, self._publish_load)
        # Runtime LoRA loads and unloads from the gateway (services/lora_updates.py), on this worker's own subject.
        self.lora_updates = await serve_lora_updates(nc, self.worker_id, self.thread, self.beats.changed)

    def _build_engine(self) -> LLMEngine:
        engine = (self.engine_factory or mesh_engine)(self.engine_config)
        if self.use_kvstore and engine.config.offload_policy == "eviction":
            engine.tiers.offload_by_eviction()
        return engine

    def load_subject(self) -> str:
        raise NotImplementedError

    async def _publish_load(self, beat: LoadBeat) -> None:
        await bus.publish(self.nc, self.load_subject(), beat)

    async def _engine_stats(self) -> EngineStats:
        """The engine's figures, fresh when it answers between steps within STATS_WAIT_S, else the last
        ones. A beat is also the worker's sign of life: a long step (seconds for a big prefill on a CPU)
        must not make the gateway think the worker died and migrate everything away from it."""
        if self._stats_pending is None or self._stats_pending.done():
            self._stats_pending = asyncio.ensure_future(self.thread.run(Stats()))
        try:
            self._last_stats = await asyncio.wait_for(asyncio.shield(self._stats_pending),
                                                      STATS_WAIT_S if self._last_stats is not None else None)
        except asyncio.TimeoutError:
            pass
        assert self._last_stats is not None
        return self._last_stats

    async def _load_snapshot(self) -> LoadBeat:
        stats = await self._engine_stats()
        e = self.engine
        kv_dtype = str(e.runner.kv_caches[0][0].dtype).removeprefix("torch.")
        off = self.offloader
        return load_beat(self.worker_id, self.role, stats, self.kvstore_hit_tokens, self.block_size,
                         e.block_manager.root, e.max_model_len, kv_dtype, off.submitted if off else 0,
                         off.dropped if off else 0, self.host_hit_tokens,
                         e.tiers.host_bytes,
                         self.transport.endpoint or "", self.kv_push, self.nc.stats["reconnects"],
                         *lora_names(getattr(e, "lora", None)), incarnation=self.incarnation)

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
        if any(o.finished for o in outputs):
            self.beats.changed()
        else:  # a racy read of one int, only to decide whether a beat is due; the beat itself is consistent
            bm = self.engine.block_manager
            self.beats.kv_moved(bm.num_free_blocks, bm.num_blocks)

    async def offload_before_leaving(self, remaining_s: float) -> None:
        """Under the eviction policy a worker leaving the mesh would take its caches with it: its cached
        blocks and host tier go to the kvstore first (best effort, within what is left of the grace)."""
        if self.offloader is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + remaining_s
        if self.engine.config.offload_policy == "eviction" and self.thread.error is None:
            assert self.kvstore is not None
            await self.offloader.send_all(await self.thread.run(EvictAll(self.kvstore)), remaining_s)
        await self.offloader.flush(max(0.0, deadline - loop.time()))
        await self.offloader.abandon()

    def _post_step(self, engine: LLMEngine, outputs, events):
        return engine.tiers.collect(events, self.kvstore, engine.config.offload_policy)

    async def load_prefix(self, rid: str, res: Reservation) -> int:
        """A held request's uncached blocks from the tiers below the device (host, then kvstore); returns
        its cached tokens."""
        return await self.lookup.load(rid, res)

    @property
    def host_hit_tokens(self) -> int:
        return self.lookup.host_hit_tokens

    @property
    def kvstore_hit_tokens(self) -> int:
        return self.lookup.kvstore_hit_tokens


def lora_names(manager) -> tuple[list[str], list[str]]:  # noqa: ANN001 - a LoRAManager or None
    """(adapters held, adapters resident) for a beat."""
    return (list(manager.loaded), list(manager.resident)) if manager is not None else ([], [])


def to_wire(event: BlockEvent, worker_id: str) -> BlockStored | BlockRemoved:
    """An engine's block event as the mesh's message: with this worker's id, without its block ids."""
    if isinstance(event, BlocksStored):
        return BlockStored(worker_id=worker_id, hashes=event.hashes, parent=event.parent, tier=event.tier)
    return BlockRemoved(worker_id=worker_id, hashes=event.hashes, tier=event.tier)


def request_timings(out) -> RequestTimings | None:  # noqa: ANN001 - a RequestOutput
    """Queue, prefill and decode time of a finished request, measured by the engine's clock."""
    if out.first_token_time is None or out.finished_time is None:
        return None
    scheduled = out.first_scheduled_time if out.first_scheduled_time is not None else out.arrival_time
    return RequestTimings(queued_s=max(0.0, scheduled - out.arrival_time),
                          prefill_s=max(0.0, out.first_token_time - scheduled),
                          decode_s=max(0.0, out.finished_time - out.first_token_time))


def default_worker_id(role: str) -> str:
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())[:40]
    return f"{role}-{host}-{os.getpid()}"
