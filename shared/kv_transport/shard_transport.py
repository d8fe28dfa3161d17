"""The direct channel (shared/kv_transport/direct.py) as a tensor-parallel rank's shard transport: what
shared/engine/tp/shard_link.py's ShardLink sends and receives each rank's KV head shard over. The engine
declares the interface it needs; the process that assembles a rank (services/tp_rank.py) hands it this one."""
from __future__ import annotations

import asyncio

from shared.kv_blocks import KVBlocks
from shared.kv_transport.base import BlockWriter, TransferError
from shared.kv_transport.direct import DirectSender, DirectServer
from shared.kv_transport.incoming import TransferRegistry


class DirectShardTransport:
    """A receiver (decode workers' ranks) opened on the first listen, and a sender (prefill workers' ranks)."""

    def __init__(self) -> None:
        self.registry = TransferRegistry()
        self.server: DirectServer | None = None
        self.sender = DirectSender()

    async def listen(self, host: str) -> int:
        if self.server is None:
            self.server = DirectServer(self.registry, host)
            await self.server.start()
        return self.server.port

    def expect(self, transfer_id: str, num_blocks: int, write: BlockWriter, deadline_s: float, token: bytes) -> None:
        self.registry.expect(transfer_id, num_blocks, write, deadline_s, token)

    def forget(self, transfer_id: str) -> None:
        self.registry.forget(transfer_id)

    def num_frames(self, blocks: KVBlocks) -> int:
        return self.sender.num_frames(blocks)

    async def send(self, endpoint: str, token: bytes, transfer_id: str, blocks: KVBlocks, deadline_s: float,
                   first_seq: int, final: bool) -> str | None:
        try:
            await self.sender.send(endpoint, token, transfer_id, blocks, deadline_s, first_seq=first_seq, final=final)
        except (TransferError, OSError, asyncio.TimeoutError) as e:
            return f"{type(e).__name__}: {e}"
        return None

    async def close(self) -> None:
        await self.sender.close()
        if self.server is not None:
            await self.server.stop()
