"""The KV data plane (issue 10 item 1): shared memory on one host, TCP between hosts, NATS as the
fallback. Each path moves blocks bit-exactly; a stranger's frames are refused; a transfer cut off
halfway fails cleanly on both sides; an unreachable endpoint falls back to NATS."""
from __future__ import annotations

import asyncio
import contextlib
import os
import secrets

import pytest
import torch

from shared import bus
from shared.kv_blocks import KVBlocks
from shared.kv_transport import MeshKVTransport, TransferError
from shared.kv_transport import shm_ring
from shared.kv_transport.direct import DirectSender, DirectServer, DirectSettings, DirectUnavailable
from shared.kv_transport.incoming import TransferRegistry
from shared.bus.natsd import free_port
from tests.nats_fixtures import nats_server  # noqa: F401

SMALL = DirectSettings(frame_bytes=4 << 10, slots=3)  # many frames per transfer, few slots: pipelining


def kv(dtype: torch.dtype, layers: int = 4, blocks: int = 10, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (layers, blocks, 16, 2, 8)
    return (torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))


def sink(k: torch.Tensor, first_block: int = 0):  # noqa: ANN201
    """Where a receiver writes: zeroed K, V of the transfer's shape, and the writer that fills them."""
    dk, dv = torch.zeros_like(k), torch.zeros_like(k)
    dk = torch.cat([torch.zeros_like(k[:, :first_block]), dk], dim=1) if first_block else dk
    dv = torch.cat([torch.zeros_like(k[:, :first_block]), dv], dim=1) if first_block else dv
    writes = []

    async def write(b: KVBlocks) -> None:
        dk[b.first_layer:b.first_layer + b.num_layers, b.first_block:b.end_block] = b.k
        dv[b.first_layer:b.first_layer + b.num_layers, b.first_block:b.end_block] = b.v
        writes.append((b.first_block, b.first_layer))

    return dk, dv, write, writes


@contextlib.asynccontextmanager
async def channel(sender_settings: DirectSettings = SMALL):  # noqa: ANN201
    """A registry, a DirectServer on the loopback feeding it, and a sender: stopped afterwards."""
    registry = TransferRegistry()
    server = DirectServer(registry, "127.0.0.1", 0, SMALL)
    await server.start()
    sender = DirectSender(sender_settings)
    try:
        yield registry, server, sender
    finally:
        await sender.close()
        await server.stop()


@contextlib.asynccontextmanager
async def mesh_transports(url: str):  # noqa: ANN201
    """A receiving MeshKVTransport (worker "d0", direct endpoint on the loopback) and a sending one, each
    on its own connection to a real nats-server: stopped and closed afterwards."""
    nc_recv, nc_send = await bus.connect(url), await bus.connect(url)
    receiver, sender = MeshKVTransport(nc_recv, settings=SMALL), MeshKVTransport(nc_send, settings=SMALL)
    await receiver.start("d0")
    await sender.start(None)
    try:
        yield receiver, sender
    finally:
        await sender.stop()
        await receiver.stop()
        await nc_send.close()
        await nc_recv.close()


@pytest.mark.parametrize("path", ["shm", "tcp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_each_direct_path_moves_blocks_bit_exactly(path: str, dtype: torch.dtype) -> None:
    if path == "shm" and not shm_ring.available():
        pytest.skip("no /dev/shm")

    async def go() -> None:
        settings = DirectSettings(frame_bytes=SMALL.frame_bytes, slots=SMALL.slots, shared_memory=path == "shm")
        async with channel(settings) as (registry, server, sender):
            # Two transfers on one connection, the second after a cached prefix and with other bytes (the
            # receiver reuses its frame buffers and ring slots: nothing of the first may show through).
            for first_block in (0, 3):
                k, v = kv(dtype, seed=first_block)
                dk, dv, write, writes = sink(k, first_block)
                token = secrets.token_bytes(16)
                done = registry.expect(f"t{first_block}", first_block + k.shape[1], write, 10.0, token)
                sent = await sender.send(server.endpoint, token, f"t{first_block}", KVBlocks(k, v, first_block), 10.0)
                await asyncio.wait_for(done, 5)
                assert sent == 2 * k.numel() * k.element_size()
                assert torch.equal(dk[:, first_block:].view(torch.uint8), k.view(torch.uint8))
                assert torch.equal(dv[:, first_block:].view(torch.uint8), v.view(torch.uint8))
                assert len(writes) > SMALL.slots  # pipelined over more frames than slots
            assert (server.shm_frames > 0) == (path == "shm") and server.frames > 0
            assert sender.uses_shared_memory(server.endpoint) == (path == "shm")
            assert not [p for p in os.listdir("/dev/shm") if p.startswith(shm_ring.PREFIX)] if path == "shm" else True

    asyncio.run(go())


def test_a_strangers_frames_are_refused_and_the_transfer_goes_on() -> None:
    async def go() -> None:
        async with channel() as (registry, server, sender):
            k, v = kv(torch.float32)
            dk, dv, write, _ = sink(k)
            done = registry.expect("t", k.shape[1], write, 10.0, token=b"right-token-0123")
            with pytest.raises(TransferError, match="wrong transfer token"):
                await sender.send(server.endpoint, b"wrong-token-0123", "t", KVBlocks(k, v), 5.0)
            with pytest.raises(TransferError, match="unknown transfer"):
                await sender.send(server.endpoint, b"right-token-0123", "nobody", KVBlocks(k, v), 5.0)
            assert not done.done()  # neither could end the real transfer
            await sender.send(server.endpoint, b"right-token-0123", "t", KVBlocks(k, v), 5.0)
            await asyncio.wait_for(done, 5)
            assert torch.equal(dk, k) and torch.equal(dv, v)
            # A frame past the reserved blocks ends the transfer it names.
            done = registry.expect("short", 2, write, 10.0, token=b"tok")
            with pytest.raises(TransferError, match="only 2 were reserved"):
                await sender.send(server.endpoint, b"tok", "short", KVBlocks(k, v), 5.0)
            with pytest.raises(TransferError):
                await done

    asyncio.run(go())


def test_a_transfer_cut_off_halfway_fails_on_both_sides() -> None:
    async def go() -> None:
        registry = TransferRegistry()
        server = DirectServer(registry, "127.0.0.1", 0, SMALL)
        await server.start()
        sender = DirectSender(SMALL)
        k, v = kv(torch.float32)
        calls = [0]
        stopping: list[asyncio.Task] = []

        async def write(b: KVBlocks) -> None:
            calls[0] += 1
            if calls[0] == 2:  # the receiving process goes away in the middle of the transfer
                stopping.append(asyncio.ensure_future(server.stop()))
                await asyncio.sleep(0.5)

        done = registry.expect("t", k.shape[1], write, 10.0, token=b"tok")
        with pytest.raises(TransferError):
            await sender.send(server.endpoint, b"tok", "t", KVBlocks(k, v), 5.0)
        await asyncio.gather(*stopping)
        registry.fail_all("receiver stopped")  # what the decode worker's transport does when it stops
        with pytest.raises(TransferError):
            await done
        await sender.close()

    asyncio.run(go())


def test_an_unreachable_endpoint_is_unavailable() -> None:
    async def go() -> None:
        sender = DirectSender(SMALL, connect_timeout_s=1.0)
        k, v = kv(torch.float32)
        with pytest.raises(DirectUnavailable):
            await sender.send(f"tcp://127.0.0.1:{free_port()}", b"tok", "t", KVBlocks(k, v), 5.0)
        with pytest.raises(DirectUnavailable):
            await sender.send("http://nowhere", b"tok", "t", KVBlocks(k, v), 5.0)

    asyncio.run(go())


def test_the_mesh_transport_goes_direct_and_falls_back_to_nats(nats_server) -> None:  # noqa: F811
    async def go() -> None:
        async with mesh_transports(nats_server) as (receiver, sender):
            assert receiver.endpoint is not None and receiver.endpoint.startswith("tcp://127.0.0.1:")
            assert sender.endpoint is None
            for endpoint, expect_direct in ((receiver.endpoint, 1), (f"tcp://127.0.0.1:{free_port()}", 1)):
                k, v = kv(torch.bfloat16)
                dk, dv, write, _ = sink(k)
                token = secrets.token_bytes(16)
                done = receiver.expect("t" + endpoint, k.shape[1], write, 10.0, token=token)
                await sender.send("d0", "t" + endpoint, KVBlocks(k, v), 10.0, endpoint=endpoint, token=token)
                await asyncio.wait_for(done, 5)
                assert torch.equal(dk.view(torch.uint8), k.view(torch.uint8))
                assert torch.equal(dv.view(torch.uint8), v.view(torch.uint8))
            assert sender.direct_sends == 1 and sender.fallbacks == 1

    asyncio.run(go())


@pytest.mark.parametrize("reachable", [True, False], ids=["direct", "nats"])
def test_a_transfer_in_pieces_lands_while_later_pieces_are_computed(nats_server, reachable) -> None:  # noqa: F811
    """A prefill hands its KV over chunk by chunk: each piece is written at the receiver before the
    next one is even handed over (what lets the push overlap the compute), frames are numbered across
    pieces and only the last says how many; with the endpoint out of reach the pieces wait and go
    over NATS together at the end."""
    async def go() -> None:
        async with mesh_transports(nats_server) as (receiver, sender):
            k, v = kv(torch.float32, blocks=10, seed=5)
            dk, dv, write, writes = sink(k, first_block=2)
            token = secrets.token_bytes(16)
            done = receiver.expect("t", 12, write, 10.0, token=token)
            endpoint = receiver.endpoint if reachable else f"tcp://127.0.0.1:{free_port()}"
            tx = sender.open_transfer("d0", "t", 10.0, endpoint=endpoint, token=token)
            for b0, b1 in ((0, 3), (3, 7)):  # blocks 2..4, then 5..8 of the request
                tx.push(KVBlocks(k[:, b0:b1], v[:, b0:b1], 2 + b0))
                if reachable:  # written before the next piece exists
                    await asyncio.wait_for(_until(lambda: torch.equal(dk[:, 2 + b0:2 + b1], k[:, b0:b1])), 5)
                else:
                    await asyncio.sleep(0.05)
                    assert not writes  # kept for the bus
                assert not done.done()
            sent = await tx.finish(KVBlocks(k[:, 7:], v[:, 7:], 9))
            await asyncio.wait_for(done, 5)
            assert sent == 2 * k.numel() * k.element_size()
            assert torch.equal(dk[:, 2:], k) and torch.equal(dv[:, 2:], v)
            assert (sender.direct_sends, sender.fallbacks) == ((1, 0) if reachable else (0, 1))
            assert tx.went_direct is reachable

    asyncio.run(go())


def test_a_frame_numbered_past_the_known_total_is_refused() -> None:
    async def go() -> None:
        registry = TransferRegistry()
        k, v = kv(torch.float32, blocks=2)
        _, _, write, _ = sink(k)
        done = registry.expect("t", 2, write, 10.0, token=b"tok")
        inc, err = registry.check("t", 0, 0, 1)  # a piece before the total is known
        assert err is None
        assert await registry.accept("t", inc, 0, 0, KVBlocks(k[:, :1], v[:, :1], 0)) is None
        assert not done.done()
        inc, err = registry.check("t", 1, 2, 2)  # the last frame says there are two
        assert await registry.accept("t", inc, 1, 2, KVBlocks(k[:, 1:], v[:, 1:], 1)) is None
        await asyncio.wait_for(done, 1)
        registry.expect("u", 2, write, 10.0)
        inc, _ = registry.check("u", 0, 1, 1)
        await registry.accept("u", inc, 0, 1, KVBlocks(k[:, :1], v[:, :1], 0))
        assert registry.check("u", 3, 0, 2) == (None, "unknown transfer")  # complete: gone
        registry.expect("w", 2, write, 10.0)
        inc, _ = registry.check("w", 1, 2, 1)
        await registry.accept("w", inc, 1, 2, KVBlocks(k[:, :1], v[:, :1], 0))
        assert registry.check("w", 2, 0, 2)[1] == "chunk 2 of 2"  # past the total a final frame gave
        assert registry.check("w", 0, 3, 2)[1] == "chunk count changed mid-transfer"

    asyncio.run(go())


async def _until(cond) -> None:  # noqa: ANN001
    while not cond():
        await asyncio.sleep(0.005)
