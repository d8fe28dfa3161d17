"""What a worker asks of the kvstore: the longest stored chain of its prompt's blocks, and offload.

Both are best effort: a kvstore that is down, slow or erroring costs a recompute, never a request.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import nats.errors
from nats.aio.client import Client

from shared import bus, subjects
from shared.protocol.kvstore import GetReply, GetRequest, PutReply, PutRequest
from shared.kv_blocks import KVBlocks

log = logging.getLogger(__name__)


class KVStoreClient:
    def __init__(self, nc: Client, timeout_s: float = 5.0, remember: int = 200_000) -> None:
        self.nc = nc
        self.timeout_s = timeout_s
        # Hashes already offloaded by this worker, so a block is sent once (bounded, LRU).
        self._offloaded: OrderedDict[bytes, None] = OrderedDict()
        self._remember = remember

    async def get_chain(self, hashes: list[bytes], max_blocks: int | None = None) -> KVBlocks | None:
        """The longest stored prefix of hashes (numbered from 0: the caller knows where its chain starts)."""
        if not hashes:
            return None
        try:
            reply = await bus.request(self.nc, subjects.KVSTORE_GET, GetRequest(hashes=hashes, max_blocks=max_blocks),
                                      timeout=self.timeout_s, expect=GetReply)
        except (bus.BusError, nats.errors.Error) as e:
            log.info("kvstore get failed, computing instead: %s", e)
            return None
        blocks = reply.blocks
        if not blocks:
            return None
        if [b.hash for b in blocks] != hashes[: len(blocks)]:
            log.warning("kvstore answered blocks that are not a prefix of the asked chain; ignoring them")
            return None
        try:
            return KVBlocks.from_stored(blocks)
        except ValueError as e:
            log.warning("kvstore answered blocks of mixed shapes; ignoring them: %s", e)
            return None

    def needs_offload(self, block_hash: bytes) -> bool:
        return block_hash not in self._offloaded

    async def put(self, blocks: KVBlocks, parents: list[bytes | None]) -> None:
        """Offload named blocks; parents[i] is block i's parent hash where known."""
        try:
            await bus.request(self.nc, subjects.KVSTORE_PUT, PutRequest(blocks=blocks.to_stored(parents)),
                              timeout=self.timeout_s, expect=PutReply)
        except (bus.BusError, nats.errors.Error) as e:  # the connection may be closing: best effort
            log.info("kvstore put of %d blocks failed: %s", blocks.num_blocks, e)
            return
        for h in blocks.hashes:
            self._offloaded[h] = None
            self._offloaded.move_to_end(h)
        while len(self._offloaded) > self._remember:
            self._offloaded.popitem(last=False)
