"""The CPU tier: blocks in process memory, bounded in bytes, least recently used evicted first.

Blocks are kept exactly as they arrived on the wire (raw tensor bytes), so a get returns them
bit for bit, whatever their dtype, and the kvstore never needs torch.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from services.kvstore.tier import KVTier, PutResult, TierStats, block_nbytes
from shared.block_hash import held_prefix
from shared.protocol.kvstore import StoredBlock


class CPUTier(KVTier):
    name = "cpu"

    def __init__(self, capacity_bytes: int) -> None:
        assert capacity_bytes > 0, "capacity_bytes must be positive"
        self.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[bytes, StoredBlock] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0

    def put(self, blocks: Sequence[StoredBlock]) -> PutResult:
        evicted: list[StoredBlock] = []
        # Tail first, so the chain's head ends up most recently used and is evicted last.
        for block in reversed(blocks):
            if block.hash in self._blocks:
                self._blocks.move_to_end(block.hash)
                continue
            size = block_nbytes(block)
            if size > self.capacity_bytes:
                continue
            if self._bytes + size > self.capacity_bytes:
                evicted += self.evict(self._bytes + size - self.capacity_bytes)
            self._blocks[block.hash] = block
            self._bytes += size
        # Counted afterwards: a put longer than the tier evicts some of its own tail.
        stored = sum(block.hash in self._blocks for block in blocks)
        return PutResult(stored, evicted)

    def get_chain(
        self, hashes: Sequence[bytes], max_blocks: int | None = None, max_bytes: int | None = None
    ) -> list[StoredBlock]:
        wanted = hashes if max_blocks is None else hashes[: max(max_blocks, 0)]
        found: list[StoredBlock] = []
        total = 0
        missing = False
        for h in wanted:
            block = self._blocks.get(h)
            if block is None:
                missing = True
                break
            total += block_nbytes(block)
            if max_bytes is not None and total > max_bytes:
                break  # held but too big for this reply: neither a hit nor a miss
            found.append(block)
        self._hits += len(found)
        if missing:
            self._misses += len(wanted) - len(found)
        for block in reversed(found):  # head most recent, as in put()
            self._blocks.move_to_end(block.hash)
        return found

    def contains_chain(self, hashes: Sequence[bytes]) -> int:
        return held_prefix(hashes, self._blocks)

    def evict(self, nbytes: int) -> list[StoredBlock]:
        evicted: list[StoredBlock] = []
        freed = 0
        while freed < nbytes and self._blocks:
            _, block = self._blocks.popitem(last=False)
            size = block_nbytes(block)
            self._bytes -= size
            freed += size
            evicted.append(block)
        self._evictions += len(evicted)
        return evicted

    def stats(self) -> TierStats:
        return TierStats(
            blocks=len(self._blocks),
            bytes=self._bytes,
            capacity_bytes=self.capacity_bytes,
            hits=self._hits,
            misses=self._misses,
            evictions=self._evictions,
        )
