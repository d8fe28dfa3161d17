"""The kvstore's persistent disk tier (issue 10 item 3): bit-exact round trips, found again after a
restart, a byte cap with LRU eviction, damaged files detected and never served, admission of blocks
used twice, and the whole stack through a real kvstore service on a real nats-server."""
from __future__ import annotations

import asyncio
import os

import pytest
import torch

from services.kvstore.cpu_tier import CPUTier
from services.kvstore.disk_tier import DiskTier, encode_block
from services.kvstore.service import KVStoreService
from services.kvstore.tiered import TieredStore
from shared.bus.natsd import NatsServer
from shared.kvstore_client import KVStoreClient
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


def test_byte_cap_evicts_least_recently_used_files(tmp_path) -> None:  # noqa: ANN001
    size = len(encode_block(_block(0)))
    disk = DiskTier(tmp_path, 3 * size)
    disk.put(_chain(2))  # 0, 1
    disk.get_chain([bytes([0]) * 16])  # 0 is now most recent
    disk.put(_chain(2, start=10))  # needs room for two more: 1 goes, then the oldest remaining
    files = sorted(p.name for p in tmp_path.glob("*/*.kvb"))
    assert len(files) == 3 and disk.stats().bytes <= 3 * size
    assert disk.contains_chain([bytes([1]) * 16]) == 0


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_damaged_files_are_dropped_never_served(tmp_path, damage) -> None:  # noqa: ANN001
    chain = _chain(3)
    DiskTier(tmp_path, 1 << 20).put(chain)
    victim = next(tmp_path.glob(f"*/{chain[1].hash.hex()}.kvb"))
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[-5] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data = bytearray(b"not a block")
    victim.write_bytes(bytes(data))
    (victim.parent / "leftover.tmp").write_bytes(b"half a write")
    disk = DiskTier(tmp_path, 1 << 20)
    got = disk.get_chain([b.hash for b in chain])
    assert [g.hash for g in got] == [chain[0].hash], "the chain stops at the damaged block"
    assert disk.corrupt == 1 and not victim.exists() and not (victim.parent / "leftover.tmp").exists()


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


def test_blocks_used_twice_go_down_to_disk_and_come_back_up(tmp_path) -> None:  # noqa: ANN001
    one = len(encode_block(_block(0))) - 64  # about one block of tensor bytes
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
    chain = _chain(4)
    k = torch.stack([torch.frombuffer(bytearray(b.k.data), dtype=torch.bfloat16).view(2, 16, 2, 8) for b in chain], 1)
    v = torch.stack([torch.frombuffer(bytearray(b.v.data), dtype=torch.bfloat16).view(2, 16, 2, 8) for b in chain], 1)
    hashes = [b.hash for b in chain]

    async def run(service: KVStoreService, work):  # noqa: ANN001, ANN202
        nc = await bus.connect(nats.url)
        await service.start(await bus.connect(nats.url))
        try:
            return await work(KVStoreClient(nc))
        finally:
            await service.drain(1.0)
            await nc.close()

    async def put_and_read(client: KVStoreClient):
        await client.put(hashes, [b.parent for b in chain], k, v)
        return await client.get_chain(hashes)  # a second use: admitted to disk when evicted

    def service(capacity: int) -> KVStoreService:
        return KVStoreService(TieredStore(CPUTier(capacity), DiskTier(tmp_path / "disk", 1 << 20), disk_min_uses=2))

    with NatsServer(workdir=tmp_path) as nats:
        first = service(1 << 20)
        asyncio.run(run(first, put_and_read))
        first.tier.evict(1 << 30)  # memory emptied: every block that was used twice is now on disk
        assert first.tier.disk.stats().blocks == 4
        got = asyncio.run(run(service(1 << 20), lambda c: c.get_chain(hashes)))  # a fresh process, same disk
    assert got is not None and torch.equal(got[0], k) and torch.equal(got[1], v)


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
            await client.put([b.hash for b in chain], [b.parent for b in chain], k, v)
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
        n = kv[0].shape[1]
        assert torch.equal(kv[0], k[:, :n]) and torch.equal(kv[1], v[:, :n])  # never a corrupted block
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
