"""The KV transport workers use: NATS for control and as the fallback, bulk bytes on the direct channel
(direct.py: shared memory on one host, TCP between hosts) whenever the receiver advertised one.

A decode worker listens on the address it uses to reach NATS (what the other workers can most likely
reach too) unless told another (`--kv-host`); the endpoint and a per-transfer token travel in the
RemotePrefillRequest. A sender that cannot reach the endpoint pushes over NATS instead.
"""
from __future__ import annotations

import asyncio
import logging
import socket

from shared.kv_blocks import KVBlocks
from nats.aio.client import Client

from shared.kv_transport.base import BlockWriter
from shared.kv_transport.direct import DirectSender, DirectServer, DirectSettings
from shared.kv_transport.incoming import TransferRegistry
from shared.kv_transport.nats_transport import NatsKVTransport
from shared.kv_transport.outgoing import OutgoingTransfer

log = logging.getLogger(__name__)


def local_address_towards(nc: Client) -> str:
    """The local IP this process reaches its NATS server from (a UDP connect sends nothing)."""
    url = nc.connected_url
    host = url.hostname if url is not None else None
    if not host:
        return "127.0.0.1"
    try:
        family = socket.getaddrinfo(host, url.port or 4222, type=socket.SOCK_DGRAM)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, url.port or 4222))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class MeshKVTransport(NatsKVTransport):
    def __init__(self, nc: Client, window: int = 32, registry: TransferRegistry | None = None,
                 kv_host: str | None = None, settings: DirectSettings = DirectSettings()) -> None:
        super().__init__(nc, window, registry)
        self.kv_host = kv_host
        self.settings = settings
        self.server: DirectServer | None = None
        self.sender = DirectSender(settings)
        self.direct_sends = 0  # transfers that went over the direct channel
        self.fallbacks = 0  # transfers that found it unreachable and went over NATS

    async def start(self, worker_id: str | None) -> None:
        await super().start(worker_id)
        if worker_id is not None:
            host = self.kv_host or local_address_towards(self.nc)
            self.server = DirectServer(self.registry, host, 0, self.settings)
            await self.server.start()
            self.endpoint = self.server.endpoint

    async def stop(self) -> None:
        await self.sender.close()
        if self.server is not None:
            await self.server.stop()
        await super().stop()

    def expect(self, transfer_id: str, num_blocks: int, write: BlockWriter, deadline_s: float,
               token: bytes = b"") -> asyncio.Future:
        return self.registry.expect(transfer_id, num_blocks, write, deadline_s, token)

    def open_transfer(self, dest_worker: str, transfer_id: str, deadline_s: float, endpoint: str | None = None,
                      token: bytes = b"") -> OutgoingTransfer:
        tx = OutgoingTransfer(transfer_id, deadline_s, self._bus_send(dest_worker, transfer_id), self.sender,
                              endpoint, token)
        tx.add_done_callback(lambda ok: self._count(tx, dest_worker, ok))
        return tx

    def _count(self, tx: OutgoingTransfer, dest_worker: str, ok: bool) -> None:
        if ok and tx.went_direct:
            self.direct_sends += 1
        elif ok and tx.direct_offered:
            self.fallbacks += 1
            log.info("direct KV channel to %s unavailable, pushed over NATS: %s", dest_worker, tx.fell_back)

    async def send(self, dest_worker: str, transfer_id: str, blocks: KVBlocks, deadline_s: float,
                   endpoint: str | None = None, token: bytes = b"") -> int:
        """The whole transfer at once: one piece."""
        return await self.open_transfer(dest_worker, transfer_id, deadline_s, endpoint, token).finish(blocks)
