"""One storage tier of the kvstore: KV blocks keyed by their chained block hash.

Implementations: CPU memory (cpu_tier.py), a disk slab (disk_tier.py), and the two stacked
(tiered.py), which is what the service runs. A block is immutable once stored (its hash names its
content), so tiers hand out the very StoredBlock objects they hold and nobody copies or mutates them.

Ownership:
  * put() takes the blocks: the tier keeps references until it evicts them.
  * get_chain() lends blocks: the caller may send them anywhere but must not mutate them (they are
    frozen); the tier keeps them too.
  * evict() and the blocks put() reports as evicted give them back: the tier drops its
    references and the caller decides where they go next (a lower tier, or nowhere). A stack of
    tiers passes its blocks down itself and hands none back; what leaves it altogether it reports
    through take_gone().
Tiers are not thread safe: the kvstore service calls them from its event loop only.
"""
from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.protocol.kvstore import StoredBlock


@dataclass(frozen=True)
class TierStats:
    blocks: int
    bytes: int
    capacity_bytes: int
    hits: int  # blocks returned by get_chain
    misses: int  # blocks get_chain was asked for (within max_blocks) and could not return
    evictions: int

    @property
    def hit_rate(self) -> float:
        asked = self.hits + self.misses
        return self.hits / asked if asked else 0.0


@dataclass(frozen=True)
class PutResult:
    stored: int  # blocks of this put the tier holds afterwards (new or already present)
    evicted: list[StoredBlock] = field(default_factory=list)  # pushed out to make room; the caller's now


def block_nbytes(block: StoredBlock) -> int:
    """What a block costs a tier: its tensor bytes (hashes and headers are noise next to them)."""
    return block.k.nbytes + block.v.nbytes


class KVTier(abc.ABC):
    name = "tier"  # its label in per-tier figures
    @abc.abstractmethod
    def put(self, blocks: Sequence[StoredBlock]) -> PutResult:
        """Stores `blocks` (usually one chain, in order). Blocks already held are refreshed, not replaced.

        A block larger than the whole tier is not stored. When blocks must be evicted to make room,
        a chain's tail goes before its head, so what stays is still a usable prefix.
        """

    @abc.abstractmethod
    def get_chain(
        self, hashes: Sequence[bytes], max_blocks: int | None = None, max_bytes: int | None = None
    ) -> list[StoredBlock]:
        """The longest prefix of the chain `hashes` held here, at most max_blocks blocks and max_bytes bytes.

        Stops at the first missing hash: blocks after a gap are useless without the ones before.
        Counts hits and misses and marks the returned blocks recently used.
        """

    @abc.abstractmethod
    def contains_chain(self, hashes: Sequence[bytes]) -> int:
        """Length of the longest held prefix of `hashes`; a probe: no hit counting, no LRU update."""

    @abc.abstractmethod
    def evict(self, nbytes: int) -> list[StoredBlock]:
        """Frees at least `nbytes` (or everything), least recently used first; returns the blocks handed back."""

    @abc.abstractmethod
    def stats(self) -> TierStats: ...

    def take_gone(self) -> list[bytes]:
        """Hashes that left this tier for good since the last call, beyond the blocks put() and evict()
        handed back (what routers must forget). A tier that hands back all it drops (CPUTier) has none."""
        return []

    def stats_by_tier(self) -> dict[str, TierStats]:
        """Figures per tier, by name (one entry here; a stack of tiers has one per tier)."""
        return {self.name: self.stats()}
