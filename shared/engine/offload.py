"""Write-through offload of newly cached blocks to the kvstore, shared by decode and prefill workers.

Blocks are copied out on the engine thread right after the step that filled them (collect), then
sent from the event loop (Offloader). Offloading at store time rather than at eviction means a
prefix computed on one worker is in the kvstore before another worker asks for it; evicted blocks
are then already there. Best effort with a bound on puts in flight: a slow kvstore drops offloads,
never slows the engine.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from shared.engine.llm_engine import LLMEngine
from shared.protocol.events import BlockEvent, BlockStored

log = logging.getLogger(__name__)


class BlockStore(Protocol):
    """Where offloaded blocks go (the kvstore client is one; the engine layer does not know the bus)."""

    def needs_offload(self, block_hash: bytes) -> bool: ...

    async def put(self, hashes: list[bytes], parents: list[bytes | None], k: torch.Tensor, v: torch.Tensor) -> None: ...


@dataclass
class OffloadBatch:
    hashes: list[bytes]
    parents: list[bytes | None]
    k: torch.Tensor
    v: torch.Tensor


def collect(engine: LLMEngine, events: list[BlockEvent], client: BlockStore) -> OffloadBatch | None:
    """Engine thread: copy out the KV of blocks stored by this step that the kvstore lacks."""
    hashes: list[bytes] = []
    parents: list[bytes | None] = []
    block_ids: list[int] = []
    for e in events:
        if not isinstance(e, BlockStored):
            continue
        for i, (h, block_id) in enumerate(zip(e.hashes, e.block_ids)):
            if client.needs_offload(h):
                hashes.append(h)
                parents.append(e.hashes[i - 1] if i else e.parent)
                block_ids.append(block_id)
    if not hashes:
        return None
    k, v = engine.read_blocks(block_ids)
    return OffloadBatch(hashes, parents, k, v)


class Offloader:
    def __init__(self, client: BlockStore, max_in_flight: int = 4) -> None:
        self.client = client
        self.max_in_flight = max_in_flight
        self._tasks: set[asyncio.Task] = set()
        self.dropped = 0  # blocks not offloaded because too many puts were in flight (backpressure)
        self.submitted = 0  # blocks handed to the store

    def submit(self, batch: OffloadBatch | None) -> None:
        if batch is None:
            return
        if len(self._tasks) >= self.max_in_flight:
            self.dropped += len(batch.hashes)
            return
        self.submitted += len(batch.hashes)
        task = asyncio.ensure_future(self.client.put(batch.hashes, batch.parents, batch.k, batch.v))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def flush(self, timeout: float) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)
