"""The kvstore service: KV blocks by block hash, so a prefix computed once is fetched, not recomputed.

Workers put blocks they evict (or, under write-through, every block they cache) and get the longest
chain of a prompt's block hashes the store holds, from memory or the disk tier below it (tiered.py). Blocks stay opaque bytes here (no torch, no unpickling): the store checks only that a
block is well formed, and hands it back bit for bit.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor

from nats.aio.client import Client

from services.inflight import InFlight, MicroServiceDrain
from services.kvstore.cpu_tier import CPUTier
from services.kvstore.disk_tier import DEFAULT_IO_THREADS, DiskTier
from services.kvstore.tier import KVTier, PutResult
from services.kvstore.tiered import TieredStore
from shared import bus, subjects
from shared.block_hash import DIGEST_SIZE
from shared.engine.errors import ConfigError
from shared.private_dir import UnsafeDirectory
from shared.protocol import errors as codes
from shared.protocol.events import BlockRemoved, BlockStored
from shared.protocol.kvstore import (
    ContainsReply,
    ContainsRequest,
    GetReply,
    GetRequest,
    PutReply,
    PutRequest,
    StatsReply,
    StatsRequest,
    StoredBlock,
)
from shared.service_runner import Service

log = logging.getLogger(__name__)

VERSION = "0.1.0"
DEFAULT_CAPACITY_BYTES = 2 << 30
# Callers reassemble replies up to the bus's max_message_bytes; half of it leaves room for framing.
DEFAULT_MAX_REPLY_BYTES = bus.DEFAULT_LIMITS.max_message_bytes // 2


STATS_INTERVAL_S = 2.0  # how often the kvstore announces its tiers' figures


class KVStoreService(MicroServiceDrain, Service):
    name = "kvstore"

    def __init__(self, tier: KVTier, max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES) -> None:
        self.tier = tier
        self._io = ThreadPoolExecutor(1, thread_name_prefix="kvstore-io")
        self.max_reply_bytes = max_reply_bytes
        self._micro: bus.MicroService | None = None
        self._nc: Client | None = None
        self._announcer: asyncio.Future | None = None
        self._inflight = InFlight()

    async def start(self, nc: Client) -> None:
        self._nc = nc
        track, queue = self._inflight.track, subjects.QUEUE_KVSTORE
        self._micro = await bus.add_micro_service(
            nc, subjects.SERVICE_KVSTORE, VERSION,
            [
                bus.Endpoint("put", subjects.KVSTORE_PUT, queue, track(self.put), PutRequest),
                bus.Endpoint("get", subjects.KVSTORE_GET, queue, track(self.get), GetRequest),
                bus.Endpoint("contains", subjects.KVSTORE_CONTAINS, queue, track(self.contains), ContainsRequest),
                bus.Endpoint("stats", subjects.KVSTORE_STATS, queue, track(self.stats), StatsRequest),
            ],
            description="KV blocks by block hash (CPU memory, then an optional disk tier)",
            metadata={"capacity_bytes": str(self.tier.stats().capacity_bytes)},
        )  # fmt: skip
        await nc.flush()  # the server has our subscriptions once start() returns, so "serving" is true
        self._announcer = asyncio.ensure_future(self._announce_stats())

    async def release(self, remaining_s: float) -> None:
        if self._announcer is not None:
            self._announcer.cancel()
        await super().release(remaining_s)
        self._io.shutdown(wait=True)  # a disk write in progress finishes (files are renamed into place whole)
        self._io = ThreadPoolExecutor(1, thread_name_prefix="kvstore-io")  # a restarted service can serve again

    # ------------------------------------------------------------------ handlers

    async def _on_tiers(self, fn, *args):  # noqa: ANN001, ANN002, ANN202
        """Every tier operation on one I/O thread: the disk never blocks the event loop, and the tiers
        (not thread safe) see one caller at a time."""
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    async def put(self, req: PutRequest, ctx: bus.RequestContext) -> PutReply:
        for i, block in enumerate(req.blocks):  # all checked before any is stored: a bad put stores nothing
            _check_block(i, block)
        result, gone = await self._on_tiers(self._put, req.blocks)
        if self._nc is not None:  # routers count these blocks as cheap for every worker, and forget the gone
            if gone:
                await bus.publish(self._nc, subjects.KVSTORE_EVENTS, BlockRemoved(
                    worker_id="kvstore", hashes=gone, tier="kvstore"))
            if result.stored:
                await bus.publish(self._nc, subjects.KVSTORE_EVENTS, BlockStored(
                    worker_id="kvstore", hashes=[b.hash for b in req.blocks], tier="kvstore"))
        return PutReply(num_stored=result.stored)

    async def get(self, req: GetRequest, ctx: bus.RequestContext) -> GetReply:
        if req.max_blocks is not None and req.max_blocks < 0:
            raise bus.RemoteError(codes.BAD_REQUEST, f"max_blocks must be >= 0, got {req.max_blocks}")
        return GetReply(blocks=await self._on_tiers(self.tier.get_chain, req.hashes, req.max_blocks,
                                                    self.max_reply_bytes))

    async def contains(self, req: ContainsRequest, ctx: bus.RequestContext) -> ContainsReply:
        return ContainsReply(num_prefix_blocks=await self._on_tiers(self.tier.contains_chain, req.hashes))

    async def stats(self, req: StatsRequest, ctx: bus.RequestContext) -> StatsReply:
        return self._stats()

    def _put(self, blocks: list[StoredBlock]) -> tuple[PutResult, list[bytes]]:
        """One trip to the I/O thread: the put, and the hashes that left the whole store meanwhile."""
        result = self.tier.put(blocks)
        gone = [b.hash for b in result.evicted] + self.tier.take_gone()
        return result, gone

    def _stats(self) -> StatsReply:
        per = self.tier.stats_by_tier()
        cpu, disk = per["cpu"], per.get("disk")
        total = self.tier.stats()
        return StatsReply(cpu_blocks=cpu.blocks, cpu_bytes=cpu.bytes, disk_blocks=disk.blocks if disk else 0,
                          disk_bytes=disk.bytes if disk else 0, hits=total.hits, misses=total.misses,
                          cpu_hits=cpu.hits, disk_hits=disk.hits if disk else 0)

    async def _announce_stats(self) -> None:
        """Every STATS_INTERVAL_S: blocks, bytes and hits per tier, for the gateway's /metrics."""
        while True:
            await asyncio.sleep(STATS_INTERVAL_S)
            try:
                assert self._nc is not None
                await bus.publish(self._nc, subjects.KVSTORE_EVENTS, await self._on_tiers(self._stats))
            except Exception:  # noqa: BLE001 - a lost announcement is repaired by the next one
                log.debug("kvstore stats announcement failed", exc_info=True)


def _check_block(i: int, block: StoredBlock) -> None:
    problem = None
    if len(block.hash) != DIGEST_SIZE:
        problem = f"hash is {len(block.hash)} bytes, not {DIGEST_SIZE}"
    elif block.parent is not None and len(block.parent) != DIGEST_SIZE:
        problem = f"parent hash is {len(block.parent)} bytes, not {DIGEST_SIZE}"
    elif (block.k.dtype, block.k.shape) != (block.v.dtype, block.v.shape):
        problem = f"k is {block.k.dtype}{block.k.shape} but v is {block.v.dtype}{block.v.shape}"
    elif not block.k.nbytes:
        problem = "empty tensors"
    if problem:
        raise bus.RemoteError(codes.BAD_REQUEST, f"block {i}: {problem}")


_SIZE = re.compile(r"(\d+)\s*([KMGT]i?B?)?", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """'2147483648', '2GiB', '512M' -> bytes (binary units either way: cache sizes are never decimal)."""
    m = _SIZE.fullmatch(text.strip())
    if not m or int(m[1]) <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive size like 2147483648, 2GiB or 512MiB, got {text!r}")
    return int(m[1]) * _UNITS[(m[2] or "")[:1].lower()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--capacity-bytes", type=parse_bytes,
                        default=parse_bytes(os.environ.get("KVMESH_KVSTORE_CAPACITY", str(DEFAULT_CAPACITY_BYTES))),
                        help="CPU tier size (e.g. 2GiB; env KVMESH_KVSTORE_CAPACITY); least recently used blocks go first")
    parser.add_argument("--disk-dir", default=os.environ.get("KVMESH_KVSTORE_DISK_DIR") or None,
                        help="directory of the persistent disk tier below the CPU tier (env KVMESH_KVSTORE_DISK_DIR; "
                             "none: no disk tier); found again after a restart")
    parser.add_argument("--disk-bytes", type=parse_bytes,
                        default=parse_bytes(os.environ.get("KVMESH_KVSTORE_DISK_BYTES", "16GiB")),
                        help="disk tier size (env KVMESH_KVSTORE_DISK_BYTES); least recently used blocks go first")
    parser.add_argument("--disk-io-threads", type=int, default=DEFAULT_IO_THREADS,
                        help="threads a disk tier get or put spreads its file reads and writes over")
    parser.add_argument("--disk-direct", action="store_true",
                        default=os.environ.get("KVMESH_KVSTORE_DISK_DIRECT", "") not in ("", "0"),
                        help="O_DIRECT disk I/O where the filesystem takes it (env KVMESH_KVSTORE_DISK_DIRECT=1): "
                             "keeps disk blocks out of the page cache; off by default, the page cache measured faster")
    parser.add_argument("--disk-salt-tag", default=os.environ.get("KVMESH_KVSTORE_SALT_TAG") or None,
                        help="one-way tag of the mesh's cache salt (env KVMESH_KVSTORE_SALT_TAG; kvmesh up sets it): "
                             "disk records written under another salt are wiped at start")
    parser.add_argument("--disk-min-uses", type=int, default=2,
                        help="a block evicted from memory goes to disk only if it was used this many times")


def build(args: argparse.Namespace) -> KVStoreService:
    try:
        disk = DiskTier(args.disk_dir, args.disk_bytes, io_threads=args.disk_io_threads,
                        direct=args.disk_direct, salt_tag=args.disk_salt_tag) if args.disk_dir else None
    except UnsafeDirectory as e:  # the same on every restart: not retried
        raise ConfigError(f"--disk-dir: {e}") from e
    return KVStoreService(TieredStore(CPUTier(args.capacity_bytes), disk, args.disk_min_uses))
