"""The direct KV listener as another local process sees it: anyone on the host can connect. A stranger that
connects and says nothing, or opens connection after connection, must neither hold the listener's
connections for ever nor keep the real sender (a prefill worker) out; a real DirectSender still moves
blocks bit-exactly afterwards."""
from __future__ import annotations

import asyncio
import socket

import torch

from shared.kv_blocks import KVBlocks
from shared.kv_transport.direct import DirectSender, DirectServer, DirectSettings
from shared.kv_transport.incoming import TransferRegistry
from tests.test_kv_data_plane import kv, sink

GUARDED = DirectSettings(frame_bytes=4 << 10, slots=3, handshake_timeout_s=0.5, max_connections=8)


async def _stranger(port: int) -> socket.socket:
    loop = asyncio.get_running_loop()
    s = socket.socket()
    s.setblocking(False)
    await loop.sock_connect(s, ("127.0.0.1", port))
    return s


async def _closed_by_peer(s: socket.socket, within: float) -> bool:
    loop = asyncio.get_running_loop()
    try:
        return await asyncio.wait_for(loop.sock_recv(s, 1), within) == b""
    except ConnectionResetError:
        return True
    except asyncio.TimeoutError:
        return False


def test_silent_and_crowding_strangers_are_dropped_and_the_real_sender_gets_through() -> None:
    async def go() -> None:
        registry = TransferRegistry()
        server = DirectServer(registry, "127.0.0.1", 0, GUARDED)
        await server.start()
        sender = DirectSender(DirectSettings(frame_bytes=4 << 10, slots=3))
        strangers: list[socket.socket] = []
        try:
            # One says nothing: the listener hangs up after the handshake timeout.
            silent = await _stranger(server.port)
            strangers.append(silent)
            assert await _closed_by_peer(silent, 5.0), "a silent connection is held for ever"
            # Three times the cap of connections at once: never more than the cap held.
            for _ in range(3 * GUARDED.max_connections):
                strangers.append(await _stranger(server.port))
            await asyncio.sleep(0.2)
            assert len(server._conns) <= GUARDED.max_connections
            assert server.refused_connections >= 2 * GUARDED.max_connections
            # The real sender connects while the strangers crowd the listener, and its transfer lands.
            for i in range(2):  # the second time, its connection has proved itself: later strangers cannot evict it
                k, v = kv(torch.bfloat16, seed=i)
                dk, dv, write, _ = sink(k)
                done = registry.expect(f"t{i}", k.shape[1], write, 10.0, b"token-0123456789")
                await sender.send(server.endpoint, b"token-0123456789", f"t{i}", KVBlocks(k, v), 10.0)
                await asyncio.wait_for(done, 5)
                assert torch.equal(dk.view(torch.uint8), k.view(torch.uint8))
                assert torch.equal(dv.view(torch.uint8), v.view(torch.uint8))
                for _ in range(2 * GUARDED.max_connections):
                    strangers.append(await _stranger(server.port))
                await asyncio.sleep(0.2)
                assert len(server._conns) <= GUARDED.max_connections
        finally:
            for s in strangers:
                s.close()
            await sender.close()
            await server.stop()

    asyncio.run(go())
