"""kvstore poisoning: any process with a kvstore credential can store blocks under any hash, and the kvstore
keeps the first block stored under a hash. A block planted for a prompt's hash by someone without the mesh's
secret (here: a client without the MAC key, as the kvstore, gateway or tokenizer role is) must never be
read back by an engine worker; a worker's own blocks, through the CPU and the disk tier, are. A real
kvstore service on a real nats-server."""
from __future__ import annotations

import asyncio

import torch

from services.kvstore.cpu_tier import CPUTier
from services.kvstore.disk_tier import DiskTier
from services.kvstore.service import KVStoreService
from services.kvstore.tiered import TieredStore
from services.kvstore_client import KVStoreClient, mac_key
from shared import bus
from shared.bus.natsd import NatsServer
from shared.kv_blocks import KVBlocks
from tests.test_kvstore_disk import _chain


def _blocks(start: int) -> tuple[KVBlocks, list[bytes | None]]:
    chain = _chain(4, start)
    k = torch.stack([torch.frombuffer(bytearray(b.k.data), dtype=torch.bfloat16).view(2, 16, 2, 8) for b in chain], 1)
    v = torch.stack([torch.frombuffer(bytearray(b.v.data), dtype=torch.bfloat16).view(2, 16, 2, 8) for b in chain], 1)
    return KVBlocks(k, v, hashes=[b.hash for b in chain]), [b.parent for b in chain]


def test_planted_blocks_are_never_read_back_and_own_blocks_are(tmp_path) -> None:  # noqa: ANN001
    honest, parents = _blocks(0)
    planted = KVBlocks(torch.zeros_like(honest.k[:, 2:]), torch.zeros_like(honest.v[:, 2:]), hashes=honest.hashes[2:])

    async def go(url: str) -> None:
        # A CPU tier of two blocks over a disk tier that takes every evicted block: the MAC survives the disk.
        store = TieredStore(CPUTier(2 * 2 * honest.k[:, 0].nbytes), DiskTier(tmp_path / "d", 1 << 20), disk_min_uses=0)
        service = KVStoreService(store)
        await service.start(await bus.connect(url))
        attacker_nc, worker_nc = await bus.connect(url), await bus.connect(url)
        try:
            attacker = KVStoreClient(attacker_nc)  # no key: it cannot MAC
            worker = KVStoreClient(worker_nc, key=mac_key("the mesh's secret"))
            await attacker.put(planted, parents[2:])
            await worker.put(honest, parents)  # blocks 2 and 3 are already held: the planted ones stay
            got = await worker.get_chain(honest.hashes)
            assert got is not None and got.num_blocks == 2, "the worker read the planted blocks"
            assert torch.equal(got.k.view(torch.uint8), honest.k[:, :2].view(torch.uint8))
            assert worker.rejected == 2
            # A worker of another mesh (another secret) cannot use this mesh's blocks either.
            other = KVStoreClient(worker_nc, key=mac_key("another mesh"))
            assert await other.get_chain(honest.hashes) is None
            # The worker's own blocks come back bit-exactly after going through the disk tier.
            mine, mine_parents = _blocks(20)
            await worker.put(mine, mine_parents)
            await worker.put(*_blocks(40))  # pushes the earlier blocks out of the CPU tier, onto the disk
            assert store.disk is not None and store.disk.stats().blocks >= 4
            again = await worker.get_chain(mine.hashes)
            assert again is not None and again.num_blocks == 4
            assert torch.equal(again.k.view(torch.uint8), mine.k.view(torch.uint8))
            assert torch.equal(again.v.view(torch.uint8), mine.v.view(torch.uint8))
        finally:
            await service.drain(1.0)
            await attacker_nc.close()
            await worker_nc.close()

    with NatsServer(workdir=tmp_path) as nats:
        asyncio.run(go(nats.url))
