"""Where the disk tier's records live on disk: the seam between its index (LRU, byte cap) and its files.

The production layout is one preallocated slab file (`slab_file.py`); `kvmesh bench disk-layout` measures it
against one file per block and one file per group of blocks through this same interface, so the figures
compare layouts and nothing else (same records, same thread pool, same O_DIRECT handling).

A layout does the file I/O of one call on the tier's thread pool; its bookkeeping (free slots, reference
counts) is touched only from the tier's caller, one call at a time, like the tier's index.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from shared.protocol.kvstore import StoredBlock

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Placed:
    """A record a layout holds."""

    hash: bytes
    seq: int  # write order: a restart takes it as the LRU order
    payload_bytes: int  # K and V bytes (what reply size limits count)
    record_bytes: int  # header and payload, unpadded (what a read must fetch)
    cost: int  # disk bytes it takes (what the byte cap counts)
    where: Hashable  # the layout's own address: a slot, a path, (file, offset)


class BlockLayout(Protocol):
    def footprint(self, record_bytes: int) -> int | None:
        """Disk bytes a record of this length would take; None when this layout cannot hold it."""

    @property
    def limit_bytes(self) -> int | None:
        """A cap the layout found below the tier's (a full disk), or None."""

    def scan(self) -> list[Placed]:
        """The records found at start (stale, foreign and old-version data dropped), any order."""

    def write(self, blocks: Sequence[tuple[StoredBlock, int]]) -> list[Placed | None]:
        """Writes (block, seq) pairs, concurrently; None for each block that could not be written (logged)."""

    def read(self, placed: Sequence[Placed]) -> list[StoredBlock | None]:
        """Reads and checks records, concurrently; None for each that is torn, corrupted or unreadable."""

    def free(self, placed: Placed) -> None:
        """The record is no longer wanted (evicted, or found damaged): its space can be reused."""

    def close(self) -> None: ...


LayoutFactory = Callable[[Path, int, bool, Executor], BlockLayout]  # (directory, capacity bytes, O_DIRECT, pool)


def fan_out(pool: Executor, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """fn over items on the pool, results in order; one item runs here (a hop to the pool costs more than it)."""
    if len(items) <= 1:
        return [fn(x) for x in items]
    return list(pool.map(fn, items))
