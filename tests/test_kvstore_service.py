"""The kvstore against a real nats-server: longest chains, LRU by bytes, hit rate, exact bytes, hostility."""
from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import pytest
import torch
from nats.aio.client import Client

from services.kvstore.cpu_tier import CPUTier
from services.kvstore.service import KVStoreService, parse_bytes
from shared import bus, subjects, wire
from shared import protocol as p
from shared.block_hash import hash_blocks, root_hash
from shared.bus import headers as H
from shared.wire import tensor_from_wire, tensor_to_wire
from tests.nats_fixtures import wait_discoverable, nats_server, nats_server_factory  # noqa: F401  (fixtures)

T = TypeVar("T")
PUT, GET, CONTAINS, STATS = subjects.KVSTORE_PUT, subjects.KVSTORE_GET, subjects.KVSTORE_CONTAINS, subjects.KVSTORE_STATS
REPO = Path(__file__).resolve().parents[1]
SHAPE = (2, 16, 2, 8)  # [num_layers, block_size, num_kv_heads, head_dim]


def run(coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def chain(n: int, salt: str = "") -> list[bytes]:
    return hash_blocks(root_hash("test-model", 16, "float32", salt), list(range(n * 16)), 16)


def block(h: bytes, parent: bytes | None = None, dtype: torch.dtype = torch.float32, shape: tuple[int, ...] = SHAPE) -> p.StoredBlock:
    g = torch.Generator().manual_seed(int.from_bytes(h[:4], "little"))
    k, v = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    return p.StoredBlock(hash=h, parent=parent, k=tensor_to_wire(k), v=tensor_to_wire(v))


def blocks_of(hashes: list[bytes], **kw: Any) -> list[p.StoredBlock]:
    return [block(h, hashes[i - 1] if i else None, **kw) for i, h in enumerate(hashes)]


BLOCK_BYTES = 2 * 4 * torch.Size(SHAPE).numel()  # k + v, float32


@asynccontextmanager
async def serving(url: str, capacity: int = 1 << 30) -> AsyncIterator[tuple[Client, KVStoreService]]:
    nc, client = await bus.connect(url), await bus.connect(url)
    svc = KVStoreService(CPUTier(capacity))
    await svc.start(nc)
    await wait_discoverable(client, subjects.SERVICE_KVSTORE)
    try:
        yield client, svc
    finally:
        await client.close()
        await svc.drain(1.0)
        await nc.close()


async def put(nc: Client, blocks: list[p.StoredBlock]) -> int:
    return (await bus.request(nc, PUT, p.PutRequest(blocks=blocks), expect=p.PutReply)).num_stored


async def get(nc: Client, hashes: list[bytes], max_blocks: int | None = None) -> list[p.StoredBlock]:
    return (await bus.request(nc, GET, p.GetRequest(hashes=hashes, max_blocks=max_blocks), expect=p.GetReply)).blocks


async def contains(nc: Client, hashes: list[bytes]) -> int:
    return (await bus.request(nc, CONTAINS, p.ContainsRequest(hashes=hashes), expect=p.ContainsReply)).num_prefix_blocks


async def stats(nc: Client) -> p.StatsReply:
    return await bus.request(nc, STATS, p.StatsRequest(), expect=p.StatsReply)


def test_get_returns_the_longest_held_prefix(nats_server: str) -> None:
    hashes = chain(8)
    held = blocks_of(hashes[:6])

    async def body() -> None:
        async with serving(nats_server) as (nc, _):
            assert await put(nc, held) == 6
            assert await put(nc, held[:2]) == 2  # already held: counted, not duplicated
            assert await get(nc, hashes) == held
            assert await get(nc, hashes, max_blocks=3) == held[:3]
            assert await get(nc, hashes, max_blocks=0) == []
            assert await get(nc, chain(3, salt="other tenant")) == []
            assert await contains(nc, hashes) == 6
            # A gap in the middle: only the prefix before it is usable.
            gapped = chain(5, salt="gap")
            gapped_blocks = blocks_of(gapped)
            await put(nc, gapped_blocks[:2] + gapped_blocks[3:])
            assert await get(nc, gapped) == gapped_blocks[:2]
            assert await contains(nc, gapped) == 2
            assert await contains(nc, gapped[3:]) == 2  # the tail is held, just not reachable from the head
            s = await stats(nc)
            assert (s.cpu_blocks, s.cpu_bytes, s.disk_blocks) == (10, 10 * BLOCK_BYTES, 0)

    run(body())


def test_lru_eviction_under_a_tiny_byte_capacity(nats_server: str) -> None:
    a, b, c, d = (blocks_of(chain(1, salt=s))[0] for s in "abcd")

    async def body() -> None:
        async with serving(nats_server, capacity=3 * BLOCK_BYTES) as (nc, _):
            for blk in (a, b, c):
                assert await put(nc, [blk]) == 1
            assert await get(nc, [a.hash]) == [a]  # a is now the most recently used
            await put(nc, [d])  # evicts b, the least recently used
            assert [await contains(nc, [x.hash]) for x in (a, b, c, d)] == [1, 0, 1, 1]
            assert (await stats(nc)).cpu_bytes == 3 * BLOCK_BYTES
            # A chain longer than the capacity keeps its head: the tail is evicted first.
            long = chain(5, salt="long")
            assert await put(nc, blocks_of(long)) == 3
            assert await contains(nc, long) == 3
            assert [x.hash for x in await get(nc, long)] == long[:3]
            # A block bigger than the whole store is refused, and evicts nothing.
            huge = block(chain(1, salt="huge")[0], shape=(8, 16, 2, 8))  # 4 blocks' worth
            assert await put(nc, [huge]) == 0
            assert await contains(nc, long) == 3

    run(body())


def test_stats_report_the_hit_rate(nats_server: str) -> None:
    hashes = chain(4)

    async def body() -> None:
        async with serving(nats_server) as (nc, _):
            assert (await stats(nc)).hit_rate == 0.0
            await put(nc, blocks_of(hashes[:3]))
            await get(nc, hashes)  # 3 hits, 1 miss
            await get(nc, hashes, max_blocks=2)  # 2 hits
            await get(nc, chain(2, salt="cold"))  # 2 misses
            await contains(nc, hashes)  # a probe: not counted
            s = await stats(nc)
            assert (s.hits, s.misses) == (5, 3) and s.hit_rate == pytest.approx(5 / 8)

    run(body())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_blocks_round_trip_bit_exactly(nats_server_factory: Callable[..., str], dtype: torch.dtype) -> None:
    url = nats_server_factory(max_payload=64 * 1024)  # 40 blocks of 16-32 KiB: the put and the get are chunked
    hashes = chain(40, salt=str(dtype))
    sent = blocks_of(hashes, dtype=dtype, shape=(4, 16, 4, 32))
    special = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 1e-40], dtype=dtype)
    k = tensor_from_wire(sent[0].k).reshape(-1)
    k[: special.numel()] = special
    sent[0] = sent[0].model_copy(update={"k": tensor_to_wire(k.reshape(4, 16, 4, 32))})

    async def body() -> None:
        async with serving(url) as (nc, _):
            assert await put(nc, sent) == 40
            got = await get(nc, hashes)
            assert [g.hash for g in got] == hashes and [g.parent for g in got] == [None, *hashes[:-1]]
            for s, g in zip(sent, got):
                assert g.k.dtype == str(dtype).removeprefix("torch.") and g.k.data == s.k.data and g.v.data == s.v.data
                gk = tensor_from_wire(g.k)
                assert gk.dtype == dtype and gk.shape == (4, 16, 4, 32)
            int_view = torch.int16 if dtype == torch.bfloat16 else torch.int32
            assert torch.equal(tensor_from_wire(got[0].k).view(int_view), tensor_from_wire(sent[0].k).view(int_view))

    run(body())


def test_bad_requests_store_nothing_and_service_keeps_serving(nats_server: str) -> None:
    good = blocks_of(chain(2))
    mismatched = good[1].model_copy(update={"v": tensor_to_wire(torch.zeros(SHAPE, dtype=torch.bfloat16))})
    short_hash = good[1].model_copy(update={"hash": b"short"})

    async def body() -> None:
        async with serving(nats_server) as (nc, _):
            bad = [(good[:1] + [mismatched], "block 1: k is float32"), (good[:1] + [short_hash], "block 1: hash is 5 bytes")]
            for blocks, text in bad:
                with pytest.raises(bus.RemoteError) as e:
                    await put(nc, blocks)
                assert e.value.code == "bad_request" and text in e.value.message
            with pytest.raises(bus.RemoteError, match="max_blocks"):
                await get(nc, [good[0].hash], max_blocks=-1)
            assert (await stats(nc)).cpu_blocks == 0  # the good first block of each bad put was not stored
            assert await put(nc, good) == 2

    run(body())


def test_hostile_messages_leave_the_service_answering(nats_server: str) -> None:
    blk = blocks_of(chain(1))[0]
    bad_tensor = {"dtype": "float32", "shape": [4], "data": b"\x00" * 3}
    valid: dict[str, wire.Message] = {
        PUT: p.PutRequest(blocks=[blk]),
        GET: p.GetRequest(hashes=chain(3)),
        CONTAINS: p.ContainsRequest(hashes=chain(3)),
        STATS: p.StatsRequest(),
    }

    async def body() -> None:
        async with serving(nats_server) as (nc, _):
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox)
            for subject, msg in valid.items():
                encoded = wire.encode(msg)
                hostile = [
                    pickle.dumps(msg.model_dump()),
                    msgpack.packb({"kind": msg.KIND, "version": 1, "hashes": [msgpack.ExtType(3, b"\x00" * 16)]}),
                    encoded[: max(len(encoded) // 2, 1)] if len(encoded) > 1 else b"\x85",
                    msgpack.packb({"kind": msg.KIND, "version": "one"}),
                    msgpack.packb({"kind": "tokenizer.encode", "version": 1, "prompt": "wrong service"}),
                ]
                if subject != STATS:  # a stats request has no fields to get wrong (unknown ones are ignored)
                    hostile.append(msgpack.packb({"kind": msg.KIND, "version": 1, "hashes": "nope",
                                                  "blocks": [{"hash": b"h" * 16, "k": bad_tensor, "v": bad_tensor}]}))
                for data in hostile:
                    await nc.publish(subject, data, reply=inbox)
                    await nc.publish(subject, data)
                await nc.publish(subject, b"\x81", reply=inbox, headers={H.CHUNK: "0/2", H.MSG_ID: subject, H.SIZE: "2"})
                errors = [wire.decode((await sub.next_msg(timeout=5)).data, p.ErrorReply) for _ in hostile]
                assert {e.code for e in errors} == {"bad_request"}, (subject, errors)
            assert await put(nc, [blk]) == 1
            assert await get(nc, [blk.hash]) == [blk]
            assert (await stats(nc)).cpu_blocks == 1

    run(body())


def test_discovery_and_parse_bytes(nats_server: str) -> None:
    assert parse_bytes("2GiB") == parse_bytes("2G") == parse_bytes(str(2 << 30)) == 2 << 30
    assert parse_bytes("512MiB") == 512 << 20

    async def body() -> None:
        async with serving(nats_server, capacity=12345) as (nc, svc):
            ping = json.loads((await nc.request(f"$SRV.PING.{subjects.SERVICE_KVSTORE}", b"", timeout=2)).data)
            assert ping["id"] == svc._micro.id  # type: ignore[union-attr]
            info = json.loads((await nc.request(f"$SRV.INFO.{subjects.SERVICE_KVSTORE}", b"", timeout=2)).data)
            assert info["metadata"]["capacity_bytes"] == "12345"
            endpoints = {(e["subject"], e["queue_group"]) for e in info["endpoints"]}
            assert endpoints == {(s, subjects.QUEUE_KVSTORE) for s in (PUT, GET, CONTAINS, STATS)}

    run(body())


def test_subprocess_serves_and_exits_0_on_sigterm(nats_server: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.kvstore", "--nats-url", nats_server, "--capacity-bytes", "1MiB",
         "--log-level", "WARNING"],
        cwd=REPO, env={**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": ""},
    )
    try:
        async def ask() -> p.StatsReply:
            nc = await bus.connect(nats_server)
            try:
                deadline = time.monotonic() + 25
                while True:
                    try:
                        await put(nc, blocks_of(chain(2)))
                        await get(nc, chain(3))
                        return await stats(nc)
                    except bus.NoRespondersError:
                        assert proc.poll() is None and time.monotonic() < deadline, "service did not start"
                        await asyncio.sleep(0.1)
            finally:
                await nc.close()

        s = run(ask())
        assert (s.cpu_blocks, s.hits, s.misses) == (2, 2, 1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=8) == 0  # the drain takes milliseconds; exiting a torch process can take seconds
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
