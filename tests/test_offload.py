"""The offloader: big batches go to the kvstore as several puts under a size bound, at a bounded pace
(puts and bytes in flight), what waits is queued up to a byte cap, and backpressure past that drops
(and counts) offloads, never blocking."""
from __future__ import annotations

import asyncio

import torch

from shared.engine.offload import OffloadBatch, Offloader
from shared.kv_blocks import KVBlocks


class Store:
    def __init__(self) -> None:
        self.puts: list[int] = []
        self.release = asyncio.Event()

    def needs_offload(self, block_hash: bytes) -> bool:
        return True

    async def put(self, blocks: KVBlocks, parents: list[bytes | None]) -> None:
        assert blocks.num_blocks == len(blocks.hashes) == len(parents)
        self.puts.append(blocks.num_blocks)
        await self.release.wait()


def blocks(n: int) -> OffloadBatch:
    """n blocks of 128 bytes each (K and V: 2 layers x 4 tokens x 1 head x 2 dims of float32)."""
    k = torch.zeros(2, n, 4, 1, 2)
    return OffloadBatch(KVBlocks(k, k.clone(), hashes=[bytes([i]) * 16 for i in range(n)]), [None] * n)


def test_big_batches_split_and_backpressure_drops() -> None:
    async def go() -> None:
        store = Store()
        batch = blocks(10)
        off = Offloader(store, max_in_flight=3, max_put_bytes=3 * 128, max_queued_bytes=0)
        off.submit(batch)
        await asyncio.sleep(0)
        assert store.puts == [3, 3, 3]  # three puts in flight, no room to queue: the last block dropped
        assert (off.submitted, off.dropped) == (9, 1)
        store.release.set()
        await off.flush(1.0)

    asyncio.run(go())


def test_send_all_waits_for_room_instead_of_dropping() -> None:
    async def go() -> None:
        store = Store()
        batch = blocks(10)
        off = Offloader(store, max_in_flight=2, max_put_bytes=3 * 128)
        sending = asyncio.ensure_future(off.send_all(batch, timeout=5.0))
        await asyncio.sleep(0.05)
        assert store.puts == [3, 3]  # two in flight; the rest waits, nothing dropped
        store.release.set()
        await sending
        await off.flush(1.0)
        assert store.puts == [3, 3, 3, 1] and (off.submitted, off.dropped) == (10, 0)

    asyncio.run(go())


def test_bytes_in_flight_are_bounded_too() -> None:
    """However many puts may be under way, their bytes are bounded: nats-server drops a client (the
    kvstore) with more than 64 MiB waiting for it, which four 32 MiB puts of a leaving worker did."""
    async def go() -> None:
        store = Store()
        batch = blocks(10)
        off = Offloader(store, max_in_flight=10, max_put_bytes=3 * 128, max_in_flight_bytes=6 * 128,
                        max_queued_bytes=3 * 128)
        off.submit(batch)
        await asyncio.sleep(0)
        # Two puts fill the bytes in flight, the third waits in the queue, the fourth finds it full.
        assert store.puts == [3, 3] and (off.submitted, off.dropped) == (6, 1)
        store.release.set()
        await off.flush(1.0)
        assert store.puts == [3, 3, 3] and (off.submitted, off.dropped) == (9, 1)
        store.puts, store.release = [], asyncio.Event()
        sending = asyncio.ensure_future(off.send_all(batch, timeout=5.0))
        await asyncio.sleep(0.05)
        assert store.puts == [3, 3]  # the rest waits for bytes to come back
        store.release.set()
        await sending
        await off.flush(1.0)
        assert store.puts == [3, 3, 3, 1] and off.dropped == 1

    asyncio.run(go())


def test_queued_puts_go_as_room_frees_up() -> None:
    async def go() -> None:
        store = Store()
        batch = blocks(10)
        off = Offloader(store, max_in_flight=1, max_put_bytes=3 * 128)
        off.submit(batch)
        await asyncio.sleep(0)
        assert store.puts == [3] and off.dropped == 0  # one at a time, the rest queued, none dropped
        store.release.set()
        await off.flush(1.0)
        assert store.puts == [3, 3, 3, 1] and (off.submitted, off.dropped) == (10, 0)

    asyncio.run(go())


def test_a_leaving_worker_abandons_puts_past_its_grace() -> None:
    async def go() -> None:
        store = Store()  # never answers
        off = Offloader(store, max_in_flight=1, max_put_bytes=2 * 128)  # 128 bytes per block: two puts
        off.submit(blocks(4))
        await off.flush(0.05)
        assert store.puts == [2]  # one under way, one queued
        await off.abandon()
        assert off.dropped == 4 and not off._tasks and store.puts == [2]

    asyncio.run(go())
