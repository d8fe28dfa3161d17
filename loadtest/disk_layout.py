"""`kvmesh bench disk-layout`: the disk tier's layouts side by side on a real directory, in one run.

Layouts (all through the same DiskTier: same records, xxh3 checksums, thread pool, O_DIRECT handling):
  slab      one preallocated file of fixed-size slots (the production layout, services/kvstore/slab_file.py)
  per-file  one file per block, written to a temporary name and renamed (loadtest/disk_layouts.py)
  group     one file per put of up to 16 blocks (loadtest/disk_layouts.py)

For each layout, block size, O_DIRECT on or off, and I/O thread count, on a fresh directory:
  write fresh  puts of `--chain` blocks filling half the tier's cap (nothing to evict)
  write full   as many puts again: the tier is full, every put evicts the least recently used blocks
  sync         os.sync() after the writes: what the page cache still owed the disk
  read cold    every held chain once, in random order, after dropping the page cache (when we may)
  read warm    the same again, without dropping it
  restart      a new DiskTier on the directory (the scan), cold then warm
Repeats go round the whole matrix, so slow drift of the machine lands on every layout alike; medians.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import xxhash

from loadtest.workload import machine_info, warn_if_busy, write_result

LAYOUTS = ("slab", "per-file", "group")
METRICS = ("write_fresh_gb_s", "write_fresh_blocks_s", "write_full_gb_s", "sync_s", "read_cold_gb_s",
           "read_warm_gb_s", "restart_cold_ms", "restart_warm_ms")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", help="write the results here")
    p.add_argument("--dir", help="where to create the test directories (default: .kvmesh/bench-disk under the "
                   "current directory, the filesystem a kvstore would use; not /tmp, often tmpfs)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    p.add_argument("--sizes-mb", default="0.1,1.8,5", help="block sizes (K and V bytes), MB, comma-separated")
    p.add_argument("--direct", default="off,on", help="O_DIRECT settings to run: off, on, or both")
    p.add_argument("--io-threads", default="4", help="the tier's I/O threads, comma-separated")
    p.add_argument("--total-mb", type=float, default=256, help="bytes written per layout and size (half fill the "
                   "tier, half evict)")
    p.add_argument("--chain", type=int, default=8, help="blocks per put and per read")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-drop-cache", dest="drop_cache", action="store_false",
                   help="never drop the page cache (it slows every other process's file reads for a moment)")


@dataclass(frozen=True)
class Cell:
    layout: str
    block_mb: float
    direct: bool
    io_threads: int

    @property
    def name(self) -> str:
        return f"{self.layout} {self.block_mb:g}MB {'direct' if self.direct else 'buffered'} x{self.io_threads}"


def layout_factory(name: str):  # noqa: ANN201
    from loadtest.disk_layouts import GroupFileLayout, PerFileLayout
    from services.kvstore.slab_file import SlabFile

    return {"slab": SlabFile, "per-file": PerFileLayout, "group": GroupFileLayout}[name]


def drop_page_cache(allowed: bool = True) -> bool:
    """Writes back and drops the page cache (root only); False when we may not, and reads are cache reads."""
    os.sync()
    if not allowed:
        return False
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def make_chains(n_blocks: int, block_bytes: int, chain: int, rng: random.Random) -> list[list]:
    """Chains of bf16 K/V blocks, 16 tokens each; 8 distinct payloads shared (content does not change I/O)."""
    from shared.protocol.kvstore import StoredBlock
    from shared.wire import WireTensor

    width = max(1, block_bytes // 2 // 2 // 16)  # bf16, K and V halves, 16 tokens
    payloads = [rng.randbytes(16 * width * 2) for _ in range(8)]
    chains, parent = [], None
    for i in range(n_blocks):
        if i % chain == 0:
            chains.append([])
            parent = None
        k = WireTensor(dtype="bfloat16", shape=[16, width], data=payloads[i % 8])
        v = WireTensor(dtype="bfloat16", shape=[16, width], data=payloads[(i + 1) % 8])
        block = StoredBlock(hash=rng.randbytes(16), parent=parent, k=k, v=v)
        chains[-1].append(block)
        parent = block.hash
    return chains


def measure(cell: Cell, root: Path, args: argparse.Namespace, rng: random.Random) -> dict:
    from services.kvstore import disk_record
    from services.kvstore.aligned_io import round_up
    from services.kvstore.disk_tier import DiskTier

    block_bytes = int(cell.block_mb * 1e6)
    n = max(2 * args.chain, int(args.total_mb * 1e6 / block_bytes) // (2 * args.chain) * 2 * args.chain)
    chains = make_chains(n, block_bytes, args.chain, rng)
    payload = sum(b.k.nbytes + b.v.nbytes for b in chains[0])  # per chain
    cap = round_up(disk_record.record_bytes(chains[0][0])) * (n // 2)
    directory = Path(tempfile.mkdtemp(prefix=f"{cell.layout}-", dir=root))
    factory = layout_factory(cell.layout)

    def tier() -> DiskTier:
        return DiskTier(directory, cap, io_threads=cell.io_threads, direct=cell.direct, layout=factory)

    try:
        t = tier()
        half = len(chains) // 2
        out: dict = {"blocks_written": n, "direct_used": t.direct}
        drop_page_cache(args.drop_cache)
        for phase, part in (("fresh", chains[:half]), ("full", chains[half:])):
            start = time.perf_counter()
            for c in part:
                t.put(c)
            seconds = time.perf_counter() - start
            out[f"write_{phase}_gb_s"] = len(part) * payload / seconds / 1e9
            out[f"write_{phase}_blocks_s"] = len(part) * args.chain / seconds
        start = time.perf_counter()
        os.sync()
        out["sync_s"] = time.perf_counter() - start
        held = chains[half:]
        assert t.stats().blocks == len(held) * args.chain, (t.stats(), cell)
        for phase in ("cold", "warm"):
            if phase == "cold":
                drop_page_cache(args.drop_cache)
            order = rng.sample(held, len(held))
            start = time.perf_counter()
            got = sum(len(t.get_chain([b.hash for b in c])) for c in order)
            seconds = time.perf_counter() - start
            assert got == len(held) * args.chain, (got, cell)
            out[f"read_{phase}_gb_s"] = len(held) * payload / seconds / 1e9
        t.close()
        for phase in ("cold", "warm"):
            if phase == "cold":
                drop_page_cache(args.drop_cache)
            start = time.perf_counter()
            t = tier()
            out[f"restart_{phase}_ms"] = (time.perf_counter() - start) * 1e3
            assert t.stats().blocks == len(held) * args.chain, (t.stats(), cell)
            t.close()
        out["blocks_held"] = len(held) * args.chain
        out["disk_bytes"] = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
        return out
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def checksum_speed() -> dict:
    """GB/s of one core for the old (crc32) and the new (xxh3-64) record checksum, on a 1.8 MB block."""
    data = os.urandom(1_835_008)
    out = {}
    for name, fn in (("crc32", zlib.crc32), ("xxh3_64", xxhash.xxh3_64_intdigest)):
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(20):
                fn(data)
            runs.append(20 * len(data) / (time.perf_counter() - start) / 1e9)
        out[name] = statistics.median(runs)
    return out


def filesystem_of(path: Path) -> str:
    """The mount's filesystem type and options, from /proc/mounts (Linux), for the report."""
    best, desc = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, mount, fstype, opts, *_ = line.split()
                if str(path.resolve()).startswith(mount) and len(mount) > len(best):
                    best, desc = mount, f"{fstype} ({opts}) on {mount}"
    except OSError:
        pass
    return desc


def run(args: argparse.Namespace) -> int:
    machine = machine_info()  # before anything runs: its load average is other people's work
    warn_if_busy()
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    assert set(layouts) <= set(LAYOUTS), f"layouts are {LAYOUTS}"
    cells = [Cell(layout, float(mb), direct == "on", int(threads))
             for mb in args.sizes_mb.split(",") for direct in args.direct.split(",")
             for threads in args.io_threads.split(",") for layout in layouts]
    root = Path(args.dir or ".kvmesh/bench-disk")
    root.mkdir(parents=True, exist_ok=True)
    dropped = drop_page_cache(args.drop_cache)
    cache = "dropped before cold phases" if dropped else "NOT droppable: cold reads are page-cache reads"
    print(f"{filesystem_of(root)}; page cache {cache}", file=sys.stderr)
    rng = random.Random(args.seed)
    runs: dict[Cell, list[dict]] = {c: [] for c in cells}
    for rep in range(args.repeats):
        for cell in cells:
            print(f"[{rep + 1}/{args.repeats}] {cell.name} ...", file=sys.stderr)
            runs[cell].append(measure(cell, root, args, rng))
    results = []
    for cell, rs in runs.items():
        medians = {m: statistics.median(r[m] for r in rs) for m in METRICS}
        results.append({"layout": cell.layout, "block_mb": cell.block_mb, "direct": cell.direct,
                        "direct_used": rs[0]["direct_used"], "io_threads": cell.io_threads,
                        "blocks_written": rs[0]["blocks_written"], "blocks_held": rs[0]["blocks_held"],
                        "disk_bytes": rs[0]["disk_bytes"], "median": medians,
                        "runs": {m: [r[m] for r in rs] for m in METRICS}})
    print_table(results, args.repeats)
    sums = checksum_speed()
    print(f"checksum, one core: crc32 {sums['crc32']:.2f} GB/s, xxh3-64 {sums['xxh3_64']:.2f} GB/s")
    write_result(args.json, {"filesystem": filesystem_of(root), "page_cache_dropped": dropped,
                             "total_mb": args.total_mb, "chain": args.chain, "repeats": args.repeats,
                             "checksum_gb_s": sums, "cells": results, "machine": machine,
                             "loadavg_after": list(os.getloadavg())})
    return 0


def print_table(results: list[dict], repeats: int) -> None:
    print(f"medians of {repeats}; GB/s of K/V bytes; write full = every put evicts; restart = scan of the held "
          "blocks")
    head = ("layout", "block", "I/O", "thr", "write GB/s", "blocks/s", "full GB/s", "sync s", "read cold",
            "read warm", "held", "restart cold ms", "warm ms")
    print(" | ".join(head))
    for r in results:
        m = r["median"]
        io = "direct" if r["direct_used"] else ("buffered*" if r["direct"] else "buffered")
        print(" | ".join([r["layout"], f"{r['block_mb']:g} MB", io, str(r["io_threads"]),
                          f"{m['write_fresh_gb_s']:.2f}", f"{m['write_fresh_blocks_s']:.0f}",
                          f"{m['write_full_gb_s']:.2f}", f"{m['sync_s']:.2f}", f"{m['read_cold_gb_s']:.2f}",
                          f"{m['read_warm_gb_s']:.2f}", str(r["blocks_held"]), f"{m['restart_cold_ms']:.0f}",
                          f"{m['restart_warm_ms']:.0f}"]))
    print("(buffered*: O_DIRECT asked for and refused by the filesystem)")
