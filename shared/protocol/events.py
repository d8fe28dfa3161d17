"""decode workers -> routers (fan-out): what each worker caches and how busy it is."""
from __future__ import annotations

from typing import ClassVar

from shared.wire import Message


class BlockStored(Message):
    """Full blocks newly cached, as a chain: hashes[0]'s parent is `parent` (None at the root)."""

    KIND: ClassVar[str] = "event.block_stored"

    worker_id: str
    hashes: list[bytes]
    parent: bytes | None = None


class BlockRemoved(Message):
    KIND: ClassVar[str] = "event.block_removed"

    worker_id: str
    hashes: list[bytes]


class LoadBeat(Message):
    KIND: ClassVar[str] = "event.load"

    worker_id: str
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    ts: float  # sender's time.time(); receivers use it to expire silent workers
    # What a router needs to hash prompts the way this worker does (shared/block_hash.py).
    block_size: int = 16
    hash_root: bytes = b""
    max_model_len: int = 0
