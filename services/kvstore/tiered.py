"""The kvstore's tiers stacked: CPU memory over an optional disk.

Blocks enter the CPU tier; what it evicts goes down to disk if it was used at least `disk_min_uses`
times (put counts as one use, every get that returns it as another): a block nobody asked for twice is
not worth a disk write (Dynamo admits to disk the same way). A get walks the chain through the CPU tier
and continues on disk where the CPU tier stops; blocks found on disk are promoted back to CPU.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from services.kvstore.cpu_tier import CPUTier
from services.kvstore.disk_tier import DiskTier
from services.kvstore.tier import KVTier, PutResult, TierStats
from shared.protocol.kvstore import StoredBlock

MAX_USE_COUNTS = 1 << 20  # the use counter is forgotten past this many hashes (it is advisory)


class TieredStore(KVTier):
    """A KVTier whose put() and evict() hand nothing back: evicted blocks go down to disk or leave the
    store, and take_gone() reports those that left."""

    def __init__(self, cpu: CPUTier, disk: DiskTier | None = None, disk_min_uses: int = 2) -> None:
        self.cpu, self.disk, self.disk_min_uses = cpu, disk, disk_min_uses
        self._uses: Counter[bytes] = Counter()
        self.demoted = 0  # blocks written to disk on CPU eviction
        self.not_admitted = 0  # evicted blocks used too few times for the disk
        self._gone: list[bytes] = []  # hashes no tier holds any more, until take_gone()

    def _count(self, blocks: Sequence[StoredBlock]) -> None:
        if len(self._uses) > MAX_USE_COUNTS:
            self._uses.clear()
        self._uses.update(b.hash for b in blocks)

    def take_gone(self) -> list[bytes]:
        """Hashes that left the whole store since the last call (what routers must forget)."""
        gone, self._gone = self._gone, []
        return gone + (self.disk.take_gone() if self.disk is not None else [])

    def _demote(self, evicted: list[StoredBlock]) -> None:
        if self.disk is None or not evicted:
            self._gone += [b.hash for b in evicted]
            return
        keep = [b for b in evicted if self._uses[b.hash] >= self.disk_min_uses]
        self._gone += [b.hash for b in evicted if self._uses[b.hash] < self.disk_min_uses
                       and not self.disk.contains_chain([b.hash])]
        self.not_admitted += len(evicted) - len(keep)
        if keep:
            self.demoted += self.disk.put(keep).stored
        for b in evicted:
            self._uses.pop(b.hash, None)

    def put(self, blocks: Sequence[StoredBlock]) -> PutResult:
        self._count(blocks)
        result = self.cpu.put(blocks)
        self._demote(result.evicted)
        return PutResult(result.stored, [])

    def get_chain(self, hashes: Sequence[bytes], max_blocks: int | None = None,
                  max_bytes: int | None = None) -> list[StoredBlock]:
        found = self.cpu.get_chain(hashes, max_blocks, max_bytes)
        rest = list(hashes[len(found):] if max_blocks is None else hashes[len(found):max(max_blocks, 0)])
        if self.disk is not None and rest:
            budget = None if max_bytes is None else max_bytes - sum(b.k.nbytes + b.v.nbytes for b in found)
            if budget is None or budget > 0:
                more = self.disk.get_chain(rest, None, budget)
                if more:
                    self._demote(self.cpu.put(more).evicted)  # promoted: the next ask is served from memory
                    found = found + more
        self._count(found)
        return found

    def contains_chain(self, hashes: Sequence[bytes]) -> int:
        n = self.cpu.contains_chain(hashes)
        if self.disk is not None and n < len(hashes):
            n += self.disk.contains_chain(hashes[n:])
        return n

    def evict(self, nbytes: int) -> list[StoredBlock]:
        evicted = self.cpu.evict(nbytes)
        self._demote(evicted)
        return []

    def stats_by_tier(self) -> dict[str, TierStats]:
        per = {self.cpu.name: self.cpu.stats()}
        if self.disk is not None:
            per[self.disk.name] = self.disk.stats()
        return per

    def stats(self) -> TierStats:
        """Both tiers together (per-tier figures: stats_by_tier())."""
        c = self.cpu.stats()
        d = self.disk.stats() if self.disk is not None else TierStats(0, 0, 0, 0, 0, 0)
        return TierStats(blocks=c.blocks + d.blocks, bytes=c.bytes + d.bytes,
                         capacity_bytes=c.capacity_bytes + d.capacity_bytes, hits=c.hits + d.hits,
                         misses=d.misses if self.disk is not None else c.misses, evictions=d.evictions)
