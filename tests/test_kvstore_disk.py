"""The kvstore's persistent disk tier (issue 10 item 3): bit-exact round trips, found again after a
restart, a byte cap with LRU eviction, damaged or old-format slots detected and never served, the I/O
thread pool and O_DIRECT giving the same blocks as plain reads, full disks, admission of blocks used
twice, and the whole stack through a real kvstore service on a real nats-server."""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import struct

import pytest
import torch

from services.kvstore.cpu_tier import CPUTier
from services.kvstore import disk_record, slab_file
from services.kvstore.aligned_io import round_up
from services.kvstore.disk_tier import DiskTier
from services.kvstore.service import KVStoreService
from services.kvstore.tiered import TieredStore
from shared.bus.natsd import NatsServer
from shared.kv_blocks import KVBlocks
from services.kvstore_client import KVStoreClient
from shared.protocol.kvstore import StoredBlock
from shared.wire import tensor_to_wire
from shared import bus


def _block(i: int, parent: bytes | None = None, dtype=torch.bfloat16) -> StoredBlock:
    g = torch.Generator().manual_seed(i)
    k, v = (torch.randn(2, 16, 2, 8, generator=g).to(dtype) for _ in range(2))
    return StoredBlock(hash=bytes([i]) * 16, parent=parent, k=tensor_to_wire(k), v=tensor_to_wire(v))


def _chain(n: int, start: int = 0) -> list[StoredBlock]:
    blocks, parent = [], None
    for i in range(start, start + n):
        blocks.append(_block(i, parent))
        parent = blocks[-1].hash
    return blocks


def test_round_trip_is_bit_exact_and_survives_a_restart(tmp_path) -> None:  # noqa: ANN001
    chain = _chain(4)
    disk = DiskTier(tmp_path, 1 << 20)
    assert disk.put(chain).stored == 4
    again = DiskTier(tmp_path, 1 << 20)  # a restarted kvstore
    got = again.get_chain([b.hash for b in chain])
    assert [g.model_dump() for g in got] == [b.model_dump() for b in chain]
    assert again.stats().blocks == 4 and again.stats().hits == 4


SLOT = round_up(disk_record.record_bytes(_block(0)))  # one block's slot (all test blocks are one size)


def _slab(tier: DiskTier):  # noqa: ANN202
    return next(tier.dir.glob("blocks-*.slab"))


def _slot_offset(tier: DiskTier, block_hash: bytes) -> int:
    return tier._index[block_hash].where * SLOT


def test_byte_cap_evicts_least_recently_used_blocks(tmp_path) -> None:  # noqa: ANN001
    disk = DiskTier(tmp_path, 3 * SLOT)
    disk.put(_chain(2))  # 0, 1
    disk.get_chain([bytes([0]) * 16])  # 0 is now most recent
    disk.put(_chain(2, start=10))  # needs room for two more: 1 goes, then the oldest remaining
    assert disk.stats().blocks == 3 and disk.stats().bytes <= 3 * SLOT
    assert disk.contains_chain([bytes([1]) * 16]) == 0 and disk.contains_chain([bytes([0]) * 16]) == 1
    assert _slab(disk).stat().st_size <= 3 * SLOT, "the file never grows past the cap"
    disk.close()
    again = DiskTier(tmp_path, 2 * SLOT)  # a lower cap after a restart: the oldest written goes first
    assert again.stats().blocks == 2 and again.contains_chain([bytes([10]) * 16, bytes([11]) * 16]) == 2


@pytest.mark.parametrize("damage", ["flip", "torn", "truncate", "garbage", "old-version"])
def test_damaged_slots_are_dropped_never_served(tmp_path, damage) -> None:  # noqa: ANN001
    chain = _chain(3)
    disk = DiskTier(tmp_path, 1 << 20)
    for block in chain:  # one put each: slots 0, 1, 2 in chain order
        disk.put([block])
    at, path = _slot_offset(disk, chain[1].hash), _slab(disk)
    assert at == SLOT
    disk.close()
    record = disk_record.record_bytes(chain[1])
    with open(path, "r+b") as f:
        if damage == "flip":
            f.seek(at + record - 5)
            byte = f.read(1)[0]
            f.seek(at + record - 5)
            f.write(bytes([byte ^ 0xFF]))
        elif damage == "torn":  # the write stopped half way: the rest is the slot's earlier content
            f.seek(at + record // 2)
            f.write(b"\0" * (record - record // 2))
        elif damage == "truncate":  # the file ends mid-record (and the slot after it is gone)
            f.truncate(at + record // 2)
        elif damage == "garbage":
            f.seek(at)
            f.write(b"not a block")
        else:  # a record of format version 1 (crc32): not ours
            f.seek(at + 4)
            f.write(struct.pack("<H", 1))
    disk = DiskTier(tmp_path, 1 << 20)
    got = disk.get_chain([b.hash for b in chain])
    assert [g.hash for g in got] == [chain[0].hash], "the chain stops at the damaged block"
    assert [g.model_dump() for g in got] == [chain[0].model_dump()]
    found_at_scan = damage in ("flip", "torn")  # its header is intact: found, then fails its checksum at read
    assert disk.corrupt == (1 if found_at_scan else 0)
    assert disk.contains_chain([chain[1].hash]) == 0, "dropped from the index"
    assert disk.put([chain[1]]).stored == 1 and disk.get_chain([chain[1].hash])[0] == chain[1], "its slot is reused"


def test_old_one_file_per_block_files_are_dropped_never_served(tmp_path) -> None:  # noqa: ANN001
    """The version 1 layout: `<2 hex>/<hash hex>.kvb`, a crc32 header, and .tmp files of cut-off writes."""
    block = _block(0)
    h = block.hash.hex()
    (tmp_path / h[:2]).mkdir()
    old = tmp_path / h[:2] / f"{h}.kvb"
    old.write_bytes(b"KVMB" + struct.pack("<H", 1) + block.k.data + block.v.data)
    (tmp_path / h[:2] / "leftover.tmp").write_bytes(b"half a write")
    disk = DiskTier(tmp_path, 1 << 20)
    assert disk.stats().blocks == 0 and disk.get_chain([block.hash]) == []
    assert not old.exists() and not (tmp_path / h[:2]).exists()


def test_concurrent_reads_and_writes_match_one_thread_and_o_direct_matches_buffered(tmp_path) -> None:  # noqa: ANN001
    chains = [_chain(8, start=10 * i) for i in range(4)]
    hashes = [[b.hash for b in c] for c in chains]
    want = [[b.model_dump() for b in c] for c in chains]
    direct_ok = DiskTier(tmp_path / "probe", 1 << 20, direct=True).direct
    results = {}
    for threads in (1, 4):
        for direct in (False, True):
            where = tmp_path / f"t{threads}-{direct}"
            disk = DiskTier(where, 1 << 20, io_threads=threads, direct=direct)
            assert disk.direct == (direct and direct_ok) and disk.stats().blocks == 0
            for c in chains:
                assert disk.put(c).stored == 8
            disk.close()
            for read_direct in (False, True):  # written one way, read back both ways after a restart
                again = DiskTier(where, 1 << 20, io_threads=threads, direct=read_direct)
                results[threads, direct, read_direct] = [[g.model_dump() for g in again.get_chain(h)] for h in hashes]
                again.close()
    assert all(r == want for r in results.values()), "every mode gives the blocks put, bit for bit"


def test_o_direct_refused_falls_back_to_buffered_io(tmp_path, monkeypatch, caplog) -> None:  # noqa: ANN001
    from services.kvstore import disk_tier

    monkeypatch.setattr(disk_tier, "direct_supported", lambda directory: False)  # as on tmpfs
    with caplog.at_level(logging.WARNING):
        disk = DiskTier(tmp_path, 1 << 20, direct=True)
    assert not disk.direct and "O_DIRECT" in caplog.text
    chain = _chain(3)
    disk.put(chain)
    assert disk.get_chain([b.hash for b in chain]) == chain


@pytest.mark.parametrize("failure", ["fallocate", "write"])
def test_a_full_or_failing_disk_is_logged_and_the_tier_keeps_serving(tmp_path, monkeypatch, caplog,  # noqa: ANN001
                                                                     failure) -> None:
    monkeypatch.setattr(slab_file, "GROW_BYTES", SLOT)  # the file grows a slot at a time
    disk = DiskTier(tmp_path, 1 << 30)
    first = _chain(2)
    assert disk.put(first).stored == 2

    def fail(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise OSError(errno.ENOSPC, "No space left on device")

    if failure == "fallocate":  # the next slot needs the file to grow, and the disk is full
        monkeypatch.setattr(slab_file.os, "posix_fallocate", fail)
    else:
        monkeypatch.setattr(slab_file, "pwrite_full", fail)
    with caplog.at_level(logging.ERROR):
        assert disk.put(_chain(2, start=10)).stored == 0
    assert disk.write_errors == 2 and "disk tier: cannot" in caplog.text
    assert disk.get_chain([b.hash for b in first]) == first, "what it holds is still served"
    monkeypatch.undo()
    if failure == "fallocate":  # the tier now keeps to the file it has: new blocks evict old ones
        assert disk._cap() == disk._bytes
        assert disk.put(_chain(2, start=20)).stored == 2 and disk.stats().blocks == 2
    else:  # the failed slots were given back
        assert disk.put(_chain(2, start=20)).stored == 2 and disk.stats().blocks == 4


def test_the_slot_size_follows_the_first_block_and_larger_blocks_wait_for_an_empty_tier(tmp_path) -> None:  # noqa: ANN001
    small = _chain(2)
    big = StoredBlock(hash=b"\xbb" * 16, k=tensor_to_wire(torch.zeros(2, 16, 8, 8, dtype=torch.bfloat16)),
                      v=tensor_to_wire(torch.ones(2, 16, 8, 8, dtype=torch.bfloat16)))
    disk = DiskTier(tmp_path, 1 << 20)
    disk.put(small)
    assert disk.put([big]).stored == 0 and disk.too_large == 1, "larger than a slot while the file holds blocks"
    disk.evict(1 << 30)
    assert disk.put([big]).stored == 1 and disk.put(small).stored == 2, "an empty tier takes the new size"
    assert [p.name for p in tmp_path.glob("*.slab")] == [f"blocks-{round_up(disk_record.record_bytes(big))}.slab"]
    disk.close()
    again = DiskTier(tmp_path, 1 << 20)
    assert again.get_chain([big.hash]) == [big] and again.get_chain([b.hash for b in small]) == small


def test_an_unwritable_directory_is_a_clear_error_at_start(tmp_path) -> None:  # noqa: ANN001
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    try:
        if os.access(ro, os.W_OK):  # root ignores the mode bits
            pytest.skip("running as root: a read-only directory is writable")
        with pytest.raises(RuntimeError, match="cannot write"):
            DiskTier(ro, 1 << 20)
    finally:
        os.chmod(ro, 0o700)


def test_a_directory_that_cannot_be_made_is_a_clear_error_at_start(tmp_path) -> None:  # noqa: ANN001
    """The root-proof case of the test above (CI runs as root): a path under a regular file can never be a
    directory, whatever the user's rights."""
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    with pytest.raises(RuntimeError, match="cannot write"):
        DiskTier(blocker / "kv", 1 << 20)


def test_blocks_used_twice_go_down_to_disk_and_come_back_up(tmp_path) -> None:  # noqa: ANN001
    one = _block(0).k.nbytes * 2  # one block of tensor bytes
    store = TieredStore(CPUTier(3 * one), DiskTier(tmp_path, 1 << 20), disk_min_uses=2)
    hot, cold = _chain(2), _chain(2, start=20)
    store.put(hot)
    store.get_chain([b.hash for b in hot])  # used twice now
    store.put(cold)  # used once
    store.put(_chain(3, start=40))  # pushes hot and cold out of memory
    assert store.demoted == 2 and store.not_admitted >= 1
    got = store.get_chain([b.hash for b in hot])
    assert [g.hash for g in got] == [b.hash for b in hot], "served from disk"
    assert store.cpu.contains_chain([b.hash for b in hot]) == 2, "and promoted back to memory"
    assert store.contains_chain([b.hash for b in cold]) == 0


def test_a_restarted_kvstore_serves_from_disk_over_the_bus(tmp_path) -> None:  # noqa: ANN001
    from shared import subjects
    from tests.nats_fixtures import wait_discoverable

    chain = _chain(4)
    k = torch.stack([torch.frombuffer(bytearray(b.k.data), dtype=torch.bfloat16).view(2, 16, 2, 8) for b in chain], 1)
    v = torch.stack([torch.frombuffer(bytearray(b.v.data), dtype=torch.bfloat16).view(2, 16, 2, 8) for b in chain], 1)
    hashes = [b.hash for b in chain]

    async def run(service: KVStoreService, work):  # noqa: ANN001, ANN202
        nc = await bus.connect(nats.url)
        await service.start(await bus.connect(nats.url))
        # The client's puts are best effort (no responders or a timeout is logged, not raised): until the
        # service's subscriptions reach the server, a put is lost; a loaded machine widens that window.
        await wait_discoverable(nc, subjects.SERVICE_KVSTORE, timeout=60)
        try:
            return await work(KVStoreClient(nc, timeout_s=60))
        finally:
            await service.drain(1.0)
            await nc.close()

    async def put_and_read(client: KVStoreClient):
        await client.put(KVBlocks(k, v, hashes=hashes), [b.parent for b in chain])
        return await client.get_chain(hashes)  # a second use: admitted to disk when evicted

    def service(capacity: int) -> KVStoreService:
        return KVStoreService(TieredStore(CPUTier(capacity), DiskTier(tmp_path / "disk", 1 << 20), disk_min_uses=2))

    with NatsServer(workdir=tmp_path) as nats:
        first = service(1 << 20)
        asyncio.run(run(first, put_and_read))
        first.tier.evict(1 << 30)  # memory emptied: every block that was used twice is now on disk
        assert first.tier.disk.stats().blocks == 4
        async def read_back(client: KVStoreClient):
            # A fresh process scans its disk as it starts; a get that beats the scan is a (safe) miss.
            for _ in range(50):
                got = await client.get_chain(hashes)
                if got is not None:
                    return got
                await asyncio.sleep(0.1)
            return None

        got = asyncio.run(run(service(1 << 20), read_back))  # a fresh process, same disk
    assert got is not None and torch.equal(got.k, k) and torch.equal(got.v, v) and got.hashes == hashes


def test_kill_9_in_the_middle_of_disk_writes_serves_nothing_corrupted(tmp_path) -> None:  # noqa: ANN001
    """A real kvstore process, its memory tier tiny so every put spills to disk, SIGKILLed while a client
    keeps putting; restarted on the same directory, whatever it serves is bit-exact with what was put."""
    import signal
    import subprocess
    import sys
    import time

    from shared import subjects
    from tests.nats_fixtures import wait_discoverable

    disk = tmp_path / "disk"
    chains = [_chain(6, start=6 * i) for i in range(40)]  # 240 blocks of 2 KiB, hashes bytes([i]) * 16

    def tensors(chain):  # noqa: ANN001, ANN202
        k = torch.stack([torch.frombuffer(bytearray(b.k.data), dtype=torch.bfloat16).view(2, 16, 2, 8) for b in chain], 1)
        v = torch.stack([torch.frombuffer(bytearray(b.v.data), dtype=torch.bfloat16).view(2, 16, 2, 8) for b in chain], 1)
        return k, v

    def start(nats: NatsServer) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "services.kvstore", "--capacity-bytes", "8192", "--disk-dir", str(disk),
             "--disk-min-uses", "1"], env={**os.environ, "NATS_URL": nats.url},
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    async def put_until_killed(nats: NatsServer, proc: subprocess.Popen) -> int:
        nc = await bus.connect(nats.url)
        await wait_discoverable(nc, subjects.SERVICE_KVSTORE, timeout=60)
        client = KVStoreClient(nc, timeout_s=2.0)
        sent = 0
        for i, chain in enumerate(chains):
            if i == len(chains) // 2:
                proc.send_signal(signal.SIGKILL)  # mid-stream: some files are being written right now
            k, v = tensors(chain)
            await client.put(KVBlocks(k, v, hashes=[b.hash for b in chain]), [b.parent for b in chain])
            sent += 1
        await nc.close()
        return sent

    async def read_back(nats: NatsServer) -> list:  # noqa: ANN202
        nc = await bus.connect(nats.url)
        await wait_discoverable(nc, subjects.SERVICE_KVSTORE, timeout=60)
        client = KVStoreClient(nc, timeout_s=5.0)
        got = [await client.get_chain([b.hash for b in chain]) for chain in chains]
        await nc.close()
        return got

    with NatsServer(workdir=tmp_path) as nats:
        proc = start(nats)
        try:
            asyncio.run(put_until_killed(nats, proc))
            assert proc.wait(timeout=10) == -signal.SIGKILL
        finally:
            if proc.poll() is None:
                proc.kill()
        on_disk = len(list(disk.rglob("*")))
        proc = start(nats)
        try:
            got = asyncio.run(read_back(nats))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=20)
    served = 0
    for chain, kv in zip(chains, got):
        if kv is None:
            continue
        k, v = tensors(chain)
        n = kv.num_blocks
        assert torch.equal(kv.k, k[:, :n]) and torch.equal(kv.v, v[:, :n])  # never a corrupted block
        served += n
    assert on_disk > 0 and served > 0, (on_disk, served)  # the restart found blocks written before the kill
    assert not list(disk.rglob("*.tmp"))  # a write cut off by the kill was cleaned up at start


def test_blocks_that_leave_the_store_are_reported_once(tmp_path) -> None:  # noqa: ANN001
    """What routers must forget: blocks evicted from memory and not admitted to disk, and blocks the disk
    evicts; not blocks that merely moved down to disk."""
    per_block = _block(0).k.nbytes * 2
    store = TieredStore(CPUTier(2 * per_block), DiskTier(tmp_path / "disk", 64 * per_block), disk_min_uses=2)
    a, b = _chain(2), _chain(2, start=10)
    store.put(a)
    store.get_chain([x.hash for x in a])  # a used twice: it goes to disk when evicted
    store.put(b)  # a leaves memory for disk
    assert store.take_gone() == [] and store.disk.stats().blocks == 2
    store.put(_chain(2, start=20))  # b leaves memory, used once: gone
    assert sorted(store.take_gone()) == sorted(x.hash for x in b)
    store.disk.evict(1 << 30)  # the disk drops a
    assert sorted(store.take_gone()) == sorted(x.hash for x in a) and store.take_gone() == []
