"""One fetch per prefix: concurrent requests whose missing blocks share a prefix wait on one kvstore
fetch instead of each asking for (and moving) the same blocks. vLLM #44294 measured a 40% throughput
loss from such loads queueing behind each other.

A request joins an in-flight fetch when its chain starts with the same block hash; it takes the part of
that fetch's answer its own chain shares, and asks the kvstore for nothing more (blocks past the shared
part are computed, which is what they would have cost had the other request not existed).
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from shared.kv_blocks import KVBlocks


class PrefixFetches:
    def __init__(self, fetch: Callable[[list[bytes]], Awaitable[KVBlocks | None]]) -> None:
        self._fetch = fetch
        self._in_flight: dict[bytes, tuple[list[bytes], asyncio.Future[KVBlocks | None]]] = {}
        self.joined = 0  # fetches served by another request's fetch (a metric and a test hook)

    async def get(self, hashes: list[bytes]) -> KVBlocks | None:
        """The longest stored prefix of `hashes`, numbered from 0 (possibly shorter when joining another fetch)."""
        if not hashes:
            return None
        running = self._in_flight.get(hashes[0])
        if running is not None:
            theirs, fut = running
            self.joined += 1
            got = await asyncio.shield(fut)
            if got is None:
                return None
            common = next((i for i, (a, b) in enumerate(zip(theirs, hashes)) if a != b), min(len(theirs), len(hashes)))
            n = min(common, got.num_blocks)
            return got.blocks(0, n) if n else None
        fut: asyncio.Future[KVBlocks | None] = asyncio.get_running_loop().create_future()
        self._in_flight[hashes[0]] = (hashes, fut)
        try:
            got = await self._fetch(hashes)
            fut.set_result(got)
            return got
        except BaseException as e:
            fut.set_result(None)  # joiners compute instead; the fetcher sees its own error
            raise e
        finally:
            del self._in_flight[hashes[0]]
