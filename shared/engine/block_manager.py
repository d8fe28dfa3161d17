"""Paged KV block allocation with reference counts and a hash-keyed prefix cache.

Freed blocks that hold a full, hashed block stay in the cache and are only evicted (least recently
freed first) when a fresh block is needed; a prefix hit revives them. Blocks without a hash are
handed out before any cached block is evicted.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from shared.block_hash import BlockHash, hash_blocks, lora_root, salted_root
from shared.engine.block_events import BlockEvent, BlocksRemoved, BlocksStored
from shared.engine.block_listener import BlockListener
from shared.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, root: BlockHash, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.root = root
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[BlockHash, int] = {}
        self.events: list[BlockEvent] = []
        # Told of cached blocks given up for reuse (while their KV is intact) and of cached prefixes a new
        # request reuses: the engine's KV tiers (shared/engine/kv_tiers.py) decide what to keep of that.
        self.listener = BlockListener()
        self.num_registered: dict[str, int] = {}  # request id -> leading blocks already offered to the cache
        self.hits = 0  # prompt tokens served from the cache
        self.queries = 0  # prompt tokens looked up

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _update_hashes(self, seq: Sequence) -> None:
        full = seq.num_tokens // self.block_size
        if len(seq.block_hashes) < full:
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.extend(
                hash_blocks(lora_root(salted_root(self.root, seq.params.cache_salt), seq.lora_digest), seq.token_ids, self.block_size, parent, len(seq.block_hashes))
            )

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Cached blocks covering the longest prefix of seq; at least one token is always left to compute."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed here
        self._update_hashes(seq)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in seq.block_hashes[:max_blocks]:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed: list[int] = ()) -> bool:
        held = len(seq.block_table) or len(computed)
        computed_tokens = seq.num_computed_tokens if seq.block_table else len(computed) * self.block_size
        needed = self.blocks_for(computed_tokens + num_new_tokens) - held
        # Cached-but-free hits leave the free list when touched, so they cannot also serve as new blocks.
        reviving = sum(1 for b in computed if self.ref_counts[b] == 0) if not seq.block_table else 0
        return needed <= len(self.free) - reviving

    def allocate(self, seq: Sequence, num_new_tokens: int, computed: list[int] = ()) -> bool:
        """Give seq blocks for num_new_tokens more tokens (first admission: after the computed hits).

        Returns False and changes nothing when there are not enough free blocks.
        """
        if not self.can_allocate(seq, num_new_tokens, computed):
            return False
        if not seq.block_table:
            if self.enable_prefix_caching:
                self._update_hashes(seq)
                prompt_lookup = (seq.num_tokens - 1) // self.block_size * self.block_size
                self.queries += prompt_lookup
                self.hits += len(computed) * self.block_size
            for b in computed:
                self._touch(b)
            for b in computed:
                self.listener.on_reused(self.block_hash[b], b)  # type: ignore[arg-type]
            seq.block_table = list(computed)
            seq.num_computed_tokens = len(computed) * self.block_size
            seq.num_cached_tokens = seq.num_computed_tokens
            self.num_registered[seq.request_id] = len(computed)
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())
        return True

    def _touch(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self.free[block_id]
        self.ref_counts[block_id] += 1

    def _take_free_block(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        h = self.block_hash[block_id]
        if h is not None:
            self.block_hash[block_id] = None
            if self.cached.get(h) == block_id:
                del self.cached[h]
                self._removed(h, block_id)
        self.ref_counts[block_id] = 1
        return block_id

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Offer seq's newly completed full blocks to the prefix cache (after their KV was computed)."""
        if not self.enable_prefix_caching:
            return
        done = self.num_registered.get(seq.request_id, 0)
        full = seq.num_computed_tokens // self.block_size
        if full <= done:
            return
        self._update_hashes(seq)
        for i in range(done, full):
            h, block_id = seq.block_hashes[i], seq.block_table[i]
            # A block computed twice (two requests prefilling the same prompt at once) stays private.
            if h not in self.cached and self.block_hash[block_id] is None:
                self.cached[h] = block_id
                self.block_hash[block_id] = h
                self._stored(h, seq.block_hashes[i - 1] if i else None, block_id)
        self.num_registered[seq.request_id] = full

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past those seq's tokens need: after a verify step, the ones that held only rejected
        drafts. They are private (never cached: nothing past the computed tokens is) and go to the front of the
        free list. The list is replaced, not cut in place: the runner's block tables (block_tables.py) mirror a
        list that only grows, and copy a new one from the start."""
        keep = self.blocks_for(seq.num_tokens)
        if len(seq.block_table) <= keep:
            return
        for block_id in seq.block_table[keep:]:
            assert self.ref_counts[block_id] == 1 and self.block_hash[block_id] is None, f"block {block_id} is shared"
            self.ref_counts[block_id] = 0
            self.free[block_id] = None
            self.free.move_to_end(block_id, last=False)
        seq.block_table = seq.block_table[:keep]

    def free_blocks(self, seq: Sequence) -> None:
        # Reverse order: a chain's tail is least useful, so it lands first in the eviction order.
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] >= 0, f"block {block_id} freed twice"
            if self.ref_counts[block_id] == 0:
                self.free[block_id] = None
                if self.block_hash[block_id] is None:
                    self.free.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_computed_tokens = 0
        self.num_registered.pop(seq.request_id, None)

    def _stored(self, h: BlockHash, parent: BlockHash | None, block_id: int) -> None:
        # A block that extends the chain of the event before it joins that event: one message per chain.
        last = self.events[-1] if self.events else None
        if isinstance(last, BlocksStored) and last.tier == "device" and parent is not None and last.hashes[-1] == parent:
            last.hashes.append(h)
            last.block_ids.append(block_id)
        else:
            self.events.append(BlocksStored(hashes=[h], parent=parent, block_ids=[block_id]))

    def _removed(self, h: BlockHash, block_id: int) -> None:
        self.listener.on_evicted(h, block_id)
        last = self.events[-1] if self.events else None
        if isinstance(last, BlocksRemoved) and last.tier == "device":
            last.hashes.append(h)
            last.block_ids.append(block_id)
        else:
            self.events.append(BlocksRemoved(hashes=[h], block_ids=[block_id]))

    def drain_events(self) -> list[BlockEvent]:
        events, self.events = self.events, []
        return events

    def reset_prefix_cache(self) -> None:
        for h, block_id in list(self.cached.items()):
            if self.ref_counts[block_id] == 0:
                del self.cached[h]
                self.block_hash[block_id] = None
                self.free.move_to_end(block_id, last=False)
                self._removed(h, block_id)

    def check_integrity(self, live: Iterable[Sequence] = ()) -> None:
        """Assert every invariant; live = every sequence that may hold blocks."""
        refs = [0] * self.num_blocks
        for seq in live:
            assert len(set(seq.block_table)) == len(seq.block_table), f"{seq.request_id}: block listed twice"
            assert seq.num_computed_tokens <= len(seq.block_table) * self.block_size, seq.request_id
            for b in seq.block_table:
                refs[b] += 1
        assert refs == self.ref_counts, "reference counts disagree with the block tables"
        free = {b for b in range(self.num_blocks) if self.ref_counts[b] == 0}
        assert free == set(self.free), "free list disagrees with reference counts"
        for h, b in self.cached.items():
            assert self.block_hash[b] == h, f"cache maps a hash to block {b}, which holds another"
        for b, h in enumerate(self.block_hash):
            assert h is None or self.cached.get(h) == b, f"block {b} holds a hash the cache does not map to it"
