"""What a worker asks of the kvstore: the longest stored chain of its prompt's blocks, and offload.

Both are best effort: a kvstore that is down, slow or erroring costs a recompute, never a request.

Every process with a kvstore credential can store blocks under any hash, and the kvstore keeps the first block
stored under a hash. So a worker binds each block it stores to the mesh's secret: a MAC (keyed BLAKE2b) over
its hash, parent, geometry and bytes, with a key derived from the cache salt, which only engine workers hold.
It reads back only blocks whose MAC checks out (the chain stops at the first that does not; the rest is
computed): a kvstore, gateway or tokenizer credential cannot plant KV for a prompt. A mesh without a cache
salt has no key and neither makes nor checks MACs.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import struct
from collections import OrderedDict

import nats.errors
from nats.aio.client import Client

from shared import bus, subjects
from shared.protocol.kvstore import GetReply, GetRequest, PutReply, PutRequest, StoredBlock
from shared.kv_blocks import KVBlocks

log = logging.getLogger(__name__)


def mac_key(cache_salt: str) -> bytes | None:
    """The blocks' MAC key from the mesh's cache salt (None without one)."""
    return hashlib.sha256(b"kvmesh kvstore block mac\0" + cache_salt.encode()).digest() if cache_salt else None


def block_mac(key: bytes, block: StoredBlock) -> bytes:
    h = hashlib.blake2b(key=key, digest_size=16)
    h.update(block.hash)
    h.update(b"\1" + block.parent if block.parent is not None else b"\0")
    for t in (block.k, block.v):
        h.update(t.dtype.encode() + b"\0" + struct.pack(f"<{len(t.shape) + 1}q", len(t.shape), *t.shape))
        h.update(t.data)
    return h.digest()


class KVStoreClient:
    def __init__(self, nc: Client, timeout_s: float = 5.0, remember: int = 200_000, key: bytes | None = None) -> None:
        self.nc = nc
        self.key = key
        self.rejected = 0  # blocks read back whose MAC did not check out (planted, or another mesh's)
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
        if self.key is not None:
            good = 0
            while good < len(blocks) and hmac.compare_digest(blocks[good].mac, block_mac(self.key, blocks[good])):
                good += 1
            if good < len(blocks):
                self.rejected += len(blocks) - good
                log.warning("kvstore block %s carries no valid MAC of this mesh; computing from there",
                            blocks[good].hash.hex())
                blocks = blocks[:good]
                if not blocks:
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
            stored = blocks.to_stored(parents)
            if self.key is not None:
                stored = [b.model_copy(update={"mac": block_mac(self.key, b)}) for b in stored]
            await bus.request(self.nc, subjects.KVSTORE_PUT, PutRequest(blocks=stored),
                              timeout=self.timeout_s, expect=PutReply)
        except (bus.BusError, nats.errors.Error) as e:  # the connection may be closing: best effort
            log.info("kvstore put of %d blocks failed: %s", blocks.num_blocks, e)
            return
        for h in blocks.hashes:
            self._offloaded[h] = None
            self._offloaded.move_to_end(h)
        while len(self._offloaded) > self._remember:
            self._offloaded.popitem(last=False)
