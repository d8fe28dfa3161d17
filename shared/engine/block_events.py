"""What the block manager reports about its prefix cache, for KV-aware routing and offload."""
from __future__ import annotations

from dataclasses import dataclass

from shared.block_hash import BlockHash


@dataclass(frozen=True)
class BlockStored:
    block_hash: BlockHash
    parent_hash: BlockHash | None
    block_id: int


@dataclass(frozen=True)
class BlockRemoved:
    """A cached block is about to be overwritten; block_id still holds its KV until the next model run."""

    block_hash: BlockHash
    block_id: int


BlockEvent = BlockStored | BlockRemoved
