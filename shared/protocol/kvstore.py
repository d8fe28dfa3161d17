"""any worker <-> kvstore: blocks keyed by their chained hash, in CPU then disk tiers."""
from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from shared.wire import Message, WireModel, WireTensor


class StoredBlock(WireModel):
    """One full block: k and v shaped [num_layers, block_size, num_kv_heads, head_dim]."""

    hash: bytes
    parent: bytes | None = None
    k: WireTensor
    v: WireTensor
    # The producer's MAC over all of the above, keyed by the mesh's secret (services/kvstore_client.py): only
    # engine workers can make one, and a worker reads back only blocks whose MAC it can check. b"": none.
    mac: bytes = Field(default=b"", max_length=16)


class PutRequest(Message):
    KIND: ClassVar[str] = "kvstore.put"

    blocks: list[StoredBlock]


class PutReply(Message):
    KIND: ClassVar[str] = "kvstore.put.reply"

    num_stored: int  # blocks already present count as stored


class GetRequest(Message):
    """Returns the longest prefix of `hashes` (a chain, in order) the store holds."""

    KIND: ClassVar[str] = "kvstore.get"

    hashes: list[bytes]
    max_blocks: int | None = None  # callers bound the reply size


class GetReply(Message):
    KIND: ClassVar[str] = "kvstore.get.reply"

    blocks: list[StoredBlock] = Field(default_factory=list)


class ContainsRequest(Message):
    KIND: ClassVar[str] = "kvstore.contains"

    hashes: list[bytes]


class ContainsReply(Message):
    KIND: ClassVar[str] = "kvstore.contains.reply"

    num_prefix_blocks: int  # length of the longest held prefix of the requested chain


class StatsRequest(Message):
    KIND: ClassVar[str] = "kvstore.stats"


class StatsReply(Message):
    KIND: ClassVar[str] = "kvstore.stats.reply"

    cpu_blocks: int
    cpu_bytes: int
    disk_blocks: int
    disk_bytes: int
    hits: int
    misses: int
    cpu_hits: int = 0  # blocks served from memory (cumulative)
    disk_hits: int = 0  # blocks served from disk (cumulative)

    @property
    def hit_rate(self) -> float:
        """Blocks returned over blocks asked for by gets; 0.0 before the first get."""
        asked = self.hits + self.misses
        return self.hits / asked if asked else 0.0
