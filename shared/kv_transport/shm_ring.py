"""Shared memory between a sending and a receiving worker on one host: one file in /dev/shm per
direct connection, cut into slots; a KV frame's payload is written into a free slot by the sender
and copied out into the KV cache by the receiver, which frees the slot with its ack.

The sender creates the file (mode 0600, so only the same user can map it) and writes a random nonce
at its start; the receiver maps it only if the name has our prefix and the nonce matches, which also
proves both ends see the same /dev/shm (containers may not). Once the receiver has mapped it, the
sender unlinks the name: the memory lives while mapped and nothing is left behind if either dies.
"""
from __future__ import annotations

import mmap
import os
import re
import secrets
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIX = "kvmesh-kv-"
NONCE = 16
_NAME = re.compile(rf"^{PREFIX}[0-9a-f]{{32}}$")
# Populated at map time: a first touch of a shared-memory page costs a fault in each process, and a
# transfer that found its slots cold ran at a quarter of the speed (measured, 16 MiB slots).
_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


class ShmRing:
    """The sender's side: `slots` slots of `slot_bytes` after the nonce."""

    def __init__(self, slots: int, slot_bytes: int) -> None:
        self.slots, self.slot_bytes = slots, slot_bytes
        self.name = PREFIX + secrets.token_hex(16)
        self.nonce = secrets.token_bytes(NONCE)
        self.path = SHM_DIR / self.name
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, NONCE + slots * slot_bytes)
            self._map = mmap.mmap(fd, NONCE + slots * slot_bytes, flags=_FLAGS)
        except BaseException:
            os.close(fd)
            self.unlink()
            raise
        os.close(fd)
        self._map[:NONCE] = self.nonce

    def slot(self, i: int) -> memoryview:
        start = NONCE + i * self.slot_bytes
        return memoryview(self._map)[start:start + self.slot_bytes]

    def unlink(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self.unlink()
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with it
            pass


class ShmView:
    """The receiver's side: the same file mapped (read-write only because torch.frombuffer wants a
    writable buffer; the receiver never writes to it)."""

    def __init__(self, name: str, nonce: bytes, slots: int, slot_bytes: int) -> None:
        if not _NAME.match(name):
            raise ValueError(f"not a kvmesh shared-memory name: {name!r}")
        size = NONCE + slots * slot_bytes
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or st.st_size != size:
                raise ValueError("shared memory of another user or another size")
            self._map = mmap.mmap(fd, size, flags=_FLAGS)
        finally:
            os.close(fd)
        if self._map[:NONCE] != nonce:
            self._map.close()
            raise ValueError("shared memory nonce does not match (another /dev/shm)")
        self.slots, self.slot_bytes = slots, slot_bytes

    def slot(self, i: int, nbytes: int) -> memoryview:
        if not 0 <= i < self.slots or not 0 <= nbytes <= self.slot_bytes:
            raise ValueError(f"slot {i} / {nbytes} bytes outside the ring")
        start = NONCE + i * self.slot_bytes
        return memoryview(self._map)[start:start + nbytes]

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:
            pass
