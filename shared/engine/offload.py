"""Sending offloaded KV blocks to the kvstore, shared by decode and prefill workers.

What to send, and when (the eviction and write-through policies), is decided by the engine's KV tiers
(shared/engine/kv_tiers.py, collect), on the engine thread; the Offloader here sends it from the event
loop. Best effort with a bound on puts in flight: a slow kvstore drops offloads (counted), never
requests, and never slows the engine.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from shared.kv_blocks import KVBlocks

log = logging.getLogger(__name__)


class BlockStore(Protocol):
    """Where offloaded blocks go (the kvstore client is one; the engine layer does not know the bus)."""

    def needs_offload(self, block_hash: bytes) -> bool: ...

    async def put(self, blocks: KVBlocks, parents: list[bytes | None]) -> None: ...


@dataclass
class OffloadBatch:
    """Named blocks (host copies) for the kvstore, with each block's parent hash where known."""

    blocks: KVBlocks
    parents: list[bytes | None]

    @property
    def hashes(self) -> list[bytes]:
        return self.blocks.hashes

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes


POLICIES = ("eviction", "write-through")


class Offloader:
    """Puts to the kvstore, rate-limited: at most max_in_flight puts and max_in_flight_bytes under way;
    what does not fit waits in a queue of at most max_queued_bytes (host copies) and goes as puts
    finish; past that, offloads are dropped and counted, never requests."""

    def __init__(self, client: BlockStore, max_in_flight: int = 4, max_put_bytes: int = 16 << 20,
                 max_in_flight_bytes: int = 32 << 20, max_queued_bytes: int = 256 << 20) -> None:
        self.client = client
        self.max_in_flight = max_in_flight
        self.max_put_bytes = max_put_bytes  # a put is one bus upload: big batches go as several
        # Bytes of puts under way at once. nats-server cuts a client it cannot write to fast enough once
        # 64 MiB (its default max_pending) wait for it: four 32 MiB puts of a leaving worker did exactly
        # that to the kvstore (Slow Consumer, MaxPending exceeded; its connection dropped, puts lost).
        self.max_in_flight_bytes = max_in_flight_bytes
        self.max_queued_bytes = max_queued_bytes
        self._tasks: dict[asyncio.Task, OffloadBatch] = {}  # the puts under way
        self._queue: deque[OffloadBatch] = deque()  # puts waiting for room
        self._queued_bytes = 0
        self.dropped = 0  # blocks not offloaded: the queue was full, or a leaving worker ran out of time
        self.submitted = 0  # blocks handed to the store

    def _puts(self, batch: OffloadBatch) -> list[OffloadBatch]:
        """batch cut into puts of at most max_put_bytes (a put is one bus upload)."""
        n = batch.blocks.num_blocks
        per_block = batch.blocks.bytes_per_block if n else 0
        step = max(1, self.max_put_bytes // per_block) if per_block else max(n, 1)
        if n <= step:
            return [batch]
        return [OffloadBatch(batch.blocks.blocks(i, i + step), batch.parents[i:i + step]) for i in range(0, n, step)]

    def _room(self, put: OffloadBatch) -> bool:
        if not self._tasks:
            return True
        return (len(self._tasks) < self.max_in_flight
                and sum(p.nbytes for p in self._tasks.values()) + put.nbytes <= self.max_in_flight_bytes)

    def submit(self, batch: OffloadBatch | None) -> None:
        """Best effort: each put starts now if there is room in flight, else waits in the queue if that
        has room, else is dropped."""
        for put in self._puts(batch) if batch is not None else []:
            self._enqueue(put, self.max_queued_bytes)

    async def send_all(self, batch: OffloadBatch | None, timeout: float) -> None:
        """Every block of batch (a worker leaving the mesh): queued whatever the queue holds, sent at the
        same bounded pace, waited for up to timeout."""
        for put in self._puts(batch) if batch is not None else []:
            self._enqueue(put, None)
        await self.flush(timeout)

    def _enqueue(self, put: OffloadBatch, cap: int | None) -> None:
        if not self._queue and self._room(put):
            self._start(put)
        elif cap is None or self._queued_bytes + put.nbytes <= cap:
            self._queue.append(put)
            self._queued_bytes += put.nbytes
        else:
            self.dropped += len(put.hashes)

    def _pump(self) -> None:
        while self._queue and self._room(self._queue[0]):
            put = self._queue.popleft()
            self._queued_bytes -= put.nbytes
            self._start(put)

    def _start(self, put: OffloadBatch) -> None:
        self.submitted += len(put.hashes)
        task = asyncio.ensure_future(self.client.put(put.blocks, put.parents))
        self._tasks[task] = put
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.pop(task, None)
        self._pump()

    async def flush(self, timeout: float) -> None:
        """Until every queued put went out and every put finished, or timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._tasks and loop.time() < deadline:
            await asyncio.wait(set(self._tasks), timeout=deadline - loop.time(), return_when=asyncio.FIRST_COMPLETED)

    async def abandon(self) -> None:
        """Gives up what is still queued or under way (a leaving worker whose grace ran out): counted as
        dropped, and ended before the worker's connection closes under the puts."""
        self.dropped += sum(len(put.hashes) for put in self._queue)
        self._queue.clear()
        self._queued_bytes = 0
        tasks = dict(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.dropped += sum(len(put.hashes) for t, put in tasks.items() if t.cancelled())
