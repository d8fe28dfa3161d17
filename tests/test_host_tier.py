"""The host tier (issue 10 item 2): blocks evicted from a worker's device pool go to host memory and
come back from there without the network; a byte cap with LRU."""
from __future__ import annotations

import asyncio

import pytest
import torch

from shared.engine.host_tier import HostTier
from shared.kv_blocks import KVBlocks
from tests.engine_helpers import greedy, random_prompts
from tests.mesh_helpers import decode_service, generate, kvstore_service, running, wait_idle
from tests.nats_fixtures import nats_server  # noqa: F401


def blocks(hashes: list[bytes], start: int = 0) -> KVBlocks:
    n = len(hashes)
    k = torch.arange(start, start + n, dtype=torch.float32).view(1, n, 1, 1, 1).expand(2, n, 4, 1, 2).contiguous()
    return KVBlocks(k, -k, hashes=hashes)


def test_longest_run_lru_and_byte_cap() -> None:
    first = blocks([b"a", b"b", b"c", b"d"])
    k, v = first.k, first.v
    per_block = 2 * k[:, 0].numel() * 4
    tier = HostTier(capacity_bytes=5 * per_block)
    tier.put(first)
    got = tier.get_chain([b"a", b"b", b"x", b"d"], first_block=3)  # stops at the first miss
    assert got is not None and got.num_blocks == 2 and torch.equal(got.k, k[:, :2]) and torch.equal(got.v, v[:, :2])
    assert got.first_block == 3 and got.hashes == [b"a", b"b"]
    assert tier.get_chain([b"x"]) is None
    _, dropped = tier.put(blocks([b"e", b"f"], 10))  # 6 blocks do not fit in 5: the least recently used (c) goes
    assert dropped is not None and dropped.hashes == [b"c"] and torch.equal(dropped.k, k[:, 2:3])
    assert b"c" not in tier and all(h in tier for h in (b"a", b"b", b"d", b"e", b"f"))
    assert tier.stats.blocks == 5 and tier.stats.bytes == 5 * per_block and tier.stats.evicted_blocks == 1
    assert tier.stats.hit_blocks == 2


def test_an_evicted_prefix_comes_back_from_the_host_tier(nats_server, checkpoints, hf_reference) -> None:  # noqa: F811
    """A worker whose device pool holds one prompt at a time: the first prompt's blocks are evicted by
    the others, copied to the host tier on the way out, and loaded from there when it comes again; the
    tokens equal transformers' every time."""
    ckpt = checkpoints["qwen3"]
    first, *others = random_prompts([80, 81, 83], seed=31)
    decode = decode_service(ckpt, threshold=1 << 30, kvstore=False, num_kv_blocks=12, host_kv_bytes=64 << 20)

    async def main() -> None:
        async with running(nats_server, decode) as nc:
            for i, p in enumerate([first, *others, first]):
                tokens, chunks = await generate(nc, p, greedy(4, None), f"r{i}")
                ref, _ = hf_reference(ckpt, p, 4)
                assert tokens == ref
            assert chunks[0].num_cached_tokens == 79 // 16 * 16  # every full block before the last token, from the host
            tier = decode.engine.tiers.host
            assert tier.stats.stored_blocks >= 4 and tier.stats.hit_blocks >= 2  # what the device lost came back
            assert decode.host_hit_tokens == tier.stats.hit_blocks * 16
            beat = await decode._load_snapshot()  # what the gateway's kvmesh:kv_tier_hit_tokens{tier="host"} shows
            assert beat.host_tier_hit_tokens == decode.host_hit_tokens and beat.host_tier_bytes == tier.stats.bytes > 0
            assert beat.kvstore_hit_tokens == 0 and beat.prefix_cache_hits >= decode.host_hit_tokens
            await wait_idle(decode)

    asyncio.run(main())


@pytest.mark.parametrize("host_kv_bytes", [0, 1])
def test_evicted_blocks_flow_down_to_the_kvstore(nats_server, checkpoints, hf_reference, host_kv_bytes) -> None:  # noqa: F811
    """Offload by eviction (issue 10 item 4): with no host tier (0), or one too small for a block (1),
    what the device pool evicts goes to the kvstore, and comes back from there."""
    ckpt = checkpoints["qwen3"]
    first, *others = random_prompts([80, 81, 83], seed=32)
    decode = decode_service(ckpt, threshold=1 << 30, num_kv_blocks=12, host_kv_bytes=host_kv_bytes)
    store = kvstore_service()

    async def main() -> None:
        async with running(nats_server, store, decode) as nc:
            for i, p in enumerate([first, *others]):
                tokens, _ = await generate(nc, p, greedy(4, None), f"r{i}")
                assert tokens == hf_reference(ckpt, p, 4)[0]
            await decode.offloader.flush(5)
            assert store.tier.stats().blocks >= 4 and decode.offloader.dropped == 0
            tokens, chunks = await generate(nc, first, greedy(4, None), "again")
            assert tokens == hf_reference(ckpt, first, 4)[0]
            assert chunks[0].num_cached_tokens == 64 and decode.kvstore_hit_tokens > 0
            await wait_idle(decode)

    asyncio.run(main())
