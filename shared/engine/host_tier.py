"""The host tier of one engine (Dynamo's G2, vLLM's CPU offload): KV blocks evicted from the device pool
are copied to host memory just before their blocks are overwritten, and a later prompt that needs
them loads them from here, without the network and without recomputing.

Keyed by block hash (a hash names the whole prefix, so a chain lookup is a walk over hashes); LRU
under a byte cap. Written on the engine thread, read from the event loop: one lock. Blocks are stored
as they left the device (same dtype, FP8 included), in ordinary (pageable) host memory. On CUDA the copy
out goes through pinned memory without blocking the step (KVTiers.spill / finish_spills in shared/engine/kv_tiers.py); the
copy back in is synchronous.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from shared.engine.kv_cache import KV


@dataclass
class HostTierStats:
    blocks: int = 0
    bytes: int = 0
    stored_blocks: int = 0  # cumulative
    evicted_blocks: int = 0  # dropped for room (cumulative)
    hit_blocks: int = 0  # served to a prompt (cumulative)


class HostTier:
    def __init__(self, capacity_bytes: int) -> None:
        assert capacity_bytes > 0, "a host tier needs a positive byte cap"
        self.capacity = capacity_bytes
        self._blocks: OrderedDict[bytes, KV] = OrderedDict()  # hash -> K, V [layers, block_size, heads, dim]
        self._lock = threading.Lock()
        self.stats = HostTierStats()

    def put(self, hashes: list[bytes], k: torch.Tensor, v: torch.Tensor
            ) -> tuple[list[bytes], list[tuple[bytes, torch.Tensor, torch.Tensor]]]:
        """k, v [layers, n, block_size, heads, dim] (host copies the caller gives up) of blocks `hashes`.
        Returns the hashes newly held and the blocks dropped for room, with their KV (what routers are
        told, and what may flow on down to the kvstore)."""
        per_block = 2 * k[:, 0].numel() * k.element_size() if k.shape[1] else 0
        stored: list[bytes] = []
        dropped: list[tuple[bytes, torch.Tensor, torch.Tensor]] = []
        if per_block > self.capacity:  # nothing fits: every block goes straight on down
            return stored, [(h, k[:, i], v[:, i]) for i, h in enumerate(hashes)]
        with self._lock:
            for i, h in enumerate(hashes):
                if h in self._blocks:
                    self._blocks.move_to_end(h)
                    continue
                while self.stats.bytes + per_block > self.capacity:
                    h_old, (k_old, v_old) = self._blocks.popitem(last=False)
                    dropped.append((h_old, k_old, v_old))
                    self.stats.bytes -= per_block
                    self.stats.blocks -= 1
                    self.stats.evicted_blocks += 1
                self._blocks[h] = (k[:, i], v[:, i])
                self.stats.bytes += per_block
                self.stats.blocks += 1
                self.stats.stored_blocks += 1
                stored.append(h)
        return stored, dropped

    def get_chain(self, hashes: list[bytes]) -> KV | None:
        """K, V [layers, n, ...] of the longest run of `hashes` from the start held here (fresh tensors)."""
        with self._lock:
            found = []
            for h in hashes:
                kv = self._blocks.get(h)
                if kv is None:
                    break
                self._blocks.move_to_end(h)
                found.append(kv)
            self.stats.hit_blocks += len(found)
        if not found:
            return None
        return torch.stack([k for k, _ in found], dim=1), torch.stack([v for _, v in found], dim=1)

    def take_all(self) -> list[tuple[bytes, torch.Tensor, torch.Tensor]]:
        """Empties the tier, oldest first, handing its blocks over (a worker leaving the mesh)."""
        with self._lock:
            blocks = [(h, k, v) for h, (k, v) in self._blocks.items()]
            self._blocks.clear()
            self.stats.blocks = self.stats.bytes = 0
        return blocks

    def clear(self) -> None:
        self.take_all()

    def __contains__(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._blocks
