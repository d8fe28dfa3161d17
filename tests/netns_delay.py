"""A slow link without netem (this machine's kernel has none): a userspace TCP relay that holds every chunk it
forwards for a fixed delay, each way, order kept, throughput not limited.

Run on a host (`ip netns exec`): `python -m tests.netns_delay LISTEN_HOST LISTEN_PORT TARGET_HOST TARGET_PORT
DELAY_MS`; it prints RELAY_READY once listening. Placed on a host's connection to the rest of the mesh (its
nats-server's route to the first host: tests/test_multihost_slow_link.py), every message between that host and
the others arrives DELAY_MS later, as on a link with that one-way latency.
"""
from __future__ import annotations

import asyncio
import contextlib
import sys

RELAY_READY = "RELAY_READY"


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    loop = asyncio.get_running_loop()
    held: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def take() -> None:
        while data := await reader.read(1 << 16):
            held.put_nowait((loop.time() + delay_s, data))
        held.put_nowait((loop.time() + delay_s, b""))

    async def give() -> None:
        while True:
            due, data = await held.get()
            if (wait := due - loop.time()) > 0:
                await asyncio.sleep(wait)
            if not data:
                return
            writer.write(data)
            await writer.drain()

    try:
        await asyncio.gather(take(), give())
    finally:
        writer.close()


async def main(listen_host: str, listen_port: int, target_host: str, target_port: int, delay_s: float) -> None:
    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(target_host, target_port)
        except OSError:
            writer.close()
            return
        with contextlib.suppress(OSError):
            await asyncio.gather(_pump(reader, up_writer, delay_s), _pump(up_reader, writer, delay_s))

    server = await asyncio.start_server(relay, listen_host, listen_port)
    print(RELAY_READY, flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    host, port, target, target_port, delay_ms = sys.argv[1:6]
    asyncio.run(main(host, int(port), target, int(target_port), float(delay_ms) / 1000))
