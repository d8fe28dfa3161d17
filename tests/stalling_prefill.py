"""A network test double: a process that registers as a prefill worker, takes remote prefill requests
and never answers (the way a worker stuck in a kernel or a dead host looks from the bus).

    python -m tests.stalling_prefill NATS_URL
"""
from __future__ import annotations

import asyncio
import sys

from shared import bus, subjects
from shared.protocol.prefill import RemotePrefillRequest


async def main(url: str) -> None:
    nc = await bus.connect(url, name="stalling-prefill")

    async def stall(req: RemotePrefillRequest, ctx: bus.RequestContext) -> None:
        await asyncio.Event().wait()

    await bus.add_micro_service(nc, subjects.SERVICE_PREFILL, "0.0.0", [
        bus.Endpoint("prefill", subjects.PREFILL_PREFILL, subjects.QUEUE_PREFILL, stall, RemotePrefillRequest)])
    await nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
