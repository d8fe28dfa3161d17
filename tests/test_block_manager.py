"""Block manager invariants without a model: hashing, prefix reuse, LRU eviction, events."""
from __future__ import annotations

import subprocess
import sys

from shared.block_hash import hash_blocks, root_hash
from shared import wire
from services.engine_worker import to_wire
from shared.engine.block_events import BlocksRemoved, BlocksStored
from shared.protocol.events import BlockStored
from shared.engine.block_manager import BlockManager
from shared.sampling_params import SamplingParams
from shared.engine.sequence import Sequence

BS = 4
ROOT = root_hash("m", BS, "float32")


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(max_tokens=4))


def admit(bm: BlockManager, s: Sequence) -> list[int]:
    computed = bm.get_computed_blocks(s)
    assert bm.allocate(s, s.num_tokens - len(computed) * BS, computed)
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)
    return computed


def test_hash_is_chained_and_seeded():
    a = hash_blocks(ROOT, [1, 2, 3, 4, 5, 6, 7, 8], BS)
    b = hash_blocks(ROOT, [9, 9, 9, 9, 5, 6, 7, 8], BS)
    assert a[1] != b[1], "the same block after a different prefix must hash differently"
    assert hash_blocks(root_hash("m", BS, "float32", salt="tenant"), [1, 2, 3, 4], BS)[0] != a[0]
    assert hash_blocks(root_hash("other", BS, "float32"), [1, 2, 3, 4], BS)[0] != a[0]
    assert len(hash_blocks(ROOT, list(range(11)), BS)) == 2, "only full blocks are hashed"


def test_hash_is_identical_across_processes():
    code = ("from shared.block_hash import hash_blocks, root_hash;"
            "print(hash_blocks(root_hash('m', 4, 'float32'), list(range(12)), 4)[-1].hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": str(i), "PATH": ""}).stdout.strip() for i in range(3)}
    assert outs == {hash_blocks(ROOT, list(range(12)), BS)[-1].hex()}


def test_prefix_hit_only_with_same_chain():
    bm = BlockManager(16, BS, ROOT)
    a = seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(bm, a)
    same_second_block = seq("b", [0, 0, 0, 0, 5, 6, 7, 8, 9])
    assert bm.get_computed_blocks(same_second_block) == []
    mid_block = seq("c", [1, 2, 3, 4, 5, 6, 7, 99, 9])  # diverges inside block 2
    assert bm.get_computed_blocks(mid_block) == a.block_table[:1]
    bm.check_integrity([a])


def test_full_hit_still_leaves_one_token_to_compute():
    bm = BlockManager(16, BS, ROOT)
    a = seq("a", [1, 2, 3, 4, 5, 6, 7, 8])
    admit(bm, a)
    b = seq("b", [1, 2, 3, 4, 5, 6, 7, 8])
    assert len(bm.get_computed_blocks(b)) == 1


def test_freed_blocks_stay_cached_and_revive():
    bm = BlockManager(8, BS, ROOT)
    a = seq("a", list(range(9)))  # 2 full blocks + 1
    admit(bm, a)
    bm.free_blocks(a)
    assert bm.num_free_blocks == 8 and len(bm.cached) == 2
    b = seq("b", list(range(9)))
    computed = admit(bm, b)
    assert len(computed) == 2 and b.num_cached_tokens == 8
    assert bm.ref_counts[computed[0]] == 1
    bm.check_integrity([b])


def test_uncached_blocks_are_used_before_evicting_and_eviction_is_lru():
    bm = BlockManager(6, BS, ROOT)
    a = seq("a", list(range(8)) + [100])  # blocks: A0 A1 + partial
    admit(bm, a)
    bm.free_blocks(a)
    bm.drain_events()
    b = seq("b", [50 + i for i in range(20)])  # needs 5 blocks: 4 uncached free, then one eviction
    admit(bm, b)
    removed = [e for e in bm.drain_events() if isinstance(e, BlocksRemoved)]
    assert len(removed) == 1 and len(removed[0].hashes) == 1 == len(removed[0].block_ids)
    # The chain's tail (A1) goes before its head (A0).
    assert removed[0].hashes[0] == hash_blocks(ROOT, list(range(8)), BS)[1]
    assert bm.get_computed_blocks(seq("c", list(range(8)) + [1])) != []
    bm.check_integrity([b])


def test_events_and_duplicate_blocks():
    bm = BlockManager(16, BS, ROOT)
    a, b = seq("a", list(range(9))), seq("b", list(range(9)))
    # Both computed in the same step, before either is cached: the second copy stays private.
    for s in (a, b):
        assert bm.allocate(s, s.num_tokens)
    for s in (a, b):
        s.num_computed_tokens = s.num_tokens
        bm.cache_full_blocks(s)
    (stored,) = bm.drain_events()  # one chain of two blocks, a's; b's copy is private
    assert isinstance(stored, BlocksStored) and stored.parent is None
    assert stored.hashes == hash_blocks(ROOT, list(range(8)), BS) and stored.block_ids == a.block_table[:2]
    # block_ids are this process's: the worker's edge sends the event without them.
    sent = wire.decode(wire.encode(to_wire(stored, "w")), BlockStored)
    assert sent.hashes == stored.hashes and sent.worker_id == "w" and sent.parent is None
    assert "block_ids" not in BlockStored.model_fields
    bm.check_integrity([a, b])
    bm.free_blocks(a)
    bm.free_blocks(b)
    bm.check_integrity([])
    assert bm.num_free_blocks == 16


def test_allocation_failure_changes_nothing():
    bm = BlockManager(2, BS, ROOT)
    s = seq("a", list(range(12)))
    assert not bm.allocate(s, 12)
    assert s.block_table == [] and bm.num_free_blocks == 2
    bm.check_integrity([s])
