"""The one owner of an engine's KV tiers: device pool, host tier, the kvstore beyond.

The block manager reports the cached blocks it gives up (evicted) and the cached prefixes a new request
reuses to a listener; this is that listener. It decides what to keep of those reports (nothing when no
tier below the device wants them), copies evicted blocks down a tier before anything overwrites them
(spill / finish_spills), holds the host tier and the offload queue, drains everything for a leaving
worker (evict_all), and answers the host part of the lookup chain device -> host -> kvstore.

Offload policies (shared/engine/offload.py sends what collect() returns):
eviction (the default): blocks flow down the tiers as they are pushed out. What the device pool gives
  up goes to the host tier when there is one, and what that drops goes on to the kvstore; without a host
  tier, evicted blocks go to the kvstore directly. A prefix that a second request reuses is sent at
  once: a shared prefix is the one other workers will want, and it should not wait for memory pressure.
write-through: every newly cached block is sent right after the step that filled it.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from contextlib import contextmanager

import torch

from shared.block_hash import BlockHash
from shared.engine.block_listener import BlockListener
from shared.engine.block_manager import BlockManager
from shared.engine.host_tier import HostTier
from shared.engine.offload import BlockStore, OffloadBatch
from shared.kv_blocks import KVBlocks
from shared.engine.block_events import BlockEvent, BlocksRemoved, BlocksStored

# Gathers physical blocks into K, V [layers, n, block_size, kv_heads, head_dim] on the cache's device.
Gather = Callable[[Seq[int]], tuple[torch.Tensor, torch.Tensor]]


class KVTiers(BlockListener):
    def __init__(self, block_manager: BlockManager, gather: Gather, host_kv_bytes: int, async_copies: bool) -> None:
        self._bm = block_manager  # reports to us; its event stream also carries what reached the host tier
        block_manager.listener = self
        self._gather = gather
        self.host = HostTier(host_kv_bytes) if host_kv_bytes > 0 else None
        # Blocks on their way to the kvstore under the eviction policy; None: this engine does not offload.
        self._offload: list[KVBlocks] | None = None
        self._evicted: list[tuple[BlockHash, int]] = []  # reported, not yet copied down
        self._reused: list[tuple[BlockHash, int]] = []  # reported shared prefixes, not yet offered to the store
        # Spilled blocks whose device-to-host copies may still run: hashes, K, V, the copies' event (or None).
        self._spills: list[tuple[list[bytes], torch.Tensor, torch.Tensor, torch.cuda.Event | None]] = []
        self._async = async_copies  # on CPU there is nothing to overlap with

    # --- the block manager's reports ------------------------------------------------------------

    def on_evicted(self, block_hash: BlockHash, block_id: int) -> None:
        if self.host is not None or self._offload is not None:
            self._evicted.append((block_hash, block_id))

    def on_reused(self, block_hash: BlockHash, block_id: int) -> None:
        if self._offload is not None:
            self._reused.append((block_hash, block_id))

    def offload_by_eviction(self) -> None:
        """From now on, what leaves the device (or the host tier) and shared prefixes go to the kvstore."""
        if self._offload is None:
            self._offload = []

    def forget_evicted(self) -> None:
        """Drop the blocks reported evicted without copying them anywhere (a bench emptying the device only)."""
        self._evicted.clear()

    # --- down the tiers -------------------------------------------------------------------------

    def spill(self, wait: bool = True) -> None:
        """Copy the blocks reported evicted since the last call down a tier (the host tier, else the offload
        queue), while their KV is still intact (nothing has written into them).

        On CUDA the blocks are gathered on the device and copied into pinned host memory without blocking,
        ordered before the forward that will overwrite them; with wait=False (a step) they reach the tier at
        the end of the step (finish_spills), by when the copy has long run, while the forward still does."""
        if self._evicted:
            evicted, self._evicted = self._evicted, []
            k, v, ready = self._read_async([b for _, b in evicted])
            self._spills.append(([h for h, _ in evicted], k, v, ready))
        if wait or not self._async:
            self.finish_spills()

    @contextmanager
    def step_spills(self) -> Iterator[None]:
        """Around one engine step, after its schedule: the blocks the schedule took from the cache are copied out
        before the forward overwrites them, and reach their tier when the step ends."""
        self.spill(wait=False)
        try:
            yield
        finally:
            self.finish_spills()

    def finish_spills(self) -> None:
        """Hand the spilled blocks to the host tier (or the offload queue) once their copies have run."""
        spills, self._spills = self._spills, []
        for hashes, k, v, ready in spills:
            if ready is not None:
                ready.synchronize()
                k, v = k.clone(), v.clone()  # pinned staging -> ordinary memory: the tier can be large
            blocks = KVBlocks(k, v, hashes=hashes)
            if self.host is None:
                assert self._offload is not None
                self._offload.append(blocks)
                continue
            stored, dropped = self.host.put(blocks)
            if dropped is not None and self._offload is not None:
                self._offload.append(dropped)  # out of the host tier: on down to the kvstore
            # Routers learn what moved: a worker's host tier makes it a better home for those prompts.
            if dropped is not None:
                self._bm.events.append(BlocksRemoved(hashes=dropped.hashes, tier="host"))
            if stored:
                self._bm.events.append(BlocksStored(hashes=stored, tier="host"))

    def _read_async(self, block_ids: Seq[int]):
        """(K, V, event): host copies of physical blocks, on CUDA pinned and still in flight until the event
        completes; on CPU done (event None)."""
        k, v = self._gather(block_ids)
        if not k.is_cuda:
            return k, v, None
        k_host = torch.empty(k.shape, dtype=k.dtype, pin_memory=True)
        v_host = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
        k_host.copy_(k, non_blocking=True)
        v_host.copy_(v, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return k_host, v_host, ready

    def evict_all(self) -> None:
        """A worker leaving the mesh: every cached block not in use leaves the device pool the way evictions
        do, and the host tier empties into the offload queue."""
        self._bm.reset_prefix_cache()
        self.spill()
        if self.host is not None and self._offload is not None:
            held = self.host.take_all()
            if held is not None:
                self._offload.append(held)

    # --- to the kvstore -------------------------------------------------------------------------

    def collect(self, events: list[BlockEvent], store: BlockStore, policy: str = "eviction") -> OffloadBatch | None:
        """Engine thread, after a step: the blocks to send now that the store lacks, with host copies."""
        if policy == "eviction":
            return self._collect_evicted(store)
        return self._collect_stored(events, store)

    def _collect_evicted(self, store: BlockStore) -> OffloadBatch | None:
        out, self._offload = self._offload or [], ([] if self._offload is not None else None)
        reused, self._reused = self._reused, []
        items = {h: part.blocks(i, i + 1) for part in out for i, h in enumerate(part.hashes) if store.needs_offload(h)}
        fresh: dict[bytes, int] = {}
        for h, block_id in reused:  # in use by the request that reused them: their KV is intact
            if h not in items and store.needs_offload(h):
                fresh[h] = block_id
        if fresh:
            items.update({h: b for h, b in zip(fresh, self._read(list(fresh.values()), list(fresh)).split_every(1))})
        if not items:
            return None
        return OffloadBatch(KVBlocks.gather(list(items.values())), [None] * len(items))

    def _collect_stored(self, events: list[BlockEvent], store: BlockStore) -> OffloadBatch | None:
        """Copy out the KV of blocks stored by this step that the store lacks (write-through)."""
        hashes: list[bytes] = []
        parents: list[bytes | None] = []
        block_ids: list[int] = []
        for e in events:
            if not isinstance(e, BlocksStored):
                continue
            for i, (h, block_id) in enumerate(zip(e.hashes, e.block_ids)):
                if store.needs_offload(h):
                    hashes.append(h)
                    parents.append(e.hashes[i - 1] if i else e.parent)
                    block_ids.append(block_id)
        if not hashes:
            return None
        return OffloadBatch(self._read(block_ids, hashes), parents)

    def _read(self, block_ids: Seq[int], hashes: list[bytes]) -> KVBlocks:
        k, v = self._gather(block_ids)
        return KVBlocks(k.cpu(), v.cpu(), hashes=hashes)

    # --- up the tiers ---------------------------------------------------------------------------

    def host_chain(self, hashes: list[bytes], first_block: int = 0) -> KVBlocks | None:
        """The longest run of `hashes` from the start held in the host tier (any thread)."""
        return self.host.get_chain(hashes, first_block) if self.host is not None else None

    @property
    def host_bytes(self) -> int:
        return self.host.stats.bytes if self.host is not None else 0

    def clear_host(self) -> None:
        if self.host is not None:
            self.host.clear()
