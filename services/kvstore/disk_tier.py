"""The disk tier: one file per block under a directory, bounded in bytes, least recently used evicted first.

Layout: `<dir>/<first 2 hex of the hash>/<hash hex>.kvb`, each file a small header (magic, version, crc32 of
everything after the header, the parent hash, dtype, shape) then the raw bytes of K and V. A file is written
to a temporary name, flushed and renamed into place, so a crash leaves either the whole block or no block;
a torn or corrupted file (a crash mid-write on a filesystem that reorders, a bad sector) fails its checksum,
is deleted and reads as a miss, never served. At start the directory is scanned (names and sizes only,
oldest modification first as the LRU order), so the tier survives a restart.

Why one file per block rather than one preallocated file with a slab allocator: blocks of one model are all
one size, so a slab file would only save the filesystem's per-file overhead; per-file keeps crash safety to
one atomic rename (a slab needs its own journal for its allocation table), deletes free space at once, and
a restart is a directory scan. Our blocks are 0.1-5 MB, where per-file overhead is small; measuring a slab
file is left for when the disk tier's time per block is the bottleneck (see the issue note).
"""
from __future__ import annotations

import logging
import os
import struct
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from services.kvstore.tier import KVTier, PutResult, TierStats, block_nbytes
from shared.block_hash import held_prefix
from shared.protocol.kvstore import StoredBlock
from shared.wire import WireTensor

log = logging.getLogger(__name__)

MAGIC = b"KVMB"
VERSION = 1
# magic, version, crc32 of the rest, has-parent, parent (16 bytes), dtype length, ndim
_HEAD = struct.Struct("<4sHIB16sBB")
SUFFIX = ".kvb"


def encode_block(block: StoredBlock) -> bytes:
    dtype = block.k.dtype.encode()
    shape = struct.pack(f"<{len(block.k.shape)}q", *block.k.shape)
    body = dtype + shape + block.k.data + block.v.data
    parent = block.parent or b"\0" * 16
    return _HEAD.pack(MAGIC, VERSION, zlib.crc32(body), block.parent is not None, parent, len(dtype),
                      len(block.k.shape)) + body


def decode_block(block_hash: bytes, data: bytes) -> StoredBlock | None:
    """The block, or None when the bytes are not a whole, intact block file."""
    if len(data) < _HEAD.size:
        return None
    magic, version, crc, has_parent, parent, dlen, ndim = _HEAD.unpack_from(data)
    body = data[_HEAD.size:]
    if magic != MAGIC or version != VERSION or zlib.crc32(body) != crc:
        return None
    dtype = body[:dlen].decode(errors="replace")
    shape = list(struct.unpack_from(f"<{ndim}q", body, dlen))
    tensors = body[dlen + 8 * ndim:]
    half = len(tensors) // 2
    try:
        k = WireTensor(dtype=dtype, shape=shape, data=tensors[:half])
        v = WireTensor(dtype=dtype, shape=shape, data=tensors[half:])
    except ValueError:
        return None
    return StoredBlock(hash=block_hash, parent=parent if has_parent else None, k=k, v=v)


class DiskTier(KVTier):
    def __init__(self, directory: str | Path, capacity_bytes: int) -> None:
        self.dropped: list[bytes] = []  # hashes evicted since the owner last took them (for routers)
        assert capacity_bytes > 0, "capacity_bytes must be positive"
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        probe = self.dir / ".write-probe"
        try:  # a read-only or missing disk is a clear error at start, not a silent miss forever
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise RuntimeError(f"kvstore disk tier: cannot write to {self.dir}: {e}") from e
        self.capacity_bytes = capacity_bytes
        self._files: OrderedDict[bytes, int] = OrderedDict()  # hash -> file bytes, least recently used first
        self._bytes = 0
        self._hits = self._misses = self._evictions = self.corrupt = self.write_errors = 0
        self._scan()

    def _path(self, block_hash: bytes) -> Path:
        h = block_hash.hex()
        return self.dir / h[:2] / f"{h}{SUFFIX}"

    def _scan(self) -> None:
        found = []
        for path in self.dir.glob(f"*/*{SUFFIX}"):
            try:
                h = bytes.fromhex(path.stem)
                st = path.stat()
            except (ValueError, OSError):
                continue
            found.append((st.st_mtime_ns, h, st.st_size))
        for tmp in self.dir.glob("*/*.tmp"):  # writes a crash interrupted
            tmp.unlink(missing_ok=True)
        for _, h, size in sorted(found):
            self._files[h] = size
            self._bytes += size
        if self._bytes > self.capacity_bytes:  # the cap was lowered since
            self.evict(self._bytes - self.capacity_bytes)
        if found:
            log.info("disk tier: %d blocks (%d bytes) found in %s", len(self._files), self._bytes, self.dir)

    # --- KVTier -------------------------------------------------------------------------------------

    def put(self, blocks: Sequence[StoredBlock]) -> PutResult:
        for block in reversed(blocks):  # tail first: the head ends up most recent
            if block.hash in self._files:
                self._files.move_to_end(block.hash)
                continue
            data = encode_block(block)
            if len(data) > self.capacity_bytes:
                continue
            if self._bytes + len(data) > self.capacity_bytes:
                self.evict(self._bytes + len(data) - self.capacity_bytes)
            if self._write(block.hash, data):
                self._files[block.hash] = len(data)
                self._bytes += len(data)
        return PutResult(sum(b.hash in self._files for b in blocks), [])

    def _write(self, block_hash: bytes, data: bytes) -> bool:
        path = self._path(block_hash)
        tmp = path.with_suffix(".tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
            os.replace(tmp, path)  # atomic: the block is there whole, or not at all
            return True
        except OSError as e:  # a full or failing disk: the block is simply not stored here
            self.write_errors += 1
            log.error("disk tier: cannot write %s: %s", path, e)
            tmp.unlink(missing_ok=True)
            return False

    def get_chain(self, hashes: Sequence[bytes], max_blocks: int | None = None,
                  max_bytes: int | None = None) -> list[StoredBlock]:
        wanted = hashes if max_blocks is None else hashes[: max(max_blocks, 0)]
        found: list[StoredBlock] = []
        total = 0
        for h in wanted:
            block = self._read(h)
            if block is None:
                self._misses += len(wanted) - len(found)
                break
            total += block_nbytes(block)
            if max_bytes is not None and total > max_bytes:
                break
            found.append(block)
        self._hits += len(found)
        for block in reversed(found):
            self._files.move_to_end(block.hash)
        return found

    def _read(self, block_hash: bytes) -> StoredBlock | None:
        if block_hash not in self._files:
            return None
        path = self._path(block_hash)
        try:
            data = path.read_bytes()
        except OSError:
            data = b""
        block = decode_block(block_hash, data)
        if block is None:  # torn, corrupted or vanished: never served
            self.corrupt += 1
            log.warning("disk tier: dropping damaged block file %s", path)
            self._bytes -= self._files.pop(block_hash)
            path.unlink(missing_ok=True)
        return block

    def contains_chain(self, hashes: Sequence[bytes]) -> int:
        return held_prefix(hashes, self._files)

    def evict(self, nbytes: int) -> list[StoredBlock]:
        """Deletes files, least recently used first; returns nothing (no tier lies below the disk)."""
        freed = 0
        while freed < nbytes and self._files:
            h, size = self._files.popitem(last=False)
            self._bytes -= size
            freed += size
            self._evictions += 1
            self.dropped.append(h)  # gone from the whole store (no tier lies below)
            self._path(h).unlink(missing_ok=True)
        return []

    def stats(self) -> TierStats:
        return TierStats(blocks=len(self._files), bytes=self._bytes, capacity_bytes=self.capacity_bytes,
                         hits=self._hits, misses=self._misses, evictions=self._evictions)
