"""The disk layouts `kvmesh bench disk-layout` measures against the slab file (`services/kvstore/slab_file.py`).

Same records (`disk_record.py`), same thread pool and O_DIRECT handling, same tier in front (DiskTier with
`layout=`), so only where the bytes go differs:
  per-file  one file per block, `<dir>/<2 hex>/<hash hex>.kvb`, written to a temporary name and renamed
            (the layout before the slab); eviction unlinks the file
  group     one file per put of up to GROUP_BLOCKS blocks, records back to back at 4096-aligned offsets;
            a file is unlinked once all its blocks are evicted (until then it keeps its space)
"""
from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Executor
from pathlib import Path

from services.kvstore import disk_record
from services.kvstore.aligned_io import ALIGN, O_DIRECT, ThreadBuffers, pread_full, pwrite_full, round_up
from services.kvstore.block_layout import Placed, fan_out
from shared.protocol.kvstore import StoredBlock

GROUP_BLOCKS = 16


class _FileLayout:
    """What both file layouts share: whole files written under a temporary name, records read at an offset."""

    suffix = ""

    def __init__(self, directory: Path, capacity_bytes: int, direct: bool, pool: Executor) -> None:
        self.dir, self.direct, self._pool = directory, direct, pool
        self._buffers = ThreadBuffers()
        self.limit_bytes: int | None = None

    def footprint(self, record_bytes: int) -> int | None:
        return round_up(record_bytes)  # whole filesystem blocks

    def close(self) -> None:
        pass

    def _write_file(self, path: Path, data: memoryview) -> bool:
        tmp = path.with_suffix(".tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (O_DIRECT if self.direct else 0), 0o644)
            try:
                pwrite_full(fd, data, 0)
            finally:
                os.close(fd)
            os.replace(tmp, path)  # atomic: the file is there whole, or not at all
            return True
        except OSError:
            tmp.unlink(missing_ok=True)
            return False

    def _read_at(self, path: Path, offset: int, nbytes: int) -> memoryview | None:
        buf = self._buffers.get(nbytes)
        try:
            fd = os.open(path, os.O_RDONLY | (O_DIRECT if self.direct else 0))
        except OSError:
            return None
        try:
            return buf[:pread_full(fd, buf, offset)]
        except OSError:
            return None
        finally:
            os.close(fd)

    def _header(self, path: Path, offset: int, cost: int, where: object) -> Placed | None:
        data = self._read_at(path, offset, ALIGN)
        head = None if data is None else disk_record.read_header(data)
        return None if head is None else Placed(head.hash, head.seq, head.payload_bytes, head.record_bytes, cost,
                                                where)  # type: ignore[arg-type]

    def _files(self) -> list[Path]:
        for tmp in self.dir.glob("**/*.tmp"):  # writes a crash interrupted
            tmp.unlink(missing_ok=True)
        return list(self.dir.glob(f"**/*{self.suffix}"))


class PerFileLayout(_FileLayout):
    suffix = ".kvb"

    def _path(self, block_hash: bytes) -> Path:
        h = block_hash.hex()
        return self.dir / h[:2] / f"{h}{self.suffix}"

    def scan(self) -> list[Placed]:
        return [p for p in fan_out(self._pool, self._scan_one, self._files()) if p is not None]

    def _scan_one(self, path: Path) -> Placed | None:
        return self._header(path, 0, round_up(path.stat().st_size), path)

    def write(self, blocks: Sequence[tuple[StoredBlock, int]]) -> list[Placed | None]:
        return fan_out(self._pool, self._write_one, blocks)

    def _write_one(self, job: tuple[StoredBlock, int]) -> Placed | None:
        block, seq = job
        n = disk_record.record_bytes(block)
        record = disk_record.encode(block, seq, self._buffers.get(n))
        path = self._path(block.hash)
        if not self._write_file(path, record if self.direct else record[:n]):
            return None
        return Placed(block.hash, seq, block.k.nbytes + block.v.nbytes, n, round_up(n), path)

    def read(self, placed: Sequence[Placed]) -> list[StoredBlock | None]:
        return fan_out(self._pool, self._read_one, placed)

    def _read_one(self, placed: Placed) -> StoredBlock | None:
        data = self._read_at(placed.where, 0, placed.record_bytes)  # type: ignore[arg-type]
        return None if data is None else disk_record.decode(placed.hash, data)

    def free(self, placed: Placed) -> None:
        Path(placed.where).unlink(missing_ok=True)  # type: ignore[arg-type]


class GroupFileLayout(_FileLayout):
    suffix = ".kvg"

    def __init__(self, directory: Path, capacity_bytes: int, direct: bool, pool: Executor) -> None:
        super().__init__(directory, capacity_bytes, direct, pool)
        self._live: Counter[Path] = Counter()  # blocks still indexed, per file

    def scan(self) -> list[Placed]:
        found = [p for group in fan_out(self._pool, self._scan_file, self._files()) for p in group]
        self._live.update(p.where[0] for p in found)  # type: ignore[index]
        return found

    def _scan_file(self, path: Path) -> list[Placed]:
        found, offset, size = [], 0, path.stat().st_size
        while offset < size:
            placed = self._header(path, offset, 0, (path, offset))
            if placed is None:
                break
            found.append(Placed(placed.hash, placed.seq, placed.payload_bytes, placed.record_bytes,
                                round_up(placed.record_bytes), placed.where))
            offset += round_up(placed.record_bytes)
        return found

    def write(self, blocks: Sequence[tuple[StoredBlock, int]]) -> list[Placed | None]:
        groups = [blocks[i:i + GROUP_BLOCKS] for i in range(0, len(blocks), GROUP_BLOCKS)]
        paths = [self.dir / f"{group[0][1]}{self.suffix}" for group in groups]  # seqs never repeat
        out = [p for group in fan_out(self._pool, self._write_group, list(zip(paths, groups))) for p in group]
        self._live.update(p.where[0] for p in out if p is not None)  # type: ignore[index]
        return out

    def _write_group(self, job: tuple[Path, Sequence[tuple[StoredBlock, int]]]) -> list[Placed | None]:
        path, group = job
        sizes = [round_up(disk_record.record_bytes(b)) for b, _ in group]
        buf = self._buffers.get(sum(sizes))
        placed, offset = [], 0
        for (block, seq), size in zip(group, sizes):
            n = disk_record.encode(block, seq, buf[offset:offset + size]).nbytes
            placed.append(Placed(block.hash, seq, block.k.nbytes + block.v.nbytes,
                                 disk_record.record_bytes(block), n, (path, offset)))
            offset += size
        return placed if self._write_file(path, buf[:offset]) else [None] * len(group)

    def read(self, placed: Sequence[Placed]) -> list[StoredBlock | None]:
        return fan_out(self._pool, self._read_one, placed)

    def _read_one(self, placed: Placed) -> StoredBlock | None:
        path, offset = placed.where  # type: ignore[misc]
        data = self._read_at(path, offset, placed.record_bytes)
        return None if data is None else disk_record.decode(placed.hash, data)

    def free(self, placed: Placed) -> None:
        path = placed.where[0]  # type: ignore[index]
        self._live[path] -= 1
        if self._live[path] <= 0:
            del self._live[path]
            path.unlink(missing_ok=True)
