"""The host tier of one engine (Dynamo's G2, vLLM's CPU offload): KV blocks evicted from the device pool
are copied to host memory just before their blocks are overwritten, and a later prompt that needs
them loads them from here, without the network and without recomputing.

Keyed by block hash (a hash names the whole prefix, so a chain lookup is a walk over hashes); LRU
under a byte cap. Written on the engine thread, read from the event loop: one lock. Blocks are stored
as they left the device (same dtype, FP8 included), in ordinary (pageable) host memory. On CUDA the copy
out goes through pinned memory without blocking the step (KVTiers.spill / finish_spills in shared/engine/kv_tiers.py); the
copy back in is synchronous.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from shared.kv_blocks import KVBlocks


@dataclass
class HostTierStats:
    blocks: int = 0
    bytes: int = 0
    stored_blocks: int = 0  # cumulative
    evicted_blocks: int = 0  # dropped for room (cumulative)
    hit_blocks: int = 0  # served to a prompt (cumulative)


class HostTier:
    def __init__(self, capacity_bytes: int) -> None:
        assert capacity_bytes > 0, "a host tier needs a positive byte cap"
        self.capacity = capacity_bytes
        self._blocks: OrderedDict[bytes, KVBlocks] = OrderedDict()  # hash -> that one block, all layers
        self._lock = threading.Lock()
        self.stats = HostTierStats()

    def put(self, blocks: KVBlocks) -> tuple[list[bytes], KVBlocks | None]:
        """Named blocks (host copies the caller gives up). Returns the hashes newly held and the blocks
        dropped for room (what routers are told, and what may flow on down to the kvstore)."""
        per_block = blocks.bytes_per_block if blocks.num_blocks else 0
        if per_block > self.capacity:  # nothing fits: every block goes straight on down
            return [], blocks
        stored: list[bytes] = []
        dropped: list[KVBlocks] = []
        with self._lock:
            for i, h in enumerate(blocks.hashes):
                if h in self._blocks:
                    self._blocks.move_to_end(h)
                    continue
                while self.stats.bytes + per_block > self.capacity:
                    dropped.append(self._blocks.popitem(last=False)[1])
                    self.stats.bytes -= per_block
                    self.stats.blocks -= 1
                    self.stats.evicted_blocks += 1
                self._blocks[h] = blocks.blocks(i, i + 1)
                self.stats.bytes += per_block
                self.stats.blocks += 1
                self.stats.stored_blocks += 1
                stored.append(h)
        return stored, KVBlocks.gather(dropped) if dropped else None

    def get_chain(self, hashes: list[bytes], first_block: int = 0) -> KVBlocks | None:
        """The longest run of `hashes` from the start held here (fresh tensors), numbered from first_block."""
        with self._lock:
            found = []
            for h in hashes:
                kv = self._blocks.get(h)
                if kv is None:
                    break
                self._blocks.move_to_end(h)
                found.append(kv)
            self.stats.hit_blocks += len(found)
        if not found:
            return None
        got = KVBlocks.gather(found)
        if len(found) == 1:
            got = KVBlocks(got.k.clone(), got.v.clone(), hashes=got.hashes)  # fresh, as a stack would be
        return KVBlocks(got.k, got.v, first_block, 0, got.hashes)

    def take_all(self) -> KVBlocks | None:
        """Empties the tier, oldest first, handing its blocks over (a worker leaving the mesh)."""
        with self._lock:
            blocks = list(self._blocks.values())
            self._blocks.clear()
            self.stats.blocks = self.stats.bytes = 0
        return KVBlocks.gather(blocks) if blocks else None

    def clear(self) -> None:
        self.take_all()

    def __contains__(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._blocks
