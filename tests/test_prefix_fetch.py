"""One fetch per prefix (issue 10 item 6): concurrent loads of a shared prefix wait on one fetch."""
from __future__ import annotations

import asyncio

import torch

from shared.kv_blocks import KVBlocks
from shared.engine.prefix_fetch import PrefixFetches


def _store(n_blocks: int) -> dict[bytes, int]:
    return {bytes([i]) * 16: i for i in range(n_blocks)}


def test_concurrent_loads_of_one_prefix_share_one_fetch() -> None:
    stored = _store(6)  # the kvstore holds blocks 0..5 of one chain
    calls: list[list[bytes]] = []

    async def fetch(hashes: list[bytes]):  # the kvstore's longest-stored-prefix rule, slow like a network
        calls.append(hashes)
        await asyncio.sleep(0.05)
        n = next((i for i, h in enumerate(hashes) if h not in stored), len(hashes))
        k = torch.tensor([[stored[h] for h in hashes[:n]]], dtype=torch.float32).view(1, n, 1, 1, 1)
        return KVBlocks(k, -k, hashes=hashes[:n]) if n else None

    chain = list(stored)
    other_tail = chain[:4] + [b"\xee" * 16, b"\xef" * 16]  # shares 4 blocks, then diverges

    async def go():
        f = PrefixFetches(fetch)
        results = await asyncio.gather(f.get(chain), f.get(chain), f.get(chain[:3]), f.get(other_tail),
                                       f.get([b"\x77" * 16]))
        return f, results

    f, (a, b, c, d, unrelated) = asyncio.run(go())
    assert len(calls) == 2, "one fetch for the shared chain, one for the unrelated one"
    assert f.joined == 3
    assert a.k.flatten().tolist() == b.k.flatten().tolist() == [0, 1, 2, 3, 4, 5] and a.hashes == chain
    assert c.k.flatten().tolist() == [0, 1, 2] and d.k.flatten().tolist() == [0, 1, 2, 3]
    assert d.hashes == chain[:4] and torch.equal(d.v, -d.k) and unrelated is None


def test_a_failed_fetch_makes_joiners_compute_and_the_next_request_fetches_again() -> None:
    attempts = []

    async def fetch(hashes):
        attempts.append(1)
        await asyncio.sleep(0.02)
        if len(attempts) == 1:
            raise ConnectionError("kvstore gone")
        return KVBlocks(torch.ones(1, 1, 1, 1, 1), torch.ones(1, 1, 1, 1, 1))

    async def go():
        f = PrefixFetches(fetch)
        first, joiner = await asyncio.gather(f.get([b"a"]), f.get([b"a"]), return_exceptions=True)
        later = await f.get([b"a"])
        return first, joiner, later

    first, joiner, later = asyncio.run(go())
    assert isinstance(first, ConnectionError) and joiner is None and later is not None and len(attempts) == 2
