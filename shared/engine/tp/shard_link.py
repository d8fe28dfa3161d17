"""Rank-to-rank KV between a prefill worker and a decode worker of the same tensor-parallel degree: rank r of the
prefill worker sends its head shard of each block straight to rank r of the decode worker over the data plane
(shared/kv_transport/direct.py: shared memory on one host, TCP between hosts), instead of every shard being
gathered to rank 0, pushed whole, and scattered again. Degrees that differ still go through rank 0 as whole blocks
(re-sharded by head ranges on the receiver); tiers and the kvstore always hold whole blocks.

Who knows what is done: followers send the pieces of a transfer in order while the prefill computes on; at the
last piece each waits for all its acks (written into the decode rank's cache) and SEND_SHARDS all-reduces the
outcome, and only then does rank 0 hand out its own last piece: so when decode rank 0 has its shard of every
block, every rank has. Decode followers write into blocks rank 0
reserved and told them (EXPECT); rank 0 forgets the transfer on them (FORGET) before those blocks can be reused,
and frames arriving later are refused.

A follower's link runs an event loop on its own thread (the follower's main thread waits in collectives); writes
into the KV cache happen on that thread, into reserved blocks no step reads.

The link is given its data plane (a ShardTransport) by whoever assembles the rank's process: the engine
computes and knows the bytes it moves, not the mesh's transports that carry them."""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from shared.engine.kv_cache import KVCaches, write_blocks
from shared.kv_blocks import KVBlocks

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class ShardTarget:
    """Where a prefill-only request's KV goes rank by rank: the decode worker's transfer, and the endpoints of its
    ranks 1..N-1 (rank 0's shard takes the worker's usual path to the decode worker's rank 0)."""

    transfer_id: str
    token: bytes
    rank_endpoints: tuple[str, ...]
    deadline_s: float


class ShardSendError(RuntimeError):
    """A follower rank could not deliver its shard: the transfer is given up (decode computes the prompt)."""


class ShardTransport(Protocol):
    """The data plane a link moves shards over. Every method runs on the link's event loop thread."""

    async def listen(self, host: str) -> int:
        """Open the receiver on host (once); its port."""

    def expect(self, transfer_id: str, num_blocks: int, write: Callable[[KVBlocks], Awaitable[None]],
               deadline_s: float, token: bytes) -> None:
        """Accept frames of transfer_id up to logical block num_blocks, each handed to write."""

    def forget(self, transfer_id: str) -> None:
        """Refuse the transfer's frames from now on."""

    def num_frames(self, blocks: KVBlocks) -> int:
        """How many frames send() cuts blocks into (the next piece of a transfer numbers its frames on)."""

    async def send(self, endpoint: str, token: bytes, transfer_id: str, blocks: KVBlocks, deadline_s: float,
                   first_seq: int, final: bool) -> str | None:
        """Deliver blocks to endpoint and wait for their acks; None, or why they did not arrive."""

    async def close(self) -> None:
        """Close the sender's connections and the receiver."""


class ShardLink:
    """A follower rank's end of the data plane: a receiver (decode workers) and a sender (prefill workers)."""

    def __init__(self, kv_caches: Callable[[], KVCaches], transport: ShardTransport) -> None:
        self.kv_caches = kv_caches  # the runner's cache when a frame lands (the runner may swap it: the profile)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="tp-shard-link", daemon=True)
        self._thread.start()
        self.transport = transport
        self._next_seq: dict[str, int] = {}  # frames sent so far of each open outgoing transfer
        self._sending: dict[str, asyncio.Task] = {}  # its last piece going out (each piece waits for the one before)

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def listen(self, host: str) -> int:
        """Open the receiver on host; its port."""
        return self._call(self.transport.listen(host))

    def expect(self, transfer_id: str, token: bytes, block_ids: list[int], first_block: int, deadline_s: float) -> None:
        """Accept this rank's shard of logical blocks [first_block, first_block + len(block_ids)) into block_ids."""

        async def write(blocks: KVBlocks) -> None:  # on the loop thread, between frames: FORGET cannot interleave
            caches = self.kv_caches()
            cache = caches[0][0]
            if blocks.first_block < first_block:
                raise ValueError(f"block {blocks.first_block} before the transfer's first {first_block}")
            if blocks.k.shape[2:] != cache.shape[1:] or blocks.k.dtype != cache.dtype:
                raise ValueError(f"shard {tuple(blocks.k.shape)} {blocks.k.dtype} does not fit this rank's cache "
                                 f"{tuple(cache.shape)} {cache.dtype}")
            ids = block_ids[blocks.first_block - first_block : blocks.end_block - first_block]
            with torch.inference_mode():  # the cache is an inference tensor (allocated under inference mode)
                write_blocks(caches, ids, blocks.k.to(cache.device), blocks.v.to(cache.device),
                             blocks.first_layer)

        async def register() -> None:
            self.transport.expect(transfer_id, first_block + len(block_ids), write, deadline_s, token)

        self._call(register())

    def forget(self, transfer_id: str) -> None:
        async def go() -> None:
            self.transport.forget(transfer_id)

        self._call(go())

    def send(self, target: ShardTarget, endpoint: str, blocks: KVBlocks, final: bool) -> str | None:
        """Send this rank's shard of a piece after the transfer's earlier pieces. A piece that is not the last goes
        out while the engine computes on (None at once); the last waits for every piece's acks and returns the
        first error of any (None: all written at the receiver)."""
        tid = target.transfer_id
        seq = self._next_seq.pop(tid, 0)
        earlier = self._sending.pop(tid, None)

        async def piece() -> str | None:
            error = await earlier if earlier is not None else None
            if error is not None:
                return error
            try:
                return await asyncio.wait_for(self.transport.send(endpoint, target.token, tid, blocks,
                                                                  target.deadline_s, first_seq=seq, final=final),
                                              target.deadline_s)
            except asyncio.TimeoutError as e:
                return f"{type(e).__name__}: {e}"

        async def start() -> asyncio.Task:
            return asyncio.ensure_future(piece())

        task = self._call(start())
        if not final:
            self._sending[tid] = task
            self._next_seq[tid] = seq + self.transport.num_frames(blocks)
            return None

        async def wait() -> str | None:
            return await task

        return self._call(wait())

    def abandon(self, transfer_id: str) -> None:
        """The request ended before its last piece (cancelled): its pieces still going out finish on their own."""
        self._sending.pop(transfer_id, None)
        self._next_seq.pop(transfer_id, None)

    def close(self) -> None:
        try:
            self._call(asyncio.wait_for(self.transport.close(), 5))
        except (asyncio.TimeoutError, OSError, RuntimeError) as e:
            log.warning("shard link did not close cleanly: %s", e)
        self.loop.call_soon_threadsafe(self.loop.stop)


def local_kv(blocks: torch.Tensor) -> torch.Tensor:
    """A shard on the CPU for the data plane (the direct channel reads host memory)."""
    return blocks.cpu().contiguous()
