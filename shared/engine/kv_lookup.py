"""The lookup chain of an engine's KV tiers, device -> host -> kvstore, for a request held for its prefix.

The device step is the block manager's (Reserve matched the prefix cache); this loads the rest of the
prompt's full blocks from the host tier (KVTiers.host_chain, any thread), then from the kvstore (one
fetch per shared prefix: shared/engine/prefix_fetch.py), writing each run into the held request's blocks on
the engine thread. A worker calls load() and nothing below it. Best effort: a miss or a kvstore that
is down costs a recompute.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from opentelemetry import trace

from shared.engine.commands import Command, WriteBlocks
from shared.engine.kv_tiers import KVTiers
from shared.engine.scheduler import Reservation
from shared.kv_blocks import KVBlocks
from shared.engine.prefix_fetch import PrefixFetches

_tracer = trace.get_tracer("kvmesh.worker")

RunCommand = Callable[[Command[Any]], Awaitable[Any]]  # EngineThread.run
Fetch = Callable[[list[bytes]], Awaitable[KVBlocks | None]]  # KVStoreClient.get_chain


class KVLookup:
    def __init__(self, tiers: KVTiers, run: RunCommand, block_size: int, fetch: Fetch | None) -> None:
        self.tiers = tiers
        self._run = run
        self.block_size = block_size
        self.fetches = PrefixFetches(fetch) if fetch is not None else None
        self.host_hit_tokens = 0  # prompt tokens loaded from the host tier
        self.kvstore_hit_tokens = 0  # prompt tokens loaded from the kvstore (prefix-cache hits beyond our own)

    async def load(self, rid: str, res: Reservation) -> int:
        """Write the longest run of a held request's uncached blocks found in the host tier, then in the
        kvstore; returns the request's cached tokens."""
        own = res.num_cached_tokens // self.block_size
        if len(res.block_hashes) > own:
            got = self.tiers.host_chain(res.block_hashes[own:], first_block=own)
            if got is not None:
                if not await self._run(WriteBlocks(rid, got)):  # cancelled meanwhile
                    return own * self.block_size
                self.host_hit_tokens += got.num_blocks * self.block_size
                own = got.end_block
        if self.fetches is None or len(res.block_hashes) <= own:
            return max(res.num_cached_tokens, own * self.block_size)
        with _tracer.start_as_current_span("kvstore.get", attributes={
                "kvmesh.blocks_wanted": len(res.block_hashes) - own}) as span:
            got = await self.fetches.get(res.block_hashes[own:])
            if got is None:
                return max(res.num_cached_tokens, own * self.block_size)
            got = KVBlocks(got.k, got.v, own, got.first_layer, got.hashes)  # where the chain starts in the prompt
            if not await self._run(WriteBlocks(rid, got)):  # cancelled meanwhile
                return own * self.block_size
            span.set_attribute("kvmesh.blocks_loaded", got.num_blocks)
        self.kvstore_hit_tokens += got.num_blocks * self.block_size
        return got.end_block * self.block_size
