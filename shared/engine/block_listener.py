"""What the block manager tells about cached blocks, for whoever owns the tiers below the device.

The block manager calls these as it goes; it keeps nothing for them. The default wants none of it
(an engine with no host tier and no offload); shared/engine/kv_tiers.py is the listener that does.
"""
from __future__ import annotations

from shared.block_hash import BlockHash


class BlockListener:
    def on_evicted(self, block_hash: BlockHash, block_id: int) -> None:
        """A cached block was given up for reuse; its KV is intact until something writes into it."""

    def on_reused(self, block_hash: BlockHash, block_id: int) -> None:
        """A new request took a cached block as part of its prefix."""
