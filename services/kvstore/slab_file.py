"""The disk tier's layout: one preallocated file of fixed-size slots, `<dir>/blocks-<slot bytes>.slab`.

A slot holds one self-describing record (`disk_record.py`: magic, version, hash, parent, dtype, shape, seq,
payload length, xxh3 over all of it), padded to the slot size: the block's record rounded up to 4096, so
O_DIRECT can read and write slots in place. The slot size is taken from the first block written (all blocks
of one model are one size) and is part of the file name; a larger block is not stored while the file holds
anything (an empty file is recreated for it).

Free slots are a heap in memory (lowest first, so the file stays compact); nothing on disk records them, so
there is no allocation table to keep consistent: a slot is in use exactly when it holds an intact record,
which the restart scan finds by reading every slot's header. A write cut off by a crash leaves a record that
fails its checksum at read (dropped, never served); a freed slot still holding an intact record may be
found again after a restart, which is harmless (the record is a valid copy of its block). The file grows in
fallocate steps of GROW_BYTES up to the tier's cap; a full disk stops the growth, logged, and the tier
carries on within the file it has.
"""
from __future__ import annotations

import heapq
import logging
import os
from collections.abc import Sequence
from concurrent.futures import Executor
from pathlib import Path

from services.kvstore import disk_record
from services.kvstore.aligned_io import ALIGN, O_DIRECT, ThreadBuffers, pread_full, pwrite_full, round_up
from services.kvstore.block_layout import Placed, fan_out
from shared.private_dir import open_private
from shared.protocol.kvstore import StoredBlock

log = logging.getLogger(__name__)

GROW_BYTES = 64 << 20  # one fallocate per this much: few calls, little space reserved ahead of need
SCAN_CHUNK = 256  # slot headers one pool task reads at restart
PREFIX, SUFFIX = "blocks-", ".slab"
_PREFIX, _SUFFIX = PREFIX, SUFFIX


class SlabFile:
    def __init__(self, directory: Path, capacity_bytes: int, direct: bool, pool: Executor) -> None:
        self.dir, self.capacity_bytes, self.direct, self._pool = directory, capacity_bytes, direct, pool
        self._buffers = ThreadBuffers()
        self.slot_size: int | None = None
        self._fd: int | None = None
        self._slots = 0  # slots the file has room for
        self._free: list[int] = []  # heap of slots in the file not holding a record we index
        self._used = 0
        self._limit: int | None = None  # bytes, once the disk is found full

    @property
    def path(self) -> Path | None:
        return None if self.slot_size is None else self.dir / f"{_PREFIX}{self.slot_size}{_SUFFIX}"

    @property
    def limit_bytes(self) -> int | None:
        return self._limit

    def footprint(self, record_bytes: int) -> int | None:
        if self.slot_size is not None and record_bytes <= self.slot_size:
            return self.slot_size
        if self.slot_size is None or self._used == 0:
            return round_up(record_bytes)  # the slot size is (re)chosen by this block
        return None

    # --- the file ------------------------------------------------------------------------------------

    def _open(self, slot_size: int) -> None:
        self.close()
        self.slot_size = slot_size
        assert self.path is not None
        # 0600, never through a symlink (the disk tier's module docstring: records give prompts back)
        self._fd = open_private(self.path, os.O_RDWR | os.O_CREAT | (O_DIRECT if self.direct else 0))
        self._slots = os.fstat(self._fd).st_size // slot_size
        self._free = list(range(self._slots))
        self._used, self._limit = 0, None

    def _reformat(self, slot_size: int) -> None:
        """A fresh file for another slot size (only while nothing is stored)."""
        old = self.path
        self._open(slot_size)
        if old is not None and old != self.path:
            old.unlink(missing_ok=True)
            log.info("disk tier: slot size now %d bytes (%s)", slot_size, self.path)

    def _grow(self) -> bool:
        """Room for more slots (one fallocate step, never past the cap); False when the disk is full."""
        assert self._fd is not None and self.slot_size is not None
        most = self.capacity_bytes // self.slot_size
        if self._limit is not None or self._slots >= most:
            return False
        new = min(most, self._slots + max(1, GROW_BYTES // self.slot_size))
        try:
            os.posix_fallocate(self._fd, self._slots * self.slot_size, (new - self._slots) * self.slot_size)
        except OSError as e:  # ENOSPC, or a filesystem without fallocate and no room
            self._limit = self._slots * self.slot_size
            log.error("disk tier: cannot grow %s past %d bytes (%s); the disk tier keeps to that size",
                      self.path, self._limit, e)
            return False
        self._free.extend(range(self._slots, new))  # ascending after the ones there: still a heap
        self._slots = new
        return True

    def _take_slot(self) -> int | None:
        if not self._free and not self._grow():
            return None
        self._used += 1
        return heapq.heappop(self._free)

    def free(self, placed: Placed) -> None:
        self._release(int(placed.where))  # type: ignore[call-overload]

    def _release(self, slot: int) -> None:
        heapq.heappush(self._free, slot)
        self._used -= 1

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # --- restart -------------------------------------------------------------------------------------

    def scan(self) -> list[Placed]:
        _drop_legacy_files(self.dir)
        files = []
        for path in self.dir.glob(f"{_PREFIX}*{_SUFFIX}"):
            if path.is_symlink() or not path.is_file():  # never followed: whatever it points at stays untouched
                log.warning("disk tier: removing %s, not a regular file", path)
                path.unlink(missing_ok=True)
            else:
                files.append(path)
        files.sort(key=lambda p: p.stat().st_mtime_ns)
        for extra in files[:-1]:  # a crash between creating a new-size file and deleting the old one
            extra.unlink(missing_ok=True)
        if not files:
            return []
        try:
            slot_size = int(files[-1].name[len(_PREFIX):-len(_SUFFIX)])
        except ValueError:
            return []
        if slot_size <= 0 or slot_size % ALIGN:
            return []
        self._open(slot_size)
        found: dict[bytes, Placed] = {}
        chunks = [range(i, min(i + SCAN_CHUNK, self._slots)) for i in range(0, self._slots, SCAN_CHUNK)]
        for placed in (p for chunk in fan_out(self._pool, self._read_headers, chunks) for p in chunk):
            twin = found.get(placed.hash)  # a block freed from one slot and written again to another
            if twin is None or twin.seq < placed.seq:
                found[placed.hash] = placed
        in_use = {int(p.where) for p in found.values()}  # type: ignore[call-overload]
        self._free = [s for s in range(self._slots) if s not in in_use]
        self._used = len(in_use)
        return list(found.values())

    def _read_headers(self, slots: range) -> list[Placed]:
        assert self._fd is not None and self.slot_size is not None
        buf = self._buffers.get(ALIGN)
        found = []
        for slot in slots:
            try:
                n = pread_full(self._fd, buf, slot * self.slot_size)
            except OSError:
                continue
            head = disk_record.read_header(buf[:n])
            if head is not None and head.record_bytes <= self.slot_size:
                found.append(Placed(head.hash, head.seq, head.payload_bytes, head.record_bytes, self.slot_size, slot))
        return found

    # --- I/O -----------------------------------------------------------------------------------------

    def write(self, blocks: Sequence[tuple[StoredBlock, int]]) -> list[Placed | None]:
        if not blocks:
            return []
        biggest = max(disk_record.record_bytes(b) for b, _ in blocks)
        if self.slot_size is None or (self._used == 0 and biggest > self.slot_size):
            self._reformat(round_up(biggest))
        jobs = []
        for block, seq in blocks:
            fits = disk_record.record_bytes(block) <= (self.slot_size or 0)
            jobs.append((block, seq, self._take_slot() if fits else None))
        placed = fan_out(self._pool, self._write_one, jobs)
        for (_, _, slot), p in zip(jobs, placed):
            if slot is not None and p is None:
                self._release(slot)
        return placed

    def _write_one(self, job: tuple[StoredBlock, int, int | None]) -> Placed | None:
        block, seq, slot = job
        if slot is None:
            return None
        assert self._fd is not None and self.slot_size is not None
        n = disk_record.record_bytes(block)
        record = disk_record.encode(block, seq, self._buffers.get(n))
        try:
            pwrite_full(self._fd, record if self.direct else record[:n], slot * self.slot_size)
        except OSError as e:
            log.error("disk tier: cannot write slot %d of %s: %s", slot, self.path, e)
            return None
        return Placed(block.hash, seq, block.k.nbytes + block.v.nbytes, n, self.slot_size, slot)

    def read(self, placed: Sequence[Placed]) -> list[StoredBlock | None]:
        return fan_out(self._pool, self._read_one, placed)

    def _read_one(self, placed: Placed) -> StoredBlock | None:
        assert self._fd is not None and self.slot_size is not None
        buf = self._buffers.get(placed.record_bytes)
        try:
            n = pread_full(self._fd, buf, int(placed.where) * self.slot_size)  # type: ignore[call-overload]
        except OSError:
            return None
        return disk_record.decode(placed.hash, buf[:n])


def _drop_legacy_files(directory: Path) -> None:
    """Blocks of the version 1 layout (one crc32-checked file per block): not ours any more, never served."""
    legacy = [*directory.glob("*/*.kvb"), *directory.glob("*/*.tmp")]
    for path in legacy:
        path.unlink(missing_ok=True)
    for sub in {p.parent for p in legacy}:
        try:
            sub.rmdir()
        except OSError:
            pass
    if legacy:
        log.info("disk tier: dropped %d files of the old one-file-per-block format in %s", len(legacy), directory)
