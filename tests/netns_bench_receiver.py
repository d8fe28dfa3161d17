"""The receiving host of tests/netns_bench.py: a DirectServer on this host's address writing every frame into a
preallocated KV buffer, as a decode worker does.

    python -m tests.netns_bench_receiver ADDRESS L,B,S,H,D TRANSFERS TOKEN_HEX

prints `port <n>` once listening and exits when its stdin closes."""
from __future__ import annotations

import asyncio
import sys

import torch

from shared.kv_blocks import KVBlocks
from shared.kv_transport.direct import DirectServer
from shared.kv_transport.incoming import TransferRegistry


async def serve(address: str, shape: list[int], transfers: int, token: bytes) -> None:
    registry = TransferRegistry()
    dst_k, dst_v = torch.empty(shape, dtype=torch.bfloat16), torch.empty(shape, dtype=torch.bfloat16)

    async def write(b: KVBlocks) -> None:
        dst_k[b.first_layer:b.first_layer + b.num_layers, b.first_block:b.end_block].copy_(b.k)
        dst_v[b.first_layer:b.first_layer + b.num_layers, b.first_block:b.end_block].copy_(b.v)

    for i in range(transfers):
        registry.expect(f"t{i}", shape[1], write, 900.0, token)
    server = DirectServer(registry, address)
    port = await server.start()
    print(f"port {port}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop()


if __name__ == "__main__":
    torch.set_num_threads(1)
    asyncio.run(serve(sys.argv[1], [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3]),
                      bytes.fromhex(sys.argv[4])))
