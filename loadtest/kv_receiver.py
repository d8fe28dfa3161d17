"""The receiving end of `kvmesh bench kv-transfer`'s two-process runs: a DirectServer in its own process
(as a decode worker is), writing every frame into a preallocated KV buffer, so the sender's copies
and the receiver's run on different cores as they do in a mesh.

    python -m loadtest.kv_receiver --shape L,B,S,H,D --dtype float32 --transfers N --token HEX

prints `port <n>` once listening, accepts transfers t0..t{N-1} carrying that token, and exits when
its stdin closes.
"""
from __future__ import annotations

import argparse
import asyncio
import sys

import torch

from shared.kv_blocks import KVBlocks
from shared.kv_transport.direct import DirectServer
from shared.kv_transport.frames import DTYPES
from shared.kv_transport.incoming import TransferRegistry


async def serve(shape: list[int], dtype: torch.dtype, transfers: int, token: bytes) -> None:
    registry = TransferRegistry()
    dst_k, dst_v = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)

    async def write(b: KVBlocks) -> None:
        dst_k[b.first_layer:b.first_layer + b.num_layers, b.first_block:b.end_block].copy_(b.k)
        dst_v[b.first_layer:b.first_layer + b.num_layers, b.first_block:b.end_block].copy_(b.v)

    for i in range(transfers):
        registry.expect(f"t{i}", shape[1], write, 600.0, token)
    server = DirectServer(registry, "127.0.0.1")
    port = await server.start()
    print(f"port {port}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin
    await server.stop()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--transfers", type=int, required=True)
    p.add_argument("--token", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)  # one core each: the sender has the other (a 2-core machine otherwise oversubscribes)
    asyncio.run(serve([int(x) for x in a.shape.split(",")], DTYPES[a.dtype], a.transfers, bytes.fromhex(a.token)))


if __name__ == "__main__":
    main()
