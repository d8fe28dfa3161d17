"""A real mesh for gateway tests, in a background thread: nats-server, the tokenizer service, the
gateway on a free port, and real decode workers (local prefill, no kvstore) on a tiny checkpoint.
Tests talk to the gateway over HTTP from the main thread with the official openai client.
"""
from __future__ import annotations

import asyncio
import secrets
from contextlib import contextmanager
import threading
import time
from collections.abc import Coroutine, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from nats.aio.client import Client

from services.decode.service import DecodeService
from services.gateway.config import GatewayConfig
from services.kvstore.service import KVStoreService
from services.prefill.service import PrefillService
from services.gateway.service import GatewayService
from services.tokenizer.service import TokenizerService
from shared import bus
from shared.bus.nats_cluster import NatsCluster
from shared.bus.natsd import NatsServer
from shared.bus.roles import Identity, identity_permissions
from shared.models.tokenizer import load_tokenizer
from tests.mesh_helpers import decode_service, kvstore_service, prefill_service

T = TypeVar("T")


class Mesh:
    """Owns a background event loop; `call(coro)` runs a coroutine there and returns its result."""

    def __init__(self, workdir: Path, model_dir: Path, api_key: str | None = None, nats_servers: int = 1,
                 served_model_name: str = "tiny", locked_workers: tuple[str, ...] | None = None,
                 **gateway: Any) -> None:
        """nats_servers > 1: a NATS cluster; each connection (gateway, then services in start order)
        gets the next server as its home and the others for failover. locked_workers: a locked-down bus
        as `kvmesh up` makes it (shared/bus/roles.py), one identity per service, the decode workers with
        these ids."""
        self.model_dir = model_dir
        self.identities: dict[str, tuple[Identity, str]] = {}  # user -> (identity, password)
        authorization = None
        if locked_workers is not None:
            ids = [Identity("harness", "gateway"), Identity("gateway-0", "gateway"), Identity("tokenizer-0", "tokenizer"),
                   Identity("kvstore-0", "kvstore"), *(Identity(f"prefill-{i}", "prefill") for i in range(4)),
                   *(Identity(f"decode-{w}", "decode", w) for w in locked_workers)]
            self.identities = {i.user: (i, secrets.token_urlsafe(16)) for i in ids}
            authorization = {"users": [{"user": i.user, "password": pw, "permissions": identity_permissions(i)}
                                       for i, pw in self.identities.values()]}
        self._free = {"prefill": [f"prefill-{i}" for i in range(4)]}
        self.cluster = (NatsCluster(nats_servers, workdir=workdir, authorization=authorization).start()
                        if nats_servers > 1 else None)
        self.nats = self.cluster.servers[0] if self.cluster else NatsServer(workdir=workdir, authorization=authorization).start()
        self.homes: dict[int, int] = {}  # id(connection) -> its home server's index in the cluster
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mesh", daemon=True)
        self._thread.start()
        # 2 s: the gateway's own default. 1 s flaked with four engines and the event loop in one process on 2
        # cores (a beat late by a second reads as a dead worker); tests of failover timing pass their own.
        # Input-lag admission off unless a test asks for it: here the gateway shares one event loop with every
        # worker of the mesh, so its probe measures their work too (a 32-request test got a 429 at 0.58 s; a real
        # gateway is its own process). tests/test_gateway_overload.py turns it on.
        settings = {"health_timeout_s": 0.5, "worker_expiry_s": 2.0, "max_input_lag_s": 0.0, **gateway}
        self.gateway = GatewayService(GatewayConfig(model_dir=str(model_dir), served_model_name=served_model_name, port=0,
                                                    api_key=api_key, **settings))
        self.tokenizer: TokenizerService | None = None
        self.decoders: dict[str, DecodeService] = {}
        self.prefills: list[PrefillService] = []
        self.kvstores: list[KVStoreService] = []
        self.conns: list[Client] = []
        self.call(self._start_gateway())

    @property
    def url(self) -> str:
        return self.gateway.url

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        fut: Future[T] = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), self._loop)
        return fut.result(timeout + 5)

    def call_soon(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> Future[T]:
        """Start coro on the mesh loop without waiting for it."""
        return asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), self._loop)

    async def _connect(self, user: str = "harness") -> Client:
        auth = {}
        if self.identities:
            identity, password = self.identities[user]
            auth = {"user": user, "password": password, "inbox_prefix": identity.inbox_prefix}
        if self.cluster is None:
            nc = await bus.connect(self.nats.url, **auth)
        else:
            home = len(self.conns) % self.cluster.size
            nc = await bus.connect(self.cluster.url_from(home), dont_randomize=True, **auth)
            self.homes[id(nc)] = home
        self.conns.append(nc)
        return nc

    async def _start_gateway(self) -> None:
        self.nc = await self._connect()
        await self.gateway.start(await self._connect("gateway-0"))

    def start_tokenizer(self) -> None:
        async def go() -> None:
            self.tokenizer = TokenizerService(load_tokenizer(self.model_dir))
            await self.tokenizer.start(await self._connect("tokenizer-0"))
        self.call(go())

    def start_decoder(self, worker_id: str, num_kv_blocks: int = 96, threshold: int = 1 << 30,
                      use_kvstore: bool = False, remote_timeout_s: float = 10.0,
                      beat_interval_s: float = 0.2, **engine) -> DecodeService:
        """engine: more EngineConfig fields (speculative_config, ...)."""
        async def go() -> DecodeService:
            d = decode_service(self.model_dir, worker_id, threshold, kvstore=use_kvstore, num_kv_blocks=num_kv_blocks,
                               transfer_timeout=remote_timeout_s, remote_timeout=remote_timeout_s,
                               beat_interval_s=beat_interval_s, **engine)
            await d.start(await self._connect(f"decode-{worker_id}"))
            self.decoders[worker_id] = d
            return d
        return self.call(go(), timeout=60)

    def start_prefill(self, num_kv_blocks: int = 96, use_kvstore: bool = False) -> PrefillService:
        async def go() -> PrefillService:
            p = prefill_service(self.model_dir, kvstore=use_kvstore, num_kv_blocks=num_kv_blocks)
            await p.start(await self._connect(self._free["prefill"].pop(0) if self.identities else "harness"))
            self.prefills.append(p)
            return p
        return self.call(go(), timeout=60)

    def start_kvstore(self, capacity: int = 64 << 20) -> KVStoreService:
        async def go() -> KVStoreService:
            k = kvstore_service(capacity)
            await k.start(await self._connect("kvstore-0"))
            self.kvstores.append(k)
            return k
        return self.call(go())

    def engine_state(self, service) -> tuple[int, int, int]:  # noqa: ANN001
        """(requests held, free blocks, total blocks) of a decode or prefill worker's engine."""
        return self.call(service.thread.call(lambda e: (len(e.scheduler.requests), e.block_manager.num_free_blocks,
                                                        e.block_manager.num_blocks)))

    def held(self, worker_id: str) -> int:
        """Requests the worker's engine still holds."""
        d = self.decoders[worker_id]
        return self.call(d.thread.call(lambda e: len(e.scheduler.requests)))

    def crash(self, worker_id: str) -> None:
        """The worker goes silent as a killed process would: no more tokens, beats or answers."""
        d = self.decoders.pop(worker_id)

        async def go() -> None:
            d.outbox.stop()  # on the mesh's loop: it cancels the outbox's task
            await _silence(d)
        self.call(go())

    def crash_prefill(self) -> None:
        """The (first) prefill worker goes silent as a killed process would."""
        self.call(_silence(self.prefills.pop(0)))

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
                await d.drain(1.0)
            for p in self.prefills:
                await p.drain(1.0)
            for k in self.kvstores:
                await k.drain(1.0)
            if self.tokenizer is not None:
                await self.tokenizer.drain(1.0)
            for nc in self.conns:
                await nc.close()
        try:
            self.call(go())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            (self.cluster or self.nats).stop()


async def _silence(worker: DecodeService | PrefillService) -> None:
    """What a SIGKILL looks like on the bus: beats, endpoints, cancels and KV transport stop; the engine too."""
    worker.beats.stop()
    await worker.micro.stop()
    await worker.cancel_sub.unsubscribe()
    if isinstance(worker, DecodeService):
        await worker.replay_served.stop()
    await worker.transport.stop()
    worker.thread.stop()


@contextmanager
def one_decoder_mesh(tmp_path_factory, name: str = "mesh", arch: str = "llama", checkpoint: dict | None = None,
                     model_dir: Path | None = None, **gateway: Any) -> Iterator[Mesh]:
    """A tokenizer, one decode worker ("d0") and the gateway on `model_dir` or a fresh test checkpoint."""
    from tests.checkpoints import build_checkpoint

    if model_dir is None:
        model_dir = build_checkpoint(arch, tmp_path_factory.mktemp(name) / arch, **(checkpoint or {})).path
    m = Mesh(tmp_path_factory.mktemp("nats"), model_dir, **gateway)
    try:
        m.start_tokenizer()
        m.start_decoder("d0")
        m.wait_until(lambda: m.gateway.ctx.router.alive())
        yield m
    finally:
        m.close()


def openai_client(mesh: Mesh, api_key: str = "unused"):  # noqa: ANN201
    import openai

    return openai.OpenAI(base_url=f"{mesh.url}/v1", api_key=api_key, max_retries=0, timeout=60)
