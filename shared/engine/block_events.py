"""What an engine's cached blocks did in a step: plain in-process events with engine-local block ids.

The block manager records device events and the KV tiers host ones; offload reads `block_ids` (where
the engine holds each block's KV). The worker turns them into the mesh's wire events at its edge
(services/engine_worker.py, to_wire), with its worker id and without the ids, which mean nothing
outside this process.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BlocksStored:
    """Full blocks newly cached, as a chain: hashes[0]'s parent is `parent` (None at the root)."""

    hashes: list[bytes]
    parent: bytes | None = None
    block_ids: list[int] = field(default_factory=list)  # engine-local; empty for the host tier
    tier: str = "device"  # "device" (the KV pool) or "host" (the host tier; no chain: parent None)


@dataclass
class BlocksRemoved:
    """Cached blocks given up; on the device, `block_ids` still hold their KV until the next model run."""

    hashes: list[bytes]
    block_ids: list[int] = field(default_factory=list)
    tier: str = "device"


BlockEvent = BlocksStored | BlocksRemoved
