"""Positioned reads and writes that work with O_DIRECT: page-aligned buffers, lengths and offsets in ALIGN units.

O_DIRECT bypasses the page cache, so the disk tier's blocks do not crowd the CPU tier out of memory twice
over; it needs aligned buffers (an anonymous mmap is page aligned), aligned offsets and aligned lengths, and
not every filesystem takes it (tmpfs and some FUSE filesystems refuse with EINVAL). Support is probed once per
directory with a real write and read; where it fails, buffered I/O is used.
"""
from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

ALIGN = 4096  # the largest logical block size in use; every O_DIRECT offset and length is a multiple of it
O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux; elsewhere never requested


def round_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def aligned_buffer(n: int) -> mmap.mmap:
    """A zeroed, page-aligned buffer of at least n bytes, rounded up to ALIGN."""
    return mmap.mmap(-1, max(round_up(n), ALIGN))


def direct_supported(directory: Path) -> bool:
    """Whether files in `directory` take O_DIRECT (a real aligned write and read, then the probe is deleted)."""
    if not O_DIRECT:
        return False
    probe = directory / ".direct-probe"
    buf = aligned_buffer(ALIGN)
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | O_DIRECT | os.O_NOFOLLOW, 0o600)
        try:
            return os.pwrite(fd, buf, 0) == ALIGN and os.preadv(fd, [buf], 0) == ALIGN
        finally:
            os.close(fd)
    except OSError:  # EINVAL: the filesystem refuses O_DIRECT
        return False
    finally:
        probe.unlink(missing_ok=True)


def pread_full(fd: int, buf: memoryview, offset: int) -> int:
    """Reads into all of `buf` from `offset`, as far as the file goes; returns the bytes read."""
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return done


def pwrite_full(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        done += os.pwrite(fd, buf[done:], offset + done)


class ThreadBuffers:
    """One reusable aligned buffer per thread of a pool, grown to the largest size asked for (no global state:
    each owner keeps its own)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, n: int) -> memoryview:
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < n:
            buf = self._local.buf = aligned_buffer(n)
        return memoryview(buf)[:round_up(n)]
